"""What a rank says of a cell's SystemExit (engine/exits.py), without a cluster: the status Python gives each
code, the line it came from, and the one line of text for each kind of exit."""

from __future__ import annotations

import argparse
import sys

import pytest

from nbdist.engine import exits


@pytest.mark.parametrize(
    ("code", "status"), [(None, 0), (0, 0), (3, 3), (True, 1), (False, 0), ("bad config", 1), (3.5, 1), ([2], 1)]
)
def test_the_status_is_the_one_python_exits_with(code, status):
    assert exits.status_of(code) == status


def _said(fn, filename="<ipython-input-1>"):
    try:
        exec(compile("fn()\n", filename, "exec"), {"fn": fn})
    except SystemExit as exc:
        return exits.describe(exc, sys.exc_info()[2])
    raise AssertionError("no SystemExit")


def test_each_exit_is_one_line_with_its_status_and_the_cell_line():
    said = _said(lambda: exits.EXIT())
    assert said["status"] == 0 and said["line"] == 1 and "status 0 at cell line 1" in said["text"]
    said = _said(lambda: sys.exit(3))
    assert said["status"] == 3 and "status 3 at cell line 1" in said["text"] and "exit(0) is success" in said["text"]
    said = _said(lambda: exits.QUIT("bad config"))
    assert said["status"] == 1 and "with message 'bad config'" in said["text"]
    said = _said(lambda: sys.exit(3.5))
    assert said["code"] == "3.5" and "float is not a status" in said["text"] and "pass an int" in said["text"]
    said = _said(lambda: sys.exit(0), filename="/lib/some_library.py")  # not a cell: no line to name
    assert said["line"] is None and "at cell line" not in said["text"]


def test_argparse_in_a_cell_names_the_missing_command_line_and_the_fix():
    parser = argparse.ArgumentParser(prog=exits.CELL_ARGV)
    parser.add_argument("--steps", required=True)
    said = _said(lambda: parser.parse_args([]))
    assert said["status"] == 2 and "a cell has no command line" in said["text"]
    assert "parser.parse_args(['--epochs', '1'])" in said["text"] and "%dist_run" in said["text"]


def test_a_scripts_exit_and_quit_raise_systemexit_and_say_what_they_are():
    with pytest.raises(SystemExit) as err:
        exits.EXIT(4)
    assert err.value.code == 4
    assert "quit()" in repr(exits.QUIT)
    assert exits.script_builtins()["exit"] is exits.EXIT and "print" in exits.script_builtins()
