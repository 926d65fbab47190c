"""What the ranks logged, kept small enough to redraw live: per-rank series and the numbers that
answer "how is it going". Plain Python (no plotly, no torch): the dashboard draws it, the
tests check it.

``Series`` keeps a bounded number of points over a run of any length by min/max decimation:
past ``max_points`` it keeps, for each bucket of consecutive steps, the lowest and the highest
value (in step order), so a loss spike or a slow step at 90k stays visible at 100k steps.
``MetricStore`` holds a Series per (metric, rank), the last few raw values of each, and
``headline()``: the current step, loss, samples/s in total, communication share, the slowest
rank and by how much.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable
from statistics import fmean
from typing import Any

from .spread import Spread

# %dist_why's judge (stragglers.slow), handed in by whoever makes the store: rows by rank, world size -> a verdict
Judge = Callable[[dict[int, list[dict[str, float]]], int], Any]

SKIP = {"t", "step"}
TIMED = "why/"  # %dist_why's step timings (engine/why.py): the verdict reads them; they are not plotted
RECENT = 20  # steps the headline and the step split average over


# what %%dist_fit forecast, by world size: {"label": "fsdp", "step_s": 0.137, "peak_MiB": 37.0}
Expect = dict[int, dict[str, Any]]
OVER_FORECAST = 1.15  # a step this much slower than its forecast is said in the headline

class Series:
    """(x, y) points, at most ``max_points`` of them however many were added.

    Points go into buckets of ``stride`` consecutive adds; a bucket shows as its minimum and
    its maximum (one point when they coincide), and the first and latest points are drawn too. When there are more than ``max_points // 2``
    buckets, neighbours merge pairwise and the stride doubles: memory and drawing stay
    bounded and every extreme of the run survives.
    """

    __slots__ = ("max_points", "stride", "buckets", "_open", "_filled", "recent", "first", "latest")

    def __init__(self, max_points: int = 1000) -> None:
        self.max_points = max(4, max_points)
        self.stride = 1
        self.buckets: list[tuple[float, float, float, float]] = []  # (x_lo, lo, x_hi, hi), closed buckets
        self._open: list[float] | None = None  # the bucket being filled: [x_lo, lo, x_hi, hi]
        self._filled = 0  # points in the open bucket
        self.recent: deque[float] = deque(maxlen=RECENT)
        self.first: tuple[float, float] | None = None  # drawn too, so the line spans the whole run
        self.latest: tuple[float, float] | None = None

    def add(self, x: float, y: float) -> None:
        self.recent.append(y)
        if self.first is None:
            self.first = (x, y)
        self.latest = (x, y)
        b = self._open
        if b is None:
            self._open = [x, y, x, y]
        else:
            if y < b[1]:
                b[0], b[1] = x, y
            if y > b[3]:
                b[2], b[3] = x, y
        self._filled += 1
        if self._filled >= self.stride:
            self.buckets.append(tuple(self._open))  # type: ignore[arg-type]
            self._open, self._filled = None, 0
            if len(self.buckets) > self.max_points // 2:
                self._merge()

    def _merge(self) -> None:
        merged = []
        for i in range(0, len(self.buckets) - 1, 2):
            (xa, la, xA, ha), (xb, lb, xB, hb) = self.buckets[i], self.buckets[i + 1]
            lo = (xa, la) if la <= lb else (xb, lb)
            hi = (xA, ha) if ha >= hb else (xB, hb)
            merged.append((lo[0], lo[1], hi[0], hi[1]))
        if len(self.buckets) % 2:
            merged.append(self.buckets[-1])
        self.buckets = merged
        self.stride *= 2

    def points(self) -> tuple[list[float], list[float]]:
        """The points to draw, in x order."""
        xs: list[float] = []
        ys: list[float] = []
        for x_lo, lo, x_hi, hi in self._all():
            if x_lo == x_hi:
                xs.append(x_lo)
                ys.append(lo)
            elif x_lo < x_hi:
                xs += (x_lo, x_hi)
                ys += (lo, hi)
            else:
                xs += (x_hi, x_lo)
                ys += (hi, lo)
        if self.first is not None and self.latest is not None and xs:
            if self.first[0] < xs[0]:
                xs.insert(0, self.first[0])
                ys.insert(0, self.first[1])
            if self.latest[0] > xs[-1]:
                xs.append(self.latest[0])
                ys.append(self.latest[1])
        return xs, ys

    def _all(self) -> Iterable[tuple[float, float, float, float]]:
        yield from self.buckets
        if self._open is not None:
            yield tuple(self._open)  # type: ignore[misc]


class MetricStore:
    """Every metric logged by every rank, as series keyed by (metric, rank), and each metric's spread
    over the ranks (``spreads``)."""

    def __init__(
        self, max_points: int = 1000, ranks: int = 0, judge: Judge | None = None, expect: Expect | None = None
    ) -> None:
        self.max_points = max_points
        self.judge = judge
        self.expect = dict(expect or {})  # world size -> what %%dist_fit forecast for it (its label, step_s, peak_MiB)
        self.world = ranks  # how many ranks log (when known): a step's spread waits for all of them
        self.series: dict[tuple[str, int], Series] = {}
        self.last: dict[tuple[str, int], float] = {}
        self.counts: dict[int, int] = {}
        self.timed: dict[int, int] = {}  # %dist_why's rows per rank (TIMED keys only, numbered apart)
        # and the last RECENT of them as they came, for the judge (not every row has every key: engine/why.py reads
        # DDP's split of backward on some steps only, so they cannot be rebuilt from the series)
        self.timed_rows: dict[int, deque[dict[str, float]]] = {}
        self.steps: dict[int, float] = {}  # the last step each rank logged
        self.spreads: dict[str, Spread] = {}
        self.loggers: dict[str, set[int]] = {}  # the ranks that log each metric
        self.resizes: list[tuple[float | None, int]] = []  # (step, ranks from then on): the world went on with other
        self.lost: dict[str, list[Series]] = {}  # the series of ranks the world went on without, by metric

    def add(self, rank: int, rows: Iterable[dict[str, Any]]) -> None:
        for row in rows:
            timed = row.get("step") is None and TIMED + "step_s" in row
            if timed:
                # %dist_why's rows (no step of their own; a batch's last row also carries the memory): numbered
                # apart, so the cell's steps stay the x axis and the headline's step
                x = float(self.timed.get(rank, 0))
                self.timed[rank] = int(x) + 1
                kept = self.timed_rows.setdefault(rank, deque(maxlen=RECENT))
                kept.append({k: float(v) for k, v in row.items() if k.startswith(TIMED)})
            else:
                n = self.counts.get(rank, 0)
                self.counts[rank] = n + 1
                x = float(row["step"]) if row.get("step") is not None else float(n)
                self.steps[rank] = max(x, self.steps.get(rank, x))
            for key, value in row.items():
                if key in SKIP:
                    continue
                s = self.series.get((key, rank))
                if s is None:
                    s = self.series[(key, rank)] = Series(self.max_points)
                s.add(x, float(value))
                self.last[(key, rank)] = float(value)
                who = self.loggers.setdefault(key, set())
                who.add(rank)
                spread = self.spreads.get(key)
                if spread is None:
                    spread = self.spreads[key] = Spread(self.max_points)
                # %dist_why's rows are numbered apart from the steps: there, every rank that logs is waited for
                spread.add(x, float(value), rank, max(len(who), self.world), None if timed else self.steps)
        for key, spread in self.spreads.items():  # a metric this rank does not log may wait for no more than its rows
            if spread.order and rank not in spread.reached and not key.startswith(TIMED):
                spread.settle(max(len(self.loggers[key]), self.world), self.steps)

    def add_runs(self, runs: dict[int, list[dict[str, Any]]]) -> None:
        """Every rank's rows of a finished run, in step order across ranks (as they arrive live)."""
        self.world = max(self.world, len(runs))
        tagged = [[(row.get("step", i) if row.get("step") is not None else i, rank, row) for i, row in enumerate(rows)]
                  for rank, rows in runs.items()]
        for _, rank, row in heapq.merge(*tagged, key=lambda t: (t[0], t[1])):
            self.add(rank, [row])

    def renumber(self, new: dict[int, int], step: float | None) -> None:
        """The world went on with other ranks from ``step`` (``new``: each remaining rank's old number -> new):
        their series go on under the new numbers, a lost rank's end, and each step waits for the ranks left.
        ``resizes`` keeps where the size changed, which the figure marks."""
        for (k, r), s in self.series.items():
            if r not in new:  # its line ends; the totals before the step still count it
                self.lost.setdefault(k, []).append(s)
        self.series = {(k, new[r]): s for (k, r), s in self.series.items() if r in new}
        self.last = {(k, new[r]): v for (k, r), v in self.last.items() if r in new}
        self.counts = {new[r]: n for r, n in self.counts.items() if r in new}
        self.steps = {new[r]: x for r, x in self.steps.items() if r in new}
        self.timed_rows = {new[r]: rows for r, rows in self.timed_rows.items() if r in new}
        self.loggers = {k: {new[r] for r in who if r in new} for k, who in self.loggers.items()}
        for spread in self.spreads.values():
            spread.renumber(new)
        self.world = len(new)
        self.resizes.append((step, len(new)))

    def keys(self) -> list[str]:
        return sorted({k for k, _ in self.series})

    def ranks(self) -> list[int]:
        return sorted({r for _, r in self.series})

    def recent(self, key: str, rank: int) -> float | None:
        """The mean of this rank's last RECENT values of ``key`` (None if it logged none)."""
        s = self.series.get((key, rank))
        return fmean(s.recent) if s is not None and s.recent else None

    def per_rank(self, key: str) -> dict[int, float]:
        out = {}
        for rank in self.ranks():
            value = self.recent(key, rank)
            if value is not None:
                out[rank] = value
        return out

    def total(self, key: str) -> tuple[list[float], list[float]]:
        """The sum over ranks at every x that all ranks there have drawn (samples/s in total): a rank that joined
        later (a grow) counts from its first x, one lost since counts where it was."""
        per = [self.series[(key, r)].points() for r in self.ranks() if (key, r) in self.series]
        if len(per) < 2:
            return [], []
        maps = [dict(zip(xs, ys, strict=True)) for xs, ys in per]
        firsts = [xs[0] for xs, _ in per]
        xs = sorted(x for x in maps[0].keys() | set().union(*maps[1:]) if all(
            x in m or x < first for m, first in zip(maps, firsts, strict=True)))
        gone = [dict(zip(*s.points(), strict=True)) for s in self.lost.get(key, [])]  # ranks lost since, where they were
        return xs, [sum(m.get(x, 0.0) for m in maps) + sum(g.get(x, 0.0) for g in gone) for x in xs]

    def loss_key(self) -> str | None:
        """The metric that is the loss: 'loss' itself, else the first whose name holds 'loss'."""
        keys = self.keys()
        if "loss" in keys:
            return "loss"
        return next((k for k in keys if "loss" in k and "/" not in k), None)

    def headline(self) -> dict[str, Any]:
        """The numbers someone watching the run wants now (absent where nothing was logged)."""
        out: dict[str, Any] = {}
        if self.steps:
            out["step"] = int(max(self.steps.values()))
        loss = self.loss_key()
        if loss:
            last = [v for (k, _), v in self.last.items() if k == loss]
            out["loss"] = (loss, fmean(last))
        speed = self.per_rank("throughput/samples_per_s")
        if speed:
            out["samples_per_s"] = sum(speed.values())
        share = self.per_rank("comm/overhead(%)")
        if share:
            out["comm_pct"] = fmean(share.values())
        ratio = self.per_rank("comm/ratio")
        if ratio:
            out["ratio"] = fmean(ratio.values())
        verdict = self.why()
        if verdict is not None and verdict.cause != "cannot":
            out["why"] = verdict
        step = self.per_rank("time/step_s")
        if len(step) > 1 and "why" not in out:  # the verdict says which rank holds the others, and why
            # (in a synchronous step every rank's step time is the slowest's: "ranks within 3%" beside it misleads)
            slow = max(step, key=step.__getitem__)
            fast = min(step.values())
            out["slowest"] = (slow, 100.0 * (step[slow] - fast) / fast if fast > 0 else 0.0)
        want = self.expected()
        if step and want is not None and want.get("step_s"):  # the slowest rank sets a synchronous step's pace
            ratio = max(step.values()) / want["step_s"]
            if ratio > OVER_FORECAST:
                out["forecast"] = (ratio, want)
        return out

    def expected(self) -> dict[str, Any] | None:
        """What %%dist_fit forecast for a world of this size (its strategy's label, step_s, peak_MiB), if it did."""
        return self.expect.get(max(self.world, len(self.ranks())))

    def why(self) -> Any:
        """%dist_why's verdict (the judge's) on the ranks' recent ``why/`` rows; None without a judge or rows."""
        if self.judge is None or not self.timed_rows:
            return None
        rows = {rank: list(kept) for rank, kept in sorted(self.timed_rows.items()) if kept}
        return self.judge(rows, max(self.world, len(rows)))

    def split(self) -> dict[int, dict[str, float]]:
        """Each rank's recent step in milliseconds: compute, exposed communication, data wait."""
        out = {}
        for rank, step in self.per_rank("time/step_s").items():
            exposed = self.recent("comm/exposed_s", rank)  # FSDP logs only its whole time in collectives
            comm = exposed if exposed is not None else (self.recent("comm/time_s", rank) or 0.0)
            data = self.recent("time/data_s", rank) or 0.0
            out[rank] = {
                "compute": 1000 * max(0.0, step - comm - data),
                "comm": 1000 * comm,
                "data": 1000 * data,
            }
        return out


def headline_of(runs: dict[int, list[dict[str, Any]]], judge: Judge | None = None) -> dict[str, Any]:
    """A finished run's headline (``nbdist.headline``): what its dashboard's title says, with each rank's share."""
    store = MetricStore(ranks=len(runs), judge=judge)
    store.add_runs(runs)
    out = store.headline()
    share = store.per_rank("comm/overhead(%)")
    if share:
        out["comm_pct_per_rank"] = share
    out["recent"] = RECENT
    return out
