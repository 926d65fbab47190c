"""One metric over every rank, step by step: what the dashboard draws as a band (lowest to highest)
and a median line above eight ranks, and sums for totals. Plain Python.

A rank's value holds until it logs the next one. A metric every rank logs at every step (a loss)
is counted step by step once every rank logged the step, as before; one the ranks log at steps of
their own (each rank's memory, sampled once a batch at whatever step the rank is on) is counted at
each of those steps, with every other rank's latest value, once every rank got that far. Counted
only at the steps where all ranks meet, such a metric met almost never, and the band trailed the
run by ``PENDING`` steps with one rank's value in each. A metric only some ranks log (rank 0's own, the last pipeline
stage's loss, tensor-parallel rank 0 of each group) does not wait for the others: a rank whose rows went past a step
without the metric has nothing for it there.
"""

from __future__ import annotations

import heapq

NEVER = float("-inf")


class Spread:
    """The lowest, the median, the highest value and the sum over the ranks, at each step counted (``x``).

    A step is counted once ``ranks`` ranks have logged it or a later step, each rank with its latest
    value at or before it, or once ``PENDING`` later steps wait (a rank that stopped logging, a rank
    far behind: its latest value counts). Given ``passed`` (each rank's furthest step in any of its
    rows), a rank that logs rows but not this metric counts as there once its rows go past the step.
    At most ``max_points`` steps: past that, neighbours merge pairwise (low: the lower, high: the
    higher, median and sum: the mean), so drawing the band costs the same at 2 ranks and at 64."""

    PENDING = 64  # steps that may wait for the other ranks before the first of them is counted without them

    __slots__ = ("max_points", "waiting", "order", "reached", "held", "held_at", "done", "_at", "_ready",
                 "x", "low", "mid", "high", "sum")

    def __init__(self, max_points: int = 1000) -> None:
        self.max_points = max(4, max_points)
        self.waiting: dict[float, dict[int, float]] = {}  # step -> the values logged at it, by rank
        self.order: list[float] = []  # the waiting steps, as a heap
        self.reached: dict[int, float] = {}  # the furthest step each rank logged
        self.held: dict[int, float] = {}  # each rank's latest value at the last step counted
        self.held_at: dict[int, float] = {}  # and the step it was logged at
        self.done = NEVER  # the last step counted
        self._at: float | None = None  # the first waiting step, and how many ranks reached it
        self._ready = 0
        self.x: list[float] = []
        self.low: list[float] = []
        self.mid: list[float] = []
        self.high: list[float] = []
        self.sum: list[float] = []

    def add(self, x: float, y: float, rank: int, ranks: int, passed: dict[int, float] | None = None) -> None:
        """Rank ``rank`` logged ``y`` at step ``x``; a step is counted once ``ranks`` ranks got that far (those that
        do not log this metric: once ``passed`` says their rows did)."""
        if x <= self.done:  # counted already, without this value: it holds from here on
            self._hold(rank, x, y)
        else:
            values = self.waiting.get(x)
            if values is None:
                values = self.waiting[x] = {}
                heapq.heappush(self.order, x)
            values[rank] = y
        before = self.reached.get(rank, NEVER)
        if x > before:
            self.reached[rank] = x
            if self._at is not None and before < self._at <= x:
                self._ready += 1
        self.settle(ranks, passed)

    def settle(self, ranks: int, passed: dict[int, float] | None = None) -> None:
        """Count every waiting step that is ready (see ``add``); called by ``add``, and by whoever hears a rank that
        does not log this metric go further."""
        while self.order:
            first = self.order[0]
            if first != self._at:
                self._at, self._ready = first, sum(1 for r in self.reached.values() if r >= first)
            if len(self.order) <= self.PENDING:
                # every rank got to the step: each that logs this metric, and each of the others past it in its rows
                logging = len(self.reached)
                if self._ready < logging or (logging < ranks and not self._passed(first, ranks, passed)):
                    return
            heapq.heappop(self.order)
            self._count(first)

    def _passed(self, x: float, ranks: int, passed: dict[int, float] | None) -> bool:
        """Whether the ranks that do not log this metric (``ranks`` in all) logged rows past step ``x``. ``passed``
        holds every rank that logged a row, those that log this metric too."""
        if passed is None or len(passed) < ranks:  # some rank has logged no row yet: it may log this metric too
            return False
        return all(at >= x for r, at in passed.items() if r not in self.reached)

    def renumber(self, new: dict[int, int]) -> None:
        """The world went on with other ranks (``new``: each remaining rank's old number -> new); a lost rank's
        values no longer count."""
        self.waiting = {x: {new[r]: y for r, y in v.items() if r in new} for x, v in self.waiting.items()}
        self.reached = {new[r]: x for r, x in self.reached.items() if r in new}
        self.held = {new[r]: y for r, y in self.held.items() if r in new}
        self.held_at = {new[r]: x for r, x in self.held_at.items() if r in new}
        self._at = None

    def _hold(self, rank: int, x: float, y: float) -> None:
        if x >= self.held_at.get(rank, NEVER):
            self.held[rank], self.held_at[rank] = y, x

    def _count(self, x: float) -> None:
        logged = self.waiting.pop(x)  # later than anything held: steps are counted in order
        self.held.update(logged)
        self.held_at.update(dict.fromkeys(logged, x))
        self.done = x
        if not self.held:
            return
        values = sorted(self.held.values())
        n = len(values)
        median = values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2
        self.x.append(x)
        self.low.append(values[0])
        self.mid.append(median)
        self.high.append(values[-1])
        self.sum.append(sum(values))
        if len(self.x) > self.max_points:
            self._merge()

    def _merge(self) -> None:
        pairs = range(0, len(self.x) - 1, 2)
        odd = len(self.x) % 2
        self.x = [self.x[i] for i in pairs] + (self.x[-1:] if odd else [])
        self.low = [min(self.low[i], self.low[i + 1]) for i in pairs] + (self.low[-1:] if odd else [])
        self.high = [max(self.high[i], self.high[i + 1]) for i in pairs] + (self.high[-1:] if odd else [])
        self.mid = [(self.mid[i] + self.mid[i + 1]) / 2 for i in pairs] + (self.mid[-1:] if odd else [])
        self.sum = [(self.sum[i] + self.sum[i + 1]) / 2 for i in pairs] + (self.sum[-1:] if odd else [])
