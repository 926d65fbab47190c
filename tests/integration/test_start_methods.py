"""How ranks are made (``%dist_start --start fork|forkserver|spawn``, docs/faults.md rows 103-105), each on a real
2-rank gloo world: the ranks are made the way the method says (forked from the warm process, forked from a fork
server begun for the world, or each a fresh Python), a cell runs, a rank killed mid-training is replaced the same
way and the run ends bit-identical to one nobody killed, a second death with the budget spent fails the cell; the
fork server ends with the world. Then the bad input: an unknown method is one line and the running world stays.

Time bounds only catch hangs (HANG_S); benchmarks/startup.py times the three methods.
"""

from __future__ import annotations

import shutil

import psutil
import pytest
import torch
from IPython.core.error import UsageError

import nbdist
from nbdist.errors import RankError
from nbdist.launch import pool
from tests.helpers import run_cell, stand_in_driver
from tests.integration.test_recovery import TRAIN, _setup

HANG_S = 120.0


def _maker(pid: int) -> str:
    """What made this rank: the warm process, a fork server, or this process (a fresh Python per rank)."""
    parent = psutil.Process(pid).parent()
    assert parent is not None
    if parent.pid == psutil.Process().pid:
        assert psutil.Process(pid).cmdline()[1:3] == ["-m", "nbdist.engine"], psutil.Process(pid).cmdline()
        return "spawn"
    cmd = parent.cmdline()
    assert cmd[1:3] == ["-m", "nbdist.engine.warm"], cmd
    return "forkserver" if "--lean" in cmd else "fork"


@pytest.mark.parametrize("start", ["fork", "forkserver", "spawn"])
def test_each_start_method_makes_ranks_its_way_and_they_run_fail_and_recover_alike(ip, tmp_path, capsys, start):
    pool.shutdown()  # this test's own warm process (%load_ext's, for fork), none for the others
    if start == "fork":
        pool.warm(2, nbdist.config.default_threads(2))
    run_cell(ip, f"%dist_start -n 2 --max-restarts 1 --start {start}")
    try:
        cluster = nbdist.current()
        assert [_maker(r.pid) for r in cluster.ranks] == [start, start]
        servers = set(pool.pids())
        if start == "spawn":
            assert servers == set(), "spawn begins no fork server"

        run_cell(ip, _setup(str(tmp_path / "plain"), ""))
        run_cell(ip, f"%%distributed\n{TRAIN}")
        reference = cluster.pull("final")
        assert torch.equal(reference[0], reference[1])
        capsys.readouterr()

        run_cell(ip, _setup(str(tmp_path / "killed"), str(tmp_path / "mark1")))
        killed = cluster.ranks[1].pid
        run_cell(ip, f"%%distributed\n{TRAIN}")  # rank 1 kills itself at step 22; the cell still succeeds
        out = capsys.readouterr().out
        assert "restarted rank(s) 1" in out, out
        assert cluster.ranks[1].pid != killed
        assert _maker(cluster.ranks[1].pid) == start, "the replacement is made as the world's ranks were"
        recovered = cluster.pull("final")
        for rank in (0, 1):
            assert torch.equal(recovered[rank], reference[rank]), (
                start,
                (recovered[rank] - reference[rank]).abs().max(),
            )
        assert set(pool.pids()) == servers, "the same fork server made the replacement"

        run_cell(ip, _setup(str(tmp_path / "again"), str(tmp_path / "mark2")))
        with pytest.raises(RankError, match=r"rank 1 died"):
            run_cell(ip, f"%%distributed\n{TRAIN}")
        assert cluster.dead_ranks() == [1]
    finally:
        run_cell(ip, "%dist_stop")
    lean = [p for p in pool.pids() if "--lean" in psutil.Process(p).cmdline()]
    assert lean == [], "the world's fork server ends with it"
    if start == "fork":
        assert servers <= set(pool.pids()), "the warm process stays for the next start"
    pool.shutdown()


def test_an_unknown_start_method_is_one_line_and_the_running_world_stays(ip):
    run_cell(ip, "%dist_start -n 2")
    try:
        pids = [r.pid for r in nbdist.current().ranks]
        with pytest.raises(UsageError) as err:  # IPython shows a UsageError as its one line, no traceback
            run_cell(ip, "%dist_start -n 2 --start forkserve")
        text = str(err.value)
        assert "\n" not in text and text.startswith("--start 'forkserve' is not a start method"), text
        assert "did you mean 'forkserver'?" in text and "spawn: a fresh Python per rank" in text, text
        assert [r.pid for r in nbdist.current().ranks] == pids
        run_cell(ip, "%%distributed\n_t = torch.ones(1); dist.all_reduce(_t); _v = _t.item()")
        assert nbdist.current().pull("_v") == [2.0, 2.0]
    finally:
        run_cell(ip, "%dist_stop")


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to build a stand-in driver library")
@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_a_gpu_driver_loaded_on_a_rank_does_not_reach_the_ranks_a_grow_makes(ip, tmp_path, capfd, start):
    """A poison that appears after the world started: a cell loads the GPU's driver on every rank (here a library
    named as NVIDIA's, built for the test; no GPU), then %dist_grow. The new rank is made by the world's fork
    server, which never ran a cell, so nothing is refused and nothing of the ranks' is in it."""
    lib = stand_in_driver(tmp_path)
    pool.shutdown()
    run_cell(ip, f"%dist_start -n 2 --start {start} --oversubscribe")
    try:
        run_cell(ip, "%%distributed --setup\nmodel = torch.nn.Linear(2, 2)")  # what a grow replays on the new rank
        run_cell(ip, f"%%distributed\nimport ctypes\n_drv = ctypes.CDLL({lib!r}); _drv.cuInit(0)")
        from nbdist.engine.warm import accelerator_driver

        cluster = nbdist.current()
        assert all(accelerator_driver(f"/proc/{r.pid}/maps") == "libcuda.so.1" for r in cluster.ranks)
        capfd.readouterr()
        run_cell(ip, "%dist_grow 1")
        assert cluster.world_size == 3 and _maker(cluster.ranks[2].pid) == start
        assert accelerator_driver(f"/proc/{cluster.ranks[2].pid}/maps") == ""
        run_cell(ip, "%%distributed\n_t = torch.ones(1); dist.all_reduce(_t); _v = _t.item()")
        assert cluster.pull("_v") == [3.0, 3.0, 3.0]
        assert "cannot fork" not in capfd.readouterr().err
    finally:
        run_cell(ip, "%dist_stop")
        pool.shutdown()
