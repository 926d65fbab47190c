"""The moment a process on this host ends, told by the kernel (nbdist/launch/exits.py), on real child processes:
a cell follows its ranks' processes this way and looks at once instead of at its next /proc look.

Time bounds only catch hangs.
"""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from nbdist.launch.exits import Exits

HANG_S = 30.0

pytestmark = pytest.mark.skipif(not Exits().works, reason="this kernel has no pidfd_open (Linux 5.3 or later)")


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


class Heard:
    def __init__(self) -> None:
        self.pids: list[int] = []
        self.event = threading.Event()

    def __call__(self, pid: int) -> None:
        self.pids.append(pid)
        self.event.set()


def test_a_followed_process_that_ends_is_told_and_one_still_running_is_not():
    exits, heard = Exits(), Heard()
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


def test_a_process_started_after_the_thread_is_followed_too():
    """The polling thread is running (it follows ``a``) when ``b`` is added: it must look at the new pidfd."""
    exits, heard = Exits(), Heard()
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


def test_a_process_already_gone_is_told_at_once():
    exits, heard = Exits(), Heard()
    p = _sleeper()
    p.kill()
    p.wait()  # reaped: no such pid any more
    exits.follow([p.pid], heard)
    assert heard.pids == [p.pid]


def test_a_listener_that_stopped_following_is_not_told():
    exits, heard, other = Exits(), Heard(), Heard()
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
