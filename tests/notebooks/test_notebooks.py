"""Every notebook runs top to bottom with nbclient on a real kernel, and stops the clusters it starts."""

from __future__ import annotations

import pathlib

import nbformat
import psutil
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).parents[2] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit notebooks without outputs"
    assert "widgets" not in nb.metadata, "commit notebooks without widget state"
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    # timeout: a cell that runs 4 minutes hangs (every notebook runs in about 3 minutes in all)
    client = NotebookClient(nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    text = "\n".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "stream"
    )
    if path.name.startswith("00_"):
        assert "[rank 0] after all_reduce: [3.0, 3.0, 3.0]" in text
        assert "[rank 1] my slice of the sum: [14.0, 16.0]" in text
        errors = [o for c in nb.cells for o in c.get("outputs", []) if o.output_type == "error"]
        assert len(errors) == 1 and errors[0]["ename"] == "RankError"
        assert "[rank 1] the world works again: 2.0" in text
    left = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert not [p for p in left if psutil.pid_exists(p)], "the notebook must stop its cluster"
