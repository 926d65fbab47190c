"""Every call to the ranks is bounded (world/engineset.py, ``EngineSet.call``): with the controller stopped by
SIGSTOP, a repair of the world fails within its bound, naming the ranks that did not answer, instead of hanging
for good; once the controller runs again, %dist_restart brings the world back. A real 2-rank gloo cluster;
time is bounded only to catch a hang."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

import nbdist
from nbdist.errors import ClusterError
from tests.helpers import run_cell

BOUND_S = 6.0  # the start timeout, which bounds each call to the ranks
HANG_S = 60.0


def _controller(cluster) -> int:
    ranks = {r.pid for r in cluster.ranks}
    for pid in cluster.pids():
        if pid not in ranks and "nbdist.engine.controller" in " ".join(psutil.Process(pid).cmdline()):
            return pid
    raise AssertionError("no controller among the cluster's processes")


def test_a_repair_with_the_controller_stopped_fails_within_its_bound_and_restart_works_after(ip):
    cluster = nbdist.start(n=2, timeout=BOUND_S)
    try:
        run_cell(ip, "%%distributed\nx = torch.ones(1)\ndist.all_reduce(x)")
        controller = _controller(cluster)
        os.kill(controller, signal.SIGSTOP)
        try:
            tic = time.monotonic()
            with pytest.raises(ClusterError) as err:
                cluster.rebuild_world()  # what the repair does after a release: every rank leaves, then rejoins
            took = time.monotonic() - tic
        finally:
            os.kill(controller, signal.SIGCONT)
        assert took < HANG_S
        text = str(err.value)
        assert "leaving the process group: rank(s) 0, 1 did not answer within 6 s" in text, text
        assert "run %dist_restart once they answer again" in text
        with pytest.raises(ClusterError, match=r"fetching 'x': rank\(s\) 0 did not answer within"):
            os.kill(controller, signal.SIGSTOP)
            try:
                cluster.pull("x", ranks=0)
            finally:
                os.kill(controller, signal.SIGCONT)
        run_cell(ip, "%dist_restart")
        run_cell(ip, "%%distributed\ny = torch.ones(1)\ndist.all_reduce(y)")
        assert cluster.pull("y.item()") == [2.0, 2.0]
    finally:
        cluster.stop()
