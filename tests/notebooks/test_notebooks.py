"""Every notebook runs top to bottom with nbclient on a real kernel, and stops the clusters it starts."""

from __future__ import annotations

import os
import pathlib

import nbformat
import psutil
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).parents[2] / "notebooks").glob("*.ipynb"))
MULTINODE = NOTEBOOKS[0].parent / "07_multinode.ipynb"


def _execute(path: pathlib.Path, tmp_path: pathlib.Path) -> tuple[nbformat.NotebookNode, str]:
    """Run the notebook on a real kernel; its stream output; check it left no process behind."""
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit notebooks without outputs"
    assert "widgets" not in nb.metadata, "commit notebooks without widget state"
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    # timeout: a cell that runs 4 minutes hangs (every notebook runs in about 3 minutes in all)
    client = NotebookClient(nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    left = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert not [p for p in left if psutil.pid_exists(p)], "the notebook must stop its cluster"
    return nb, "\n".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "stream"
    )


def test_multinode_notebook_on_a_two_node_slurm(slurm, tmp_path):
    _, text = _execute(MULTINODE, tmp_path)
    assert "Slurm reachable: True" in text
    assert "2 ranks ready" not in text  # the API, not the magic, started it
    assert "hosts by rank: ['node1', 'node2']" in text or "hosts by rank: ['node2', 'node1']" in text
    assert "DDP across 2 host(s) == one process" in text
    assert "cancelled Slurm job(s)" in text
    assert slurm.wait_empty(30) == []


def test_multinode_notebook_without_slurm_says_so_and_shows_the_batch_script(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", ":".join(p for p in os.environ["PATH"].split(":") if not os.path.exists(f"{p}/sbatch")))
    _, text = _execute(MULTINODE, tmp_path)
    assert "Slurm reachable: False" in text
    assert "#SBATCH --nodes=2" in text and "exec srun" in text
    assert "DDP across 1 host(s) == one process" in text


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if p != MULTINODE], ids=lambda p: p.name)
def test_notebook_runs_top_to_bottom(path, tmp_path):
    nb, text = _execute(path, tmp_path)
    if path.name.startswith("00_"):
        assert "[rank 0] after all_reduce: [3.0, 3.0, 3.0]" in text
        assert "[rank 1] my slice of the sum: [14.0, 16.0]" in text
        errors = [o for c in nb.cells for o in c.get("outputs", []) if o.output_type == "error"]
        assert len(errors) == 1 and errors[0]["ename"] == "RankError"
        assert "[rank 1] the world works again: 2.0" in text
        # ranks are new interpreters, not forks of the kernel: the kernel's CUDA is never theirs
        for rank in (0, 1):
            assert f"[rank {rank}] started as: python -m nbdist.engine" in text
        assert text.count("| CUDA initialised in this rank: False") == 2
        assert "[rank 1] and the world works: 2.0" in text
