"""Every notebook runs top to bottom with nbclient on a real kernel, and stops the clusters it starts."""

from __future__ import annotations

import ast
import glob
import os
import pathlib
import re
import tempfile

import nbformat
import psutil
import pytest
from nbclient import NotebookClient

from tests.helpers import rank_said

NOTEBOOKS = sorted((pathlib.Path(__file__).parents[2] / "notebooks").glob("*.ipynb"))
MULTINODE = NOTEBOOKS[0].parent / "07_multinode.ipynb"


# What a notebook must have printed (its own asserts check the loose bounds; these check the lesson ran and said so).
SHOWN = {
    "01_": [
        "4 x 4, no_sync           all-reduces 1",
        "4 x 4, no_sync too late  all-reduces 4",
        "resumed at step 60 with identical weights: True",
        "an unused head without find_unused_parameters: Expected to have finished reduction",
        "linear 0.8, 20-step warm-up    loss over the last 30 steps",
    ],
    "02_": [
        "FSDP rank 0: shards add up to 2.01 MiB, MemTracker measured 2.01 MiB held",
        "bytes sent per byte of a 1 MiB tensor: {'all_reduce': 1.0, 'reduce_scatter': 1.0, 'all_gather': 0.5}",
    ],
    "05_": [
        "4 ranks, topk:0.01: model 0.096 MB, measured",
        "top-k 1% sends as many bytes as the all-reduce at N = 100 ranks (model)",
        "top-k stops paying at about",
    ],
    "06_": ["communication: guides < 5% of a step; the dashboard measured", "speedup on 2 ranks: guides 1.95x; %dist_bench measured"],
    "09_": [
        "ZeRO-1: Adam state per rank 0.50x",
        "FSDP (ZeRO-3): parameters 0.50x",
        "activation checkpointing: activations -",
        "FSDP, keep after forward (ZeRO-2)",
    ],
    "10_": [
        "EADDRINUSE",
        "Timed out",
        "rank 0 called allreduce([3] float)",
        "without clipping the loss left the numbers at step",
        "lr 0.02 without clipping: loss",
        "DefaultCPUAllocator: can't allocate memory",
        "[rank 1] batch sizes with drop_last=False: [4, 1]; with drop_last=True: [4]",
        "did not finish in time",
    ],
    "17_": [
        "4 ranks and 1 rank: loss within",
        "named: per_rank_batch at step 0",
        "named: padding at step 3",
        "named: batchnorm at step 0",
        "named: same_random at step 0",
        "cannot tell: no training step was seen",
        "named: data on rank 3",
        "named: save on rank 3",
        "named: hang on rank 3",
    ],
    "11_": [
        "first batch of epoch 2:",
        "when they persist",
        "split by rank and worker: 96 samples, each read once; split by rank only: 96 samples read twice",
        "both ranks finished their uneven inputs, with the same final weights: True",
        "without padding = one process (10/11): True",
    ],
    "12_": [
        "largest difference from one process, over every rank and weight",
        "per step: TP adds 3 activation all-reduces; HSDP adds 2 gradient all-reduces across rows",
        "[rank 3] rank 3: row 1 of the mesh",
    ],
    "14_": [
        "the guide's script, ranks the tasks see: [0, 0] | each task reading its own: [0, 1]",
        "row layer, do the ranks agree on the output? guide: False | fixed: True",
        "fp32 Adam, ZeRO-1 on 2 ranks: 1.33x less held per rank (formula 1.33x)",
    ],
    "15_": [
        "bytes allocated while building: 0;",
        "with explicit prefetching, the same weights bit for bit: True",
        "saved on 4 ranks, loaded on 2, 2 more steps: largest difference from one process's 5 steps",
        "the checkpoint holds the weights of the moment it was taken: True (training moved on: True)",
    ],
    "16_": [
        "batch shell: USR1, passed on to torchrun | signal: saved at step",
        "ended with the uninterrupted run's weights, bit for bit: True",
        "foreground torchrun: finished all 60 steps | batch shell: USR1 trapped",
        "the first collective not every rank entered: #",
    ],
    "13_": [
        "same final weights as the notebook, bit for bit: True",
        "wrote train.py (3 cell(s)) and train.sbatch",
        "[rank 0] nbdist: init_process_group('gloo') kept the world nbdist built (2 ranks, gloo)",
        "[rank 1] the world after the script: 2.0 | the script's main() is here: True",
        "the same final weights on both ranks as python tutorial_ddp.py's processes, bit for bit: True",
        "[rank 1] the world after exit(): 2.0",
        "[rank 0] Accelerate sees 2 processes",
        "[rank 1] Accelerate sees 2 processes",
        "[rank 1] the world after three libraries: 2.0",
    ],
}


def _execute(
    path: pathlib.Path, tmp_path: pathlib.Path, others: tuple[int, ...] = ()
) -> tuple[nbformat.NotebookNode, str]:
    """Run the notebook on a real kernel; its stream output; check it left no process behind (``others``: pids of
    this test's own services, such as a Ray node, whose workers come and go on their own)."""
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit notebooks without outputs"
    assert "widgets" not in nb.metadata, "commit notebooks without widget state"
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    files = set(glob.glob(os.path.join(tempfile.gettempdir(), "nbdist-*")))
    # timeout: a cell that runs 4 minutes hangs (every notebook runs in about 3 minutes in all)
    client = NotebookClient(nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    theirs = {c.pid for pid in others if psutil.pid_exists(pid) for c in psutil.Process(pid).children(recursive=True)}
    left = {p.pid for p in psutil.Process().children(recursive=True)} - before - theirs
    assert not [p for p in left if psutil.pid_exists(p)], "the notebook must stop its cluster"
    # nor files: what it wrote in the temporary folder (checkpoints, jobs' folders, the world's own) is removed; the
    # user's lock for idle work (engine/quiet.py), which every process of the user shares, is kept on purpose
    left_files = set(glob.glob(os.path.join(tempfile.gettempdir(), "nbdist-*"))) - files
    assert {f for f in left_files if not os.path.basename(f).startswith("nbdist-quiet-")} == set()
    return nb, stream_text(nb)


def stream_text(nb: nbformat.NotebookNode) -> str:
    """What the cells printed. A print can reach the notebook as several stream messages (the kernel flushes on a
    timer, and under load a flush can fall inside one line): a cell's chunks are joined as they came, cells by a
    newline."""
    return "\n".join(
        "".join(o.get("text", "") for o in c.outputs if o.output_type == "stream")
        for c in nb.cells
        if c.cell_type == "code"
    )


def test_multinode_notebook_on_a_two_node_slurm(slurm, tmp_path):
    _, text = _execute(MULTINODE, tmp_path)
    assert "Slurm reachable: True" in text
    assert "2 ranks ready" not in text  # the API, not the magic, started it
    assert "hosts by rank: ['node1', 'node2']" in text or "hosts by rank: ['node2', 'node1']" in text
    assert "DDP across 2 host(s) == one process" in text
    # the nodes' links run at 1 Gb/s (tests/slurmnodes.LINK), loopback within a node at several: slower across
    slower = re.search(r"across nodes [0-9.]+ GB/s \(([0-9.]+)x\)", text)
    assert slower and float(slower.group(1)) > 2, slower
    assert "cancelled Slurm job(s)" in text
    assert slurm.wait_empty(30) == []


def test_multinode_notebook_without_slurm_says_so_and_shows_the_batch_script(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", ":".join(p for p in os.environ["PATH"].split(":") if not os.path.exists(f"{p}/sbatch")))
    _, text = _execute(MULTINODE, tmp_path)
    assert "Slurm reachable: False" in text
    assert "#SBATCH --nodes=2" in text and "exec srun" in text
    assert "DDP across 1 host(s) == one process" in text


# run in JupyterLab by a learner instead (tests/browser/test_first_hour_walk.py), and checked there by check_notebook
WALKED = ("00_quickstart.ipynb", "06_monitoring.ipynb", "08_faults_and_recovery.ipynb")


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if p != MULTINODE and p.name not in WALKED], ids=lambda p: p.name)
def test_notebook_runs_top_to_bottom(path, tmp_path):
    nb, text = _execute(path, tmp_path)
    check_notebook(path.name, nb, text)


def check_notebook(name: str, nb: nbformat.NotebookNode, text: str) -> None:
    """What notebook ``name`` must have shown, read from the notebook after its run (``text``: stream_text(nb))."""
    if name.startswith("00_"):
        assert "[ranks 0,1] after all_reduce: [3.0, 3.0, 3.0]" in text, "the same line on both ranks: shown once"
        assert "[ranks 0,1] hello from every rank" in text and "[rank 1] my rank is 1" in text
        assert "[rank 0] hello from every rank" in text and "[rank 1] hello from every rank" in text  # --each
        bars = [ln for ln in text.splitlines() if "train: 100%" in ln]
        assert bars and all("40/40" in ln for ln in bars), bars
        assert text.index(bars[-1]) < text.index("[ranks 0,1] after the loop")
        assert "[rank 1] my slice of the sum: [14.0, 16.0]" in text
        errors = [o for c in nb.cells for o in c.get("outputs", []) if o.output_type == "error"]
        assert len(errors) == 1 and errors[0]["ename"] == "RankError"
        assert rank_said(text, 1, "the world works again: 2.0")
        # ranks are forks of the warm process, not of the kernel: the kernel's modules and CUDA are never theirs
        started = [ln for ln in text.splitlines() if "parent process: python -m nbdist.engine.warm" in ln]
        assert started and all(rank_said(text, r, started[0].partition("] ")[2]) for r in (0, 1)), started
        assert "the kernel's mark here: False | CUDA initialised in this rank: False" in started[0]
        assert rank_said(text, 1, "and the world works: 2.0")
    if name.startswith("08_"):
        # each lesson's claim, as the learner reads it (the notebook itself asserts nothing)
        errors = [o for c in nb.cells for o in c.get("outputs", []) if o.output_type == "error"]
        assert [e["ename"] for e in errors] == ["RankError", "RankError"], errors  # lessons 1 and 4, tagged
        assert "rank 1 raised ValueError in cell line 3: bad batch" in errors[0]["evalue"], errors[0]["evalue"]
        assert "ranks called different collectives: rank 0 called allreduce([3] float)" in errors[1]["evalue"]
        assert rank_said(text, 1, "the world works again: 2.0")
        assert text.count("died during the cell; restarted rank(s) 1") == 1
        rebuilt = re.search(r"rebuilt step (\d+) from rank 0's memory \(nothing recomputed\) in ([0-9.]+) s", text)
        assert rebuilt and 0 < int(rebuilt[1]) < 60 and float(rebuilt[2]) < 30, text  # the kill landed mid-loop
        assert "restored step" not in text
        assert "after recovery == uninterrupted, bit for bit: [True, True]" in text
        assert re.search(r"latest checkpoint: step (\d+)", text)[1] not in ("0", "1000")  # the preemption's save
        assert "grew the world from 2 to 3 ranks: started rank(s) 2" in text
        assert "gave every rank step 60 from rank 0's memory (nothing recomputed)" in text
        assert all(rank_said(text, r, "3 ranks, at step 80") for r in range(3))
        assert "asked the running cell to stop at its next step boundary" in text  # %dist_grow beside --noblock
        assert re.search(r"grew the world from 3 to 4 ranks: started rank\(s\) 3, .* gave every rank step (8\d|9\d|1[0-3]\d) ", text)
        assert all(rank_said(text, r, "4 ranks, at step 140") for r in range(4))
        assert "the 4 ranks hold the same weights: True" in text
        assert "<-- behind: rank(s) 0 entered all_reduce" in text
        assert "rank(s) 1 received SIGTERM (preemption); the save hooks ran on every rank at step" in text
        assert "rank 1 left: True" in text
    if name.startswith("06_"):
        # one communication share and one efficiency, the same wherever the notebook shows them
        title = next(
            o["data"]["application/vnd.plotly.v1+json"]["layout"]["title"]["text"]
            for o in nb.cells[3].outputs
            if "application/vnd.plotly.v1+json" in o.get("data", {})
        )
        headline = re.search(r"([0-9.]+)% of each step in communication", title)[1]
        share = re.search(r"all ranks: ([0-9.]+)% \(the mean of the ranks", text)[1]
        assert share == headline, (share, title)
        # the claims cell rounds the share itself (59.46 -> 59), the line above printed it to one decimal (59.5)
        measured = re.search(r"the dashboard measured (\d+)%", text)
        assert measured and abs(int(measured[1]) - float(share)) <= 0.55, (share, measured and measured[0])
        efficiency = re.findall(r"scaling efficiency (?:= 2 ranks / \(2 x 1 rank\) = )?([0-9]+)%", text)
        assert len(efficiency) == 3 and len(set(efficiency)) == 1, efficiency  # %dist_bench, the next cell, the claims
        figures = [
            o["data"]["application/vnd.plotly.v1+json"]["layout"]["title"]["text"]
            for c in nb.cells
            if c.cell_type == "code"
            for o in c.outputs
            if "application/vnd.plotly.v1+json" in o.get("data", {})
        ]
        assert sum("in communication" in t for t in figures) == 1, figures  # no later cell shows another share
        # the tracked section (the track extra is in the suite's environment): one run, the dashboard's numbers
        held = re.search(r"the run holds (\[.*\]), 30 steps of the world's loss", text)
        assert held and {"loss", "rank0/loss", "rank1/loss", "world/size"} <= set(ast.literal_eval(held[1])), held
        gap = re.search(r"the world's loss is the mean of the ranks' at every step \(largest gap ([0-9.e+-]+)\)", text)
        assert gap and float(gap[1]) <= 1e-6, gap
        said, shown = re.search(r"last step: the run says ([0-9.]+), the dashboard's headline ([0-9.]+)", text).groups()
        assert said == shown, (said, shown)
    if name.startswith("13_"):
        # Lightning, Accelerate and DeepSpeed: their torchrun scripts on the ranks, equal to torchrun's weights
        assert text.count("   bit for bit: True") == 3, text[-1500:]
    for line in SHOWN.get(name[:3], []):  # each lesson's measured claim, as it printed it
        tagged = re.match(r"\[rank (\d+)\] (.*)$", line)
        if tagged:  # said by that rank: its own line, or one folded across ranks that names it
            assert rank_said(text, int(tagged.group(1)), tagged.group(2)), (name, line)
        else:
            assert line in text, (name, line)
