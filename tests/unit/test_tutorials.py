"""python -m nbdist.tutorials DEST: the notebooks written out, updated where the user left them alone,
never overwritten where the user edited them unless --force (issue 30). The wheel's copy is
tested in tests/packaging; here the checkout's notebooks are the source."""

from __future__ import annotations

import hashlib
import json
import pathlib

import pytest

from nbdist import tutorials
from nbdist.errors import ConfigError
from nbdist.tutorials.__main__ import main

REPO_NOTEBOOKS = pathlib.Path(__file__).resolve().parents[2] / "notebooks"


def test_the_source_is_the_checkouts_notebooks_and_a_copy_is_byte_identical(tmp_path):
    assert tutorials.source() == REPO_NOTEBOOKS
    done = tutorials.copy(tmp_path / "t")
    assert sorted(done.written) == sorted(p.name for p in REPO_NOTEBOOKS.iterdir() if p.suffix in (".ipynb", ".md"))
    for name in done.written:
        assert (tmp_path / "t" / name).read_bytes() == (REPO_NOTEBOOKS / name).read_bytes()
    again = tutorials.copy(tmp_path / "t")
    assert again.written == [] and sorted(again.unchanged) == sorted(done.written)


def test_an_edited_notebook_stops_the_copy_before_anything_is_written_and_force_replaces_it(tmp_path, capsys):
    dest = tmp_path / "t"
    tutorials.copy(dest)
    (dest / "02_fsdp.ipynb").write_text("my notes")
    (dest / "03_pipeline.ipynb").unlink()  # deleted by the user: written again, that loses nothing
    with pytest.raises(ConfigError, match=r"02_fsdp.ipynb in .* differ from the notebooks nbdist wrote there"):
        tutorials.copy(dest)
    assert not (dest / "03_pipeline.ipynb").exists(), "nothing is written when one file is refused"
    assert main([str(dest)]) == 2 and "--force" in capsys.readouterr().err
    assert (dest / "02_fsdp.ipynb").read_text() == "my notes"
    assert main([str(dest), "--force"]) == 0
    assert "wrote 2 file(s)" in capsys.readouterr().out
    assert (dest / "02_fsdp.ipynb").read_bytes() == (REPO_NOTEBOOKS / "02_fsdp.ipynb").read_bytes()


def test_a_notebook_the_user_left_alone_is_updated_to_the_new_version(tmp_path):
    """What an upgrade of nbdist looks like in DEST: the file and the manifest hold the old version."""
    dest = tmp_path / "t"
    tutorials.copy(dest)
    old = b'{"cells": [], "old": true}'
    (dest / "04_tensor_parallel.ipynb").write_bytes(old)
    manifest = json.loads((dest / tutorials.MANIFEST).read_text())
    manifest["04_tensor_parallel.ipynb"] = hashlib.sha256(old).hexdigest()
    (dest / tutorials.MANIFEST).write_text(json.dumps(manifest))
    assert tutorials.copy(dest).written == ["04_tensor_parallel.ipynb"]
    assert (dest / "04_tensor_parallel.ipynb").read_bytes() == (
        REPO_NOTEBOOKS / "04_tensor_parallel.ipynb"
    ).read_bytes()


def test_a_file_as_destination_is_one_line(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="is a file; name a folder"):
        tutorials.copy(tmp_path / "f")
