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
* ranks still running ``escalate`` seconds after a release are killed, once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import Enum

from ..results import Release

ESCALATE_S = 3.0  # after a release, seconds before ranks that did not stop are killed


class Action(Enum):
    WAIT = "wait"  # nothing to do yet
    PROBE = "probe"  # find out whether the running ranks wait in a collective; answer with probed()
    RELEASE = "release"  # interrupt the running ranks (the reason is in ``released``)
    KILL = "kill"  # end the running ranks' processes: they did not stop after the release


class ReleasePolicy:
    """Decides, each time the watch loop wakes, whether to release or kill the ranks still running."""

    def __init__(
        self,
        *,
        grace: float,
        watchdog: float | None,
        timeout: float | None,
        escalate: float = ESCALATE_S,
        clock: Callable[[], float] = time.perf_counter,
        started: float | None = None,
        death_grace: float | None = None,
    ) -> None:
        self.grace = grace
        self.death_grace = death_grace
        self.watchdog = watchdog
        self.escalate = escalate
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
        if not self.killed and self.released_at is not None and now - self.released_at > self.escalate:
            self.killed = True
            return Action.KILL
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
