"""Warm engines (nbdist.pool): a start served by processes that imported torch earlier."""

from __future__ import annotations

import os
import time

import psutil
import pytest

import nbdist
from nbdist import pool
from nbdist.config import default_threads


@pytest.fixture(autouse=True)
def empty_pool():
    pool.shutdown()
    yield
    pool.shutdown()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_start_is_served_by_warm_processes_that_become_ordinary_engines(tmp_path, monkeypatch):
    threads = default_threads(2)
    assert pool.warm(2, threads) == 2
    assert pool.warm(2, threads) == 0, "warm() tops up to n, it does not add n more"
    warm = set(pool.pids())
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NBDIST_TEST_MARK", "set-after-warming")  # the job carries today's environment
    with nbdist.start(n=2) as cluster:
        assert {r.pid for r in cluster.ranks} == warm
        assert pool.count() == 0
        result = cluster.run(
            "import os, sys\n"
            "t = torch.ones(1)\n"
            "dist.all_reduce(t)\n"
            "seen = (t.item(), os.environ['RANK'], os.environ.get('NBDIST_TEST_MARK'), torch.get_num_threads(),"
            " os.getcwd(), sys.stdin.read())"
        )
        result.raise_for_error()
        seen = cluster.pull("seen")
        assert seen == [(2.0, str(r), "set-after-warming", threads, str(tmp_path), "") for r in range(2)]
        # A warm-started rank left waiting in a collective is released like any other (its
        # watcher thread and signal handling came with the job, not with the import).
        run = cluster.run("if dist.get_rank() == 1:\n    raise ValueError('no')\ndist.all_reduce(torch.ones(4))")
        assert run.released == "failure" and run[0].status == "interrupted" and run[1].status == "error"
        cluster.run("t = torch.ones(1); dist.all_reduce(t); v = t.item()").raise_for_error()
        assert cluster.pull("v") == [2.0, 2.0]
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in warm) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in warm), "stop ends warm-started engines like cold ones"


def test_warm_processes_for_other_settings_are_left_alone_and_shut_down():
    threads = default_threads(2)
    assert pool.warm(1, threads + 1) == 1  # imported torch with another OMP_NUM_THREADS
    other = pool.pids()
    with nbdist.start(n=2) as cluster:
        assert not {r.pid for r in cluster.ranks} & set(other), "a mismatched warm process must not serve"
        assert pool.pids() == other
    pool.shutdown()
    assert not any(_alive(p) for p in other)


def test_a_dead_warm_process_is_skipped(monkeypatch):
    threads = default_threads(2)
    pool.warm(1, threads)
    (pid,) = pool.pids()
    os.kill(pid, 9)
    psutil.Process(pid).wait(5)
    assert pool.count() == 0
    with nbdist.start(n=2) as cluster:
        assert pid not in {r.pid for r in cluster.ranks}
        cluster.run("t = torch.ones(1); dist.all_reduce(t)").raise_for_error()


def test_nbdist_warm_0_turns_warming_off(monkeypatch):
    monkeypatch.setenv("NBDIST_WARM", "0")
    assert pool.warm(2, 1) == 0
    assert pool.count() == 0
