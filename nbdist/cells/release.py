"""When to release ranks still running a cell, and when to end those that will not stop.

A pure object: it reads a clock (injected, so tests run in milliseconds) and what the
watch loop tells it, and answers with an ``Action``. It never touches a process.

The rules (docs/faults.md, rows 2, 3 and 10):

* a rank failed while others still run: they get ``grace`` seconds to finish, then
  they are released (``Release.FAILURE``); a rank that died (its process is gone) gives them
  ``death_grace`` seconds where one is set (0 when automatic recovery will run the cell again:
  what they would finish is thrown away, and with more than 2 ranks gloo tells only the dead
  rank's neighbours, so the others would wait the whole grace);
* the cell ran past its ``timeout``: every running rank is released (``TIMEOUT``);
* some ranks finished and others have run on for ``watchdog`` seconds: the loop is
  asked to ``PROBE`` where they are; waiting in a collective means a hang
  (``WATCHDOG``), anything else is legitimate work, looked at again a watchdog later;
* a rank's code exited (``exit()``, engine/exits.py) while others still run: after ``grace`` seconds
  the loop is asked to ``PROBE``; those waiting in a collective wait for the rank that left
  (``EXITED``), anything else is legitimate work, looked at again a grace later;
* Ctrl-C releases at once (``INTERRUPT``);
* while a rank is in its debugger (``paused``: a person at a pdb prompt, cells/pdbrelay.py) nothing
  is released, and the time spent there does not count toward the grace, timeout or watchdog;
* a release ``first_look`` seconds old is looked at (``CHECK``), and again every ``escalate`` seconds: the ranks
  still running that are stuck (``stuck``: waiting where their watcher's break should have woken them, their main
  thread idle since; still in a collective at a later look; at the very same place with no CPU used between two
  looks; silent to two looks in a row) are killed, and those that answer from elsewhere (unwinding, formatting
  their traceback on a loaded machine, sending their reply) are left to finish; ``last_resort`` seconds after the
  release, whatever still runs is killed, once. A rank that is only slow to answer is never ended for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import Enum

from ..results import Release

FIRST_LOOK_S = 1.0  # after a release, seconds before the first look at the ranks that did not stop
ESCALATE_S = 3.0  # then, seconds between looks (the stuck are killed)
LAST_RESORT_S = 30.0  # after a release, seconds before every rank still running is killed, stuck or not


class Action(Enum):
    WAIT = "wait"  # nothing to do yet
    PROBE = "probe"  # find out whether the running ranks wait in a collective; answer with probed()
    RELEASE = "release"  # interrupt the running ranks (the reason is in ``released``)
    CHECK = "check"  # after a release: end the running ranks that are stuck (``stuck``), leave the others be
    KILL = "kill"  # end the running ranks' processes: they did not stop long after the release


class ReleasePolicy:
    """Decides, each time the watch loop wakes, whether to release or kill the ranks still running."""

    def __init__(
        self,
        *,
        grace: float,
        watchdog: float | None,
        timeout: float | None,
        escalate: float = ESCALATE_S,
        first_look: float = FIRST_LOOK_S,
        last_resort: float = LAST_RESORT_S,
        clock: Callable[[], float] = time.perf_counter,
        started: float | None = None,
        death_grace: float | None = None,
    ) -> None:
        self.grace = grace
        self.death_grace = death_grace
        self.watchdog = watchdog
        self.escalate = escalate
        self.first_look = first_look
        self.last_resort = last_resort
        self.checked_at: float | None = None  # the last look at the ranks that did not stop after the release
        self.clock = clock
        self.started = clock() if started is None else started
        self.deadline = self.started + timeout if timeout else None
        self.first_failure: float | None = None  # when a rank was first seen failed
        self.first_finish: float | None = None  # when a rank was first seen done (reset by a harmless probe)
        self.first_exit: float | None = None  # when a rank's code was first seen to have exited (reset likewise)
        self.first_death: float | None = None  # when a rank's process was first seen gone
        self.probing: Release = Release.WATCHDOG  # what a collective found by the pending PROBE means
        self.released: Release | None = None
        self.released_at: float | None = None
        self.killed = False
        self.paused_since: float | None = None  # a rank went into its debugger then

    def hold(self) -> None:
        """A rank is in its debugger from now on (until ``observe`` is told otherwise): the timers stop."""
        if self.released is None and self.paused_since is None:
            self.paused_since = self.clock()

    def _resume(self, now: float) -> None:
        """Out of the debugger: every timer moves on by the time spent in it."""
        if self.paused_since is None:
            return
        spent, self.paused_since = now - self.paused_since, None
        self.started += spent
        self.deadline = None if self.deadline is None else self.deadline + spent
        self.first_failure = None if self.first_failure is None else self.first_failure + spent
        self.first_finish = None if self.first_finish is None else self.first_finish + spent
        self.first_exit = None if self.first_exit is None else self.first_exit + spent
        self.first_death = None if self.first_death is None else self.first_death + spent

    def observe(
        self, *, failed: bool, finished: bool, paused: bool = False, exited: bool = False, died: bool = False
    ) -> Action:
        """What to do now, given whether any rank has failed, whether any has finished, whether a
        rank is in its debugger (``paused``), whether a rank's code exited (``exited``), and whether a
        rank's process is gone (``died``)."""
        now = self.clock()
        if paused and self.released is None:
            self.hold()
            return Action.WAIT
        self._resume(now)
        if failed and self.first_failure is None:
            self.first_failure = now
        if finished and self.first_finish is None:
            self.first_finish = now
        if exited and self.first_exit is None:
            self.first_exit = now
        if died and self.first_death is None:
            self.first_death = now
        if self.released is None:
            if (
                self.death_grace is not None
                and self.first_death is not None
                and now - self.first_death >= self.death_grace
            ):
                return self._release(Release.FAILURE, now)
            if self.first_failure is not None and now - self.first_failure > self.grace:
                return self._release(Release.FAILURE, now)
            if self.deadline is not None and now > self.deadline:
                return self._release(Release.TIMEOUT, now)
            if self.first_exit is not None and now - self.first_exit > self.grace:
                self.probing = Release.EXITED
                return Action.PROBE
            if self.watchdog and self.first_finish is not None and now - self.first_finish > self.watchdog:
                self.probing = Release.WATCHDOG
                return Action.PROBE
            return Action.WAIT
        if self.killed or self.released_at is None:
            return Action.WAIT
        if now - self.released_at > self.last_resort:
            self.killed = True
            return Action.KILL
        between = self.first_look if self.checked_at is None else self.escalate
        if now - (self.checked_at or self.released_at) > between:
            self.checked_at = now
            return Action.CHECK
        return Action.WAIT

    def probed(self, in_collective: bool) -> Action:
        """The answer to PROBE: do the running ranks wait inside a collective?"""
        if in_collective:
            return self._release(self.probing, self.clock())
        if self.probing is Release.EXITED:
            self.first_exit = self.clock()  # legitimate work on the other ranks; look again a grace later
        else:
            self.first_finish = self.clock()
        return Action.WAIT

    def interrupt(self) -> Action:
        """Ctrl-C: release now, unless the ranks were released already."""
        if self.released is not None:
            return Action.WAIT
        return self._release(Release.INTERRUPT, self.clock())

    def _release(self, why: Release, now: float) -> Action:
        self.released, self.released_at = why, now
        return Action.RELEASE


def stuck(running: list[int], now: dict[int, dict], before: dict[int, dict | None]) -> list[int]:
    """Of the ranks still running after a release, those to end (``CHECK``), from this look's reports (``now``:
    rank -> its report, a silent rank missing) and the last look's (``before``: rank -> report, None when it was
    silent; empty at the first look). Stuck, at any look: waiting in a collective, or in backward (DDP's all-reduce),
    with its main thread idle since its watcher shut the group's connections (``_idle_since_break``). At a later
    look: still in a collective whatever its CPU, idle at the very same place as at the last look (its main thread
    used no CPU in between), or silent at both looks. A rank whose cell is over, that reports from somewhere new, or
    that works (unwinding, formatting its traceback on a loaded machine, sending its reply) is stopping: it is left
    to finish."""
    out = []
    for r in running:
        mine = now.get(r)
        if mine is None:
            if r in before and before[r] is None:
                out.append(r)
            continue
        if not mine.get("busy", True):
            continue
        last = before.get(r)
        waiting = bool(mine.get("in_collective")) or _in_backward(mine)
        if waiting and _idle_since_break(mine):
            out.append(r)
        elif r in before and (mine.get("in_collective") or (last is not None and _same_and_idle(last, mine))):
            out.append(r)
    return out


def _in_backward(report: dict) -> bool:
    """Its innermost Python frame is autograd's call into C++: the backward computes, or waits there for DDP's
    all-reduce (no torch.distributed frame, so not ``in_collective``). That wait can be on a send gloo never tells
    of: when a peer's watcher shut their connection while this rank was still sending, gloo queues the failed write
    and tells every other waiting operation of the broken pair, not that one, which waits for the group's timeout
    (30 minutes by default). Seen at 64 ranks on 2 cores in a quarter to a third of the recoveries
    (benchmarks/recovery_scale.py). A Python frame of its own backward (a custom Function) is its own code."""
    stack = report.get("stack") or [""]
    return "torch/autograd/" in stack[-1].replace("\\", "/")


def _idle_since_break(report: dict) -> bool:
    """Its main thread used no CPU since its watcher shut the group's connections, which wakes any wait on them with
    an error: one woken unwinds, and uses its core. The first look comes ``FIRST_LOOK_S`` after the release, the
    break ``abort_after`` (0.3 s) after it: a wait seen idle since, 0.7 s on, was not woken."""
    at_break = report.get("broke_cpu_s")
    return at_break is not None and not _worked({"cpu_s": at_break}, report)


def _same_and_idle(last: dict, mine: dict) -> bool:
    return _place(last) == _place(mine) and not _worked(last, mine)


WORKING_CPU_S = 0.02  # CPU a rank's main thread uses between two looks when it works (a waiting one: none)


def _place(report: dict) -> tuple:
    """Where a report says its rank is, to the line: its stack's end and its cell line."""
    return tuple(report.get("stack") or ()), report.get("cell_line"), report.get("function")


def _worked(last: dict, mine: dict) -> bool:
    """Did the rank's main thread use CPU between the two reports (unknown: no)?"""
    a, b = last.get("cpu_s"), mine.get("cpu_s")
    return a is not None and b is not None and b - a >= WORKING_CPU_S
