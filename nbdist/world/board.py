"""Each rank's state, in one place: what it is doing now (``RankState``), which cell and line, since when.

The ``Board`` is the one source of it. Those who see a change write it (the cell's watch: busy, in the
debugger, how the rank ended its part; the engine set: restarting, dead; the cluster: idle again after a
restart); those who show it read it (``Cluster.states()``, ``%dist_status``, ``%dist_where``, the
dashboard's rank line) or subscribe to it: a listener is called with each change, as it happens, on the
thread that saw it (the client's IO thread for a rank's reply). A listener that raises is dropped, with
a line in nbdist's log: what shows a state must not stop the cell that changes it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..results import RankState

log = logging.getLogger("nbdist")


@dataclass(frozen=True, slots=True)
class RankNow:
    """One rank's state: what it does, in which cell (its first line) and at which line of it, since when."""

    rank: int
    state: RankState
    cell: str = ""  # the cell it runs (busy, in the debugger) or ran last
    line: int | None = None  # its line in that cell, when a report said so (%dist_where, a release, a prompt)
    since: float = 0.0  # time.time() of the change

    @property
    def in_cell(self) -> bool:
        """Running a cell: busy, or stopped in its debugger in it."""
        return self.state in _IN_CELL


_IN_CELL = (RankState.BUSY, RankState.DEBUGGING)

Listener = Callable[[RankNow], None]


class Board:
    """Each rank's ``RankNow``; ``set`` changes one and tells the listeners, ``subscribe`` adds one."""

    def __init__(self) -> None:
        self._now: dict[int, RankNow] = {}
        self._listeners: list[Listener] = []
        self._lock = threading.Lock()

    def reset(self, ranks: list[int], state: RankState = RankState.IDLE) -> None:
        """A new world of these ranks, all in ``state`` (ranks not named are gone from it)."""
        with self._lock:
            for rank in set(self._now) - set(ranks):
                del self._now[rank]
        self.set(ranks, state)

    def set(self, ranks: list[int], state: RankState, cell: str | None = None, line: int | None = None) -> None:
        """These ranks are now in ``state`` (in ``cell``, at ``line``; ``cell`` None: the one it had).
        A rank already there (same cell, same line) is no change and no event."""
        changed = []
        with self._lock:
            for rank in ranks:
                old = self._now.get(rank)
                now = RankNow(rank, state, (old.cell if old else "") if cell is None else cell, line, time.time())
                if old is not None and (old.state, old.cell) == (now.state, now.cell):
                    if line is None or line == old.line:
                        continue  # no change (a line once known stays until a report moves it)
                    now = RankNow(rank, state, now.cell, line, old.since)
                self._now[rank] = now
                changed.append(now)
            listeners = list(self._listeners)
        for now in changed:
            for fn in listeners:
                self._tell(fn, now)

    def reported(self, reports: dict[int, tuple[bool, int | None]]) -> None:
        """Where ranks in a cell are, from their own reports: rank -> (in its debugger, cell line). A rank
        the board has out of its cell (its reply came first) is left as it is."""
        for rank, (debugging, line) in reports.items():
            with self._lock:
                now = self._now.get(rank)
            if now is not None and now.in_cell:
                self.set([rank], RankState.DEBUGGING if debugging else RankState.BUSY, line=line)

    def get(self) -> dict[int, RankNow]:
        """Each rank's state now, by rank."""
        with self._lock:
            return dict(sorted(self._now.items()))

    def of(self, ranks: list[int]) -> dict[int, RankNow]:
        """These ranks' states now, by rank (those the board has)."""
        with self._lock:
            return {rank: self._now[rank] for rank in ranks if rank in self._now}

    def subscribe(self, fn: Listener) -> Callable[[], None]:
        """Call ``fn`` with every change from now on; returns what unsubscribes it."""
        with self._lock:
            self._listeners.append(fn)

        def unsubscribe() -> None:
            with self._lock:
                if fn in self._listeners:
                    self._listeners.remove(fn)

        return unsubscribe

    def _tell(self, fn: Listener, now: RankNow) -> None:
        try:
            fn(now)
        except Exception:
            log.warning("nbdist: a rank-state listener raised; it is dropped", exc_info=True)
            with self._lock:
                if fn in self._listeners:
                    self._listeners.remove(fn)
