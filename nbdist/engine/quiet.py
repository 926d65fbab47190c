"""Whether a core of this machine is free: the warm process (engine/warm.py) does its idle work only then, so that
nbdist's own background work never takes a core from ranks that compute.

Read from ``/proc/stat`` (the idle and I/O-wait time of the cores this process may use) over the last ``WINDOW_S``,
with this process's own use added back: its idle work is not a reason to stop it. Where this process's cgroup has a
CPU quota (a JupyterHub pod's CPU limit on a node of many cores), what the cgroup's processes used of it counts too
(engine/cgroupcpu.py): the host's idle cores are not the pod's to take. Where nothing frees a core for
``STALE_S`` (ranks training on every core for minutes), one step goes anyway, so that the work is done in the end.

One step at a time on a host: every warm process of the host (a Ray node's and the notebook's; Ray's test nodes share
one host) reads the same free core at the same moment, and each took it. ``free()`` says True only to the process that
holds the host's turn (an ``flock`` on ``$TMPDIR/nbdist-quiet-<uid>.lock``, taken without waiting), from then until
its ``release()`` (at once after the step: a process forked meanwhile would hold it for its whole life); the
others see the step's use in their next window.

Before this, on a 2-core laptop, the 1.5 s of a core that the idle work takes after a start ran beside the first
cell's ranks: one rank computed about half as fast for a second, and ``%dist_why`` named it (compute skew).
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from collections import deque

from nbdist.engine import cgroupcpu

FREE = 0.8  # of a core, idle on average over the window
WINDOW_S = 1.0
STALE_S = 30.0  # busy this long since the last step: one step anyway
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _idle_s(cores: set[int]) -> float | None:
    """Seconds the given cores have been idle (or waiting for I/O) since boot; None where /proc/stat is not read."""
    try:
        with open("/proc/stat") as f:
            lines = [line.split() for line in f if line.startswith("cpu") and not line.startswith("cpu ")]
    except OSError:
        return None
    ticks = sum(int(x[4]) + int(x[5]) for x in lines if int(x[0][3:]) in cores)
    return ticks / _TICK


def _own_s() -> float:
    t = os.times()
    return t.user + t.system


class Quiet:
    """``free()``: True when a core has been free over the last ``window_s`` (this process's own use not counted),
    or when ``stale_s`` passed since the last True, and this process holds the host's turn; ``release()`` once the
    step it allowed is over. Call it often (every 0.1 s): each call is a sample."""

    __slots__ = ("_cores", "_quota", "_samples", "_last", "_turn", "free_cores", "window_s", "stale_s")

    def __init__(self, window_s: float = WINDOW_S, stale_s: float = STALE_S) -> None:
        self._cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
        self._quota = cgroupcpu.quota()
        self._samples: deque[tuple[float, float, float, float]] = deque()
        self._last = time.monotonic()
        self.free_cores: float | None = None  # the last measure, for tests and logs
        self._turn: int | None = None  # the host's turn, held from a True until release()
        self.window_s = window_s
        self.stale_s = stale_s

    def free(self) -> bool:
        self.release()  # the step that the last True allowed is over
        if not self._free():
            return False
        self._turn = _take_turn()
        return self._turn is not None or _TURN_PATH is None

    def release(self) -> None:
        """Give the host's turn back (the step is over): another process's idle work may go."""
        if self._turn is not None:
            os.close(self._turn)  # closing the file lets go of its lock
            self._turn = None

    def _free(self) -> bool:
        now = time.monotonic()
        idle = _idle_s(self._cores)
        if idle is None:  # not Linux: no measure, no wait
            return True
        own, used = _own_s(), self._quota.used_s() if self._quota is not None else 0.0
        self._samples.append((now, idle, own, used))
        while len(self._samples) > 1 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()
        then, idle0, own0, used0 = self._samples[0]
        if now - then >= self.window_s:
            span = now - then
            self.free_cores = (idle - idle0 + own - own0) / span
            if self._quota is not None:  # the quota left, this process's own use given back
                self.free_cores = min(self.free_cores, self._quota.cores - (used - used0 - own + own0) / span)
            if self.free_cores >= FREE:
                self._last = now
                return True
        if now - self._last >= self.stale_s:
            self._last = now
            return True
        return False


_TURN_PATH: str | None = os.path.join(tempfile.gettempdir(), f"nbdist-quiet-{getattr(os, 'getuid', int)()}.lock")


def _take_turn() -> int | None:
    """The host's turn for a step of idle work: the file's descriptor, locked; None while another process holds it
    (or where no lock file can be made: then nobody waits for one)."""
    global _TURN_PATH
    if _TURN_PATH is None:
        return None
    try:
        fd = os.open(_TURN_PATH, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:  # another user's file of that name, a read-only /tmp: no turns here
        _TURN_PATH = None
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except OSError:  # held by another process of the host
        os.close(fd)
        return None
