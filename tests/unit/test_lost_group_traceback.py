"""How a rank formats a cell's error (engine/runtime.py), in a real IPython shell without a cluster: the error of a
lost process group in IPython's plain mode (after a death every rank formats one at once, and a recovery never shows
them), still with the cell line nbdist reads; the user's own errors, before and after, with IPython's context."""

from __future__ import annotations

import types

import pytest
from ipykernel.compiler import XCachingCompiler
from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config

from nbdist.engine import runtime
from nbdist.engine.state import STATE
from nbdist.results import ANSI, remote_error

GLOO = (
    "def step():\n"
    "    raise RuntimeError('[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
    "[127.0.0.1]:400: Connection reset by peer')\n"
    "step()\n"
)
RELEASED = (
    "def step():\n    raise KeyboardInterrupt\nstep()\n"  # the release's SIGINT, after the watcher broke the group
)
OWN = "def mine():\n    return 1 / 0\nmine()\n"


@pytest.fixture
def shell():
    config = Config()
    config.HistoryManager.hist_file = ":memory:"
    sh = InteractiveShell(config=config, compiler_class=XCachingCompiler)  # an engine's: cells are 'Cell In[n]'
    sh.shown = []
    sh._showtraceback = lambda etype, evalue, stb: sh.shown.append(ANSI.sub("", "".join(stb)))  # noqa: SLF001
    runtime.traceback_uninterrupted(sh)
    yield sh
    STATE.aborted = False


def _context(text: str) -> bool:
    return "---->" in text  # IPython's context mode marks the line with an arrow among its neighbours


def _line(text: str) -> int | None:
    return remote_error(types.SimpleNamespace(ename="E", evalue="", traceback=text.splitlines()))["line"]


@pytest.mark.parametrize(("code", "aborted"), [(GLOO, False), (RELEASED, True)], ids=["gloo-lost-a-peer", "released"])
def test_a_lost_groups_error_is_plain_and_the_users_own_errors_keep_their_context(shell, code, aborted):
    shell.run_cell(OWN, store_history=True)
    STATE.aborted = aborted
    shell.run_cell(code, store_history=True)
    STATE.aborted = False
    shell.run_cell(OWN, store_history=True)
    before, lost, after = shell.shown
    assert _context(before) and _context(after), (before, after)
    assert not _context(lost) and lost.startswith("Traceback (most recent call last)"), lost
    assert _line(lost) == 2, lost  # the cell line the chips and the summary name
    stored = ANSI.sub("", "".join(shell.history_manager.exceptions[2]["traceback"]))  # IPython 9 formats it again
    assert not _context(stored), stored


def test_a_release_that_did_not_break_the_group_keeps_the_context(shell):
    """A Ctrl-C out of a loop that holds no collective: the person's own interrupt, shown as IPython shows it."""
    shell.run_cell(RELEASED, store_history=True)
    assert _context(shell.shown[0]), shell.shown[0]
