"""``%dist_track``: one run of a tracker for the world, through what happens to the world (docs/faults.md rows
106-107), on real 2-rank gloo worlds, for each of the four trackers (TensorBoard, MLflow, W&B offline, trackio
local), read back with the tracker's own reader (tests/trackers.py): the same cell run three times, a grow between
cells, a rank killed mid-training and rebuilt from a living peer, a lost rank shrinking the world and a grow
bringing it back, a kept world's kernel restarted and attached again (ranks on two Slurm nodes:
tests/multinode/test_multinode.py); each rank's steps once each and in order, the world's value the mean over the ranks that logged the step,
the world's size where it changed, the cells' sources. Then the bad input, one line each, with the world untouched.

Time bounds only catch hangs (HANG_S); benchmarks/track.py measures what tracking costs a step.
"""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch
from IPython.core.error import UsageError

import nbdist
from nbdist.launch import procs
from tests import trackers
from tests.gone_node import gone_node
from tests.helpers import poll, run_cell, wait_gone
from tests.integration.test_elastic import SETUP as ELASTIC_SETUP
from tests.integration.test_elastic import STEPS as ELASTIC_STEPS
from tests.integration.test_elastic import TRAIN as ELASTIC_TRAIN
from tests.integration.test_elastic import _progress
from tests.integration.test_keep import start_kept, waiting_out_the_lease
from tests.integration.test_recovery import TRAIN, _setup

HANG_S = 120.0
LOG = "%%distributed\nimport nbdist\nfor step in range(10):\n    nbdist.log(step=step, loss=float(dist.get_rank() * 100 + step))"


@pytest.fixture
def kept_dir(tmp_path, monkeypatch):
    path = tmp_path / "kept"
    monkeypatch.setenv("NBDIST_KEPT_DIR", str(path))
    return path


@pytest.fixture
def gone_flag(tmp_path):
    """The "gone-node" launcher (tests/gone_node.py); the flag file it yields marks the node gone."""
    with gone_node(tmp_path) as flag:
        yield flag


@pytest.fixture(autouse=True)
def _wandb_offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")  # whatever login the machine has


@pytest.mark.parametrize("kind", trackers.KINDS)
def test_one_run_through_cells_run_again_and_a_grow_each_step_once(kind, ip, tmp_path, capsys):
    run_cell(ip, "%dist_start -n 2 --oversubscribe")
    try:
        run_cell(ip, f"%dist_track {kind} cells {trackers.flags(kind, tmp_path)}")
        said = capsys.readouterr().out
        assert f"tracking this world in the {kind} run at " in said and "(from the next cell on)" in said, said
        run_cell(ip, "%%distributed --setup\nimport nbdist\nmodel = torch.nn.Linear(2, 2)")
        for _ in range(3):
            run_cell(ip, LOG)
        run_cell(ip, "%dist_grow 1")
        run_cell(ip, LOG)
    finally:
        run_cell(ip, "%dist_stop")  # ends the run: what is queued is written first
    got = trackers.read(kind, tmp_path, "cells")
    for rank in (0, 1):
        assert got[f"rank{rank}/loss"] == [(s, float(rank * 100 + s % 10)) for s in range(40)], rank
    assert got["rank2/loss"] == [(s, float(200 + s % 10)) for s in range(30, 40)]
    assert got["loss"] == [(s, 50.0 + s % 10) for s in range(30)] + [(s, 100.0 + s % 10) for s in range(30, 40)]
    assert got["world/size"] == [(0, 2.0), (30, 3.0)]
    assert got["cells"] == [0, 0, 10, 20, 30], "each cell's source where its steps begin"
    assert got["runs"] == 1, "one run"
    assert got["params"]["n"] in (2, "2"), got["params"]


@pytest.mark.parametrize("kind", trackers.KINDS)
def test_a_rank_killed_mid_training_and_rebuilt_from_a_peer_goes_on_in_the_same_run(kind, ip, tmp_path):
    train = TRAIN.replace("opt.step()\n", "opt.step()\n    nbdist.log(step=step, loss=loss.item())\n", 1)
    assert train != TRAIN
    run_cell(ip, "%dist_start -n 2 --max-restarts 1")
    try:
        run_cell(ip, f"%dist_track {kind} recovered {trackers.flags(kind, tmp_path / 'runs')}")
        run_cell(ip, _setup(str(tmp_path / "ckpt"), str(tmp_path / "mark")))
        run_cell(ip, f"%%distributed\n{train}")  # rank 1 kills itself at step 22; the cell goes on
        assert (tmp_path / "mark").exists()
        final = nbdist.current().pull("final")
        run_cell(ip, "%dist_track off")
    finally:
        run_cell(ip, "%dist_stop")
    got = trackers.read(kind, tmp_path / "runs", "recovered")
    assert got["runs"] == 1
    assert [s for s, _ in got["rank0/loss"]] == list(range(40)), "the living rank: every step once"
    # the killed rank's rows of its last moments (the batch it had not sent yet) died with it; its replacement
    # goes on from the step it was rebuilt at: in order, none twice, every step from there
    killed = [s for s, _ in got["rank1/loss"]]
    assert killed == sorted(set(killed)) and set(range(23, 40)) <= set(killed), killed
    assert [s for s, _ in got["loss"]] == list(range(40))
    ranks = [dict(got["rank0/loss"]), dict(got["rank1/loss"])]
    for step, world in got["loss"]:  # the mean over the ranks that logged the step
        values = [r[step] for r in ranks if step in r]
        assert world == pytest.approx(sum(values) / len(values), rel=1e-6), step
    assert torch.equal(final[0], final[1])


@pytest.mark.parametrize("kind", trackers.KINDS)
def test_a_lost_rank_shrinks_the_world_and_a_grow_brings_it_back_in_the_same_run(kind, tmp_path, gone_flag):
    """3 ranks train; rank 2 is killed mid-loop and its node is gone (no replacement starts): the world goes on with
    2 ranks from the step it was rebuilt at. The node back, %dist_grow 1 and 10 more steps on 3 ranks. One run: each
    rank's steps once each and in order, the joined rank 2's from the grow, the world's size where it changed."""
    progress = str(tmp_path / "progress")
    train = ELASTIC_TRAIN.replace(" opt.step()\n", " opt.step()\n    nbdist.log(step=step, loss=loss.item())\n")
    assert train != ELASTIC_TRAIN
    more = train.replace(f"loader.steps({ELASTIC_STEPS})", f"loader.steps({ELASTIC_STEPS + 10})")  # 10 steps on
    assert more != train
    with nbdist.start(3, launcher="gone-node", max_restarts=1, min_ranks=2, oversubscribe=True, timeout=90) as c:
        nbdist.track(kind, "elastic", **trackers.place(kind, tmp_path / "runs"))
        c.run(f"PROGRESS = {progress!r}\nimport nbdist\n{ELASTIC_SETUP}", setup=True).raise_for_error()
        gone_flag.write_text("")  # no engine starts: rank 2's replacement never comes
        pid = c.engines.ranks[2].pid
        killer = threading.Thread(
            target=lambda: poll(lambda: _progress(progress, 2) >= 5, HANG_S, every=0.005) and os.kill(pid, 9),
            daemon=True,
        )
        killer.start()
        result = c.run(train).raise_for_error()
        killer.join(HANG_S)
        assert "continuing with 2 of 3 ranks" in result.recovered[0], result.recovered
        gone_flag.unlink()  # the node is back
        c.grow(1)
        c.run(more).raise_for_error()
        nbdist.untrack()
    got = trackers.read(kind, tmp_path / "runs", "elastic")
    assert got["runs"] == 1, "one run"
    (_, three), (lost_at, two), (grown_at, again) = got["world/size"]
    assert (three, two, again) == (3.0, 2.0, 3.0) and 5 <= lost_at < grown_at == ELASTIC_STEPS, got["world/size"]
    for rank in (0, 1):
        assert [s for s, _ in got[f"rank{rank}/loss"]] == list(range(ELASTIC_STEPS + 10)), rank
    rank2 = [s for s, _ in got["rank2/loss"]]  # the lost rank's rows to its death, then the joined rank's
    assert rank2 == sorted(set(rank2)) and rank2[-10:] == list(range(grown_at, grown_at + 10)), rank2
    assert all(s < lost_at or s >= grown_at for s in rank2), (lost_at, rank2)
    assert [s for s, _ in got["loss"]] == list(range(ELASTIC_STEPS + 10))
    assert got["cells"] == [0, 0, ELASTIC_STEPS], "the setup cell, the loop, the loop going on"


def test_bad_input_is_one_line_and_the_world_and_its_run_stay(ip, tmp_path, capsys):
    with pytest.raises(UsageError, match="%dist_start"):  # no world yet
        run_cell(ip, f"%dist_track tensorboard early --dir {tmp_path}")
    run_cell(ip, "%dist_start -n 2")
    try:
        cases = {
            f"%dist_track tensorbord x --dir {tmp_path}": "did you mean 'tensorboard'?",
            f"%dist_track tensorboard x --uri sqlite:///{tmp_path}/m.db": "--uri is MLflow's tracking URI",
        }
        for line, expected in cases.items():
            with pytest.raises(UsageError) as err:
                run_cell(ip, line)
            assert expected in str(err.value) and "\n" not in str(err.value), str(err.value)
        run_cell(ip, f"%dist_track tensorboard first --dir {tmp_path}")
        with pytest.raises(UsageError, match="this world is tracked already .* %dist_track off ends that run first"):
            run_cell(ip, f"%dist_track tensorboard second --dir {tmp_path}")
        run_cell(ip, LOG)
        capsys.readouterr()
        run_cell(ip, LOG.replace("loss=float(", "acc='high', loss=float("))  # a metric that is not a number
        said = "".join(capsys.readouterr())
        assert said.count("nbdist.log: acc='high' is not a number; it is left out of the row") == 1, said
        run_cell(ip, "%dist_track off")
        with pytest.raises(UsageError, match="the run name 'first' is taken in"):
            run_cell(ip, f"%dist_track tensorboard first --dir {tmp_path}")
        run_cell(ip, "%%distributed\n_t = torch.ones(1); dist.all_reduce(_t); _v = _t.item()")
        assert nbdist.current().pull("_v") == [2.0, 2.0]
    finally:
        run_cell(ip, "%dist_stop")
    got = trackers.read("tensorboard", tmp_path, "first")
    assert [s for s, _ in got["loss"]] == list(range(20)) and "acc" not in got  # the training and its run went on


@pytest.mark.parametrize("kind", trackers.KINDS)
def test_a_kept_worlds_run_goes_on_after_the_kernel_restarts_and_attaches(kind, kept_dir, tmp_path, monkeypatch):
    """JupyterLab's "Restart kernel" under a kept world: the old kernel's tracker ends its run as the process exits;
    %dist_attach in the new kernel opens the same run again, and the next cell's steps go on after the last."""
    # W&B's service of this test process (the earlier tests') would be the kernels' too, as no Jupyter server's is
    monkeypatch.delenv("WANDB_SERVICE", raising=False)
    kernel, pids = start_kept(kept_dir, "60")
    try:
        for cell in (f"%dist_track {kind} kept {trackers.flags(kind, tmp_path)}", LOG):
            content, text, _ = kernel.run(cell)
            assert content["status"] == "ok", text
        (record,) = kept_dir.glob("*.json")
        workdir = json.loads(record.read_text())["workdir"]
        kernel.km.restart_kernel(now=False)
        waiting_out_the_lease(workdir, pids)
        content, text, _ = kernel.run("%load_ext nbdist\n%dist_attach")
        assert content["status"] == "ok", text
        assert f"tracking this world in the {kind} run at " in text and " again (from step 10)" in text, text
        for cell in (LOG, "%dist_stop"):
            content, text, _ = kernel.run(cell)
            assert content["status"] == "ok", text
        assert wait_gone(pids, 30) == []
    finally:
        kernel.close()
        procs.kill([p for p in pids if procs.alive(p)])
    got = trackers.read(kind, tmp_path, "kept")
    assert got["runs"] == 1, "one run, opened twice"
    for rank in (0, 1):
        assert got[f"rank{rank}/loss"] == [(s, float(rank * 100 + s % 10)) for s in range(20)], rank
    assert got["loss"] == [(s, 50.0 + s % 10) for s in range(20)]
    assert got["cells"] == [0, 10]
