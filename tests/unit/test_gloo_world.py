"""forecast.comm.gloo_world, the helper the forecast and the gloo benchmarks start their worlds of processes with: it
ends them all whatever happens, fails at once when one dies, and (``partial``) gives what came when one never
answers. No process group is made here: each rank only answers, or does not."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest

from nbdist.forecast.comm import gloo_world
from nbdist.launch.procs import alive


def _answers_but_the_last(rank: int, port: int, queue, n: int) -> None:
    if rank == n - 1:
        time.sleep(60)  # never answers within the test's timeout; ended by gloo_world's own handle
    queue.put((rank, os.getpid()))


def _dies(rank: int, port: int, queue) -> None:
    if rank == 1:
        os._exit(3)
    time.sleep(60)


def test_partial_gives_what_came_and_ends_the_rank_that_never_answered():
    tic = time.monotonic()
    got = gloo_world(_answers_but_the_last, 3, (3,), timeout=2.0, answers=3, start="fork", partial=True)
    assert sorted(r for r, _ in got) == [0, 1]
    assert time.monotonic() - tic < 20  # the 60 s sleeper was ended at the timeout, not given 30 s to finish
    assert not any(alive(pid) for _, pid in got) and not multiprocessing.active_children()


def test_without_partial_a_rank_that_never_answers_fails_the_world_naming_the_timeout():
    with pytest.raises(RuntimeError, match=r"a world of 3 gloo processes failed \(exit codes \[\]\) or took more than 2 s"):
        gloo_world(_answers_but_the_last, 3, (3,), timeout=2.0, answers=3, start="fork")


def test_a_rank_that_dies_fails_the_world_at_once_with_its_exit_code():
    tic = time.monotonic()
    with pytest.raises(RuntimeError, match=r"exit codes \[3\]"):
        gloo_world(_dies, 2, (), timeout=30.0, answers=2, start="fork", partial=True)
    assert time.monotonic() - tic < 20  # at once, not at the timeout (30 s), and the sleeping rank ended, not given 30 s
