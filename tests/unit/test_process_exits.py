"""The moment a process on this host ends, told by the kernel (nbdist/launch/exits.py), on real child processes:
a cell follows its ranks' processes this way and looks at once instead of at its next /proc look.

Time bounds only catch hangs.
"""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time
import types

import pytest

from nbdist.launch.exits import Exits

HANG_S = 30.0

pytestmark = pytest.mark.skipif(not Exits().works, reason="this kernel has no pidfd_open (Linux 5.3 or later)")


@pytest.fixture
def exits():
    followed = Exits()
    try:
        yield followed
    finally:
        assert followed.close(), "the thread that polled the pidfds outlived close()"


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


class Heard:
    def __init__(self) -> None:
        self.pids: list[int] = []
        self.event = threading.Event()

    def __call__(self, pid: int) -> None:
        self.pids.append(pid)
        self.event.set()


def test_a_followed_process_that_ends_is_told_and_one_still_running_is_not(exits):
    heard = Heard()
    a, b = _sleeper(), _sleeper()
    try:
        exits.follow([a.pid, b.pid], heard)
        a.kill()
        assert heard.event.wait(HANG_S), "the end of a followed process was never told"
        assert heard.pids == [a.pid]
        assert b.poll() is None
    finally:
        for p in (a, b):
            p.kill()
            p.wait()


def test_a_process_started_after_the_thread_is_followed_too(exits):
    """The polling thread is running (it follows ``a``) when ``b`` is added: it must look at the new pidfd."""
    heard = Heard()
    a, b = _sleeper(), _sleeper()
    try:
        exits.follow([a.pid], lambda pid: None)
        exits.follow([b.pid], heard)
        b.kill()
        assert heard.event.wait(HANG_S), "a process followed after the thread started was never told"
        assert heard.pids == [b.pid]
    finally:
        for p in (a, b):
            p.kill()
            p.wait()


def test_a_process_already_gone_is_told_at_once(exits):
    heard = Heard()
    p = _sleeper()
    p.kill()
    p.wait()  # reaped: no such pid any more
    exits.follow([p.pid], heard)
    assert heard.pids == [p.pid]


def test_a_listener_that_stopped_following_is_not_told(exits):
    heard, other = Heard(), Heard()
    p = _sleeper()
    try:
        stop = exits.follow([p.pid], heard)
        exits.follow([p.pid], other)
        stop()
        p.kill()
        assert other.event.wait(HANG_S)
        assert heard.pids == []
    finally:
        p.kill()
        p.wait()


def test_a_cell_reads_proc_only_for_the_ranks_the_kernel_named_between_its_slow_looks(monkeypatch):
    """cells/watch.py ``notice_deaths`` where pidfds follow the ranks: a look reads /proc only for the pids the
    kernel said ended, and for every rank only each FOLLOWED_CHECK_S (before, every rank each 0.1 s: 64 reads in about
    every trivial cell at 64 ranks). Real processes; the clock is the watch's ``deaths_at``."""
    from nbdist.cells import watch
    from nbdist.launch import exits, procs

    reads: list[int] = []

    def counted(pid: int) -> bool:
        reads.append(pid)
        return alive(pid)

    alive = procs.alive
    monkeypatch.setattr(procs, "alive", counted)
    monkeypatch.setattr(exits.EXITS, "works", True)
    living, dying = _sleeper(), _sleeper()
    try:
        w = watch.Watch.__new__(watch.Watch)
        w.pids, w.ranks = {0: living.pid, 1: dying.pid}, [0, 1]
        w.waiting, w.gone, w.ended, w.exit_seen = {0, 1}, set(), set(), set()
        w.board = types.SimpleNamespace(set=lambda ranks, state: None)
        w.wake = queue.SimpleQueue()
        dying.kill()
        dying.wait()
        w.deaths_at = time.perf_counter() - (watch.DEATH_CHECK_S + watch.FOLLOWED_CHECK_S) / 2  # between the two
        w.notice_deaths()
        assert reads == [] and w.gone == set(), reads  # nobody said, and the slow look is not due
        w.process_ended(dying.pid)  # what the kernel's pidfd says, on exits.py's thread
        w.notice_deaths()
        assert reads == [dying.pid] and w.gone == {1}, reads
        w.deaths_at -= watch.FOLLOWED_CHECK_S / 2
        w.notice_deaths()  # the slow look: every rank still running
        assert reads == [dying.pid, living.pid] and w.gone == {1}, reads
        monkeypatch.setattr(exits.EXITS, "works", False)  # no pidfds: every rank each DEATH_CHECK_S, as before
        w.deaths_at -= watch.DEATH_CHECK_S
        w.notice_deaths()
        assert reads == [dying.pid, living.pid, living.pid], reads
    finally:
        for proc in (living, dying):
            proc.kill()
            proc.wait()
