"""One run's steps across a world's cells: what each rank logs becomes the run's points, once each.

A cell's loop may count its steps from 0 again (a cell run three times logs 0..N three times) or go on with its
own count (a loader whose step survives the cell); the run's step goes on either way: a cell's step ``s`` is the
run's ``offset + s``, the offset set by the cell's first row: 0 where that row's step comes after the run's last
step, else what moves it just past it. A row the offset would put at or before the run's last step of an earlier
cell is left out. A step a rank logs
again inside one cell (a loop that went back to its checkpoint after a recovery) is left out: nothing is logged
twice. Each rank's values go under ``rank{r}/``; the world's value of a step (the mean over the ranks, the sum for
throughput, as the dashboard's headline counts them) is written once every rank of the world has logged it (a
metric only some ranks log, such as rank 0's validation accuracy or tensor-parallel rank 0's loss of each group: once
they have, and every other rank of the world has logged that step or a later one without it); a step some rank never
logs (a rank killed before it sent its last rows) is written with the ranks that did,
when a later step is complete, a resize comes or the next cell starts: each tag's steps are written in order
(TensorBoard drops a point older than the last it read). Pure bookkeeping: ``Steps.add`` returns the
points to write, the writer thread calls it (tracker.py).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Any

SKIP = ("t", "step")  # the row's own bookkeeping
TIMED = "why/"  # %dist_why's timings: the verdict's, not a step's metrics
SUMMED = ("throughput/",)  # summed over the ranks (the world's samples/s); every other metric is averaged
WORLD_SIZE = "world/size"

Point = tuple[str, float, int]  # (tag, value, the run's step)


@dataclass(slots=True)
class Steps:
    """The run's step bookkeeping (see the module's docstring)."""

    world: int = 0  # ranks in the world now
    offset: int | None = None  # the run's step of this cell's step 0 (None: the cell has logged nothing yet)
    last: int = -1  # the run's last step with a point
    base: int = 0  # the run's first step after the earlier cells' last (where this cell begins)
    counted: dict[int, int] = field(default_factory=dict)  # rows without a step, per rank, in this cell
    written: dict[tuple[str, int], int] = field(default_factory=dict)  # (key, rank) -> last cell step written
    waiting: dict[tuple[int, str], dict[int, float]] = field(default_factory=dict)  # (cell step, key) -> rank: value
    # per key, the cell steps that began waiting, lowest first (a heap; a step already written is skipped when
    # popped): the steps before a complete one are found without a scan over everything waiting
    heads: dict[str, list[int]] = field(default_factory=dict)
    who: dict[str, set[int]] = field(default_factory=dict)  # the ranks that logged each key in this cell
    reached: dict[int, int] = field(default_factory=dict)  # each rank's last cell step with a metric, in this cell

    def cell(self, world: int) -> list[Point]:
        """A cell starts on ``world`` ranks: its steps go on after the run's; the world's size if it changed."""
        out = self.flush()
        self.base, self.offset = self.last + 1, None
        self.counted.clear()
        self.written.clear()
        self.who.clear()
        self.reached.clear()
        if world != self.world:
            self.world = world
            out.append((WORLD_SIZE, float(world), self.base))
        return out

    def resized(self, new: dict[int, int], step: int | None, joined: list[int] | None) -> list[Point]:
        """The world went on with other ranks from the cell's ``step``: its size from there, ranks renumbered."""
        out = self.flush()
        self.world = len(set(new.values()) | set(joined or []))
        self.written = {(k, new[r]): s for (k, r), s in self.written.items() if r in new}
        self.counted = {new[r]: n for r, n in self.counted.items() if r in new}
        self.who = {k: {new[r] for r in ranks if r in new} for k, ranks in self.who.items()}
        self.reached = {new[r]: s for r, s in self.reached.items() if r in new}
        at = self.last + 1 if step is None or self.offset is None else max(self.offset + step, self.base)
        out.append((WORLD_SIZE, float(self.world), at))
        return out

    def add(self, rank: int, rows: list[dict[str, Any]]) -> list[Point]:
        out: list[Point] = []
        for row in rows:
            if row.get("step") is None and any(k.startswith(TIMED) for k in row):
                continue
            step = row.get("step")
            if step is None:
                step = self.counted.get(rank, 0)
                self.counted[rank] = step + 1
            cell_step = int(step)
            if self.offset is None:
                self.offset = 0 if cell_step >= self.base else self.base - cell_step
            if self.offset + cell_step < self.base:
                continue  # before the cell's first row, at a step an earlier cell has
            for key, value in row.items():
                if key in SKIP or key.startswith(TIMED) or not _number(value):
                    continue
                if self.written.get((key, rank), -1) >= cell_step:
                    continue  # logged again (a recovered loop went back): once only
                self.written[(key, rank)] = cell_step
                at = self.offset + cell_step
                out.append((f"rank{rank}/{key}", float(value), at))
                self.last = max(self.last, at)
                self.reached[rank] = max(self.reached.get(rank, cell_step), cell_step)
                values = self.waiting.get((cell_step, key))
                if values is None:
                    values = self.waiting[(cell_step, key)] = {}
                    heapq.heappush(self.heads.setdefault(key, []), cell_step)
                values[rank] = float(value)
                logging = self.who.setdefault(key, set())
                logging.add(rank)
                if len(values) >= self._expected(logging, cell_step):  # complete: first the steps before it, in order
                    heap = self.heads[key]
                    while heap and heap[0] < cell_step:
                        earlier = heapq.heappop(heap)
                        if (earlier, key) in self.waiting:
                            out += self._world(earlier, key)
                    out += self._world(cell_step, key)
        for key, heap in self.heads.items():  # what only other ranks log may have waited for this rank's rows alone
            if heap and rank not in self.who.get(key, ()):
                out += self._complete(key, heap)
        return out

    def _complete(self, key: str, heap: list[int]) -> list[Point]:
        """The waiting steps of ``key`` that are complete now, in order, up to the first that is not."""
        out: list[Point] = []
        while heap:
            values = self.waiting.get((heap[0], key))
            if values is not None and len(values) < self._expected(self.who[key], heap[0]):
                break
            step = heapq.heappop(heap)
            if values is not None:
                out += self._world(step, key)
        return out

    def flush(self) -> list[Point]:
        """The steps some ranks never logged (a rank lost, a cell that ended): written with the ranks that did."""
        out: list[Point] = []
        for cell_step, key in sorted(self.waiting):
            out += self._world(cell_step, key)
        self.heads.clear()
        return out

    def _expected(self, logging: set[int], cell_step: int) -> int:
        """How many ranks' values a step of a metric waits for: the ranks that log it, once every other rank of the
        world has logged this step or a later one without it; every rank of the world until then (the dashboard's
        rule, widgets/spread.py, made exact for a run that keeps each point)."""
        whole = max(len(logging), self.world, 1)
        if len(logging) >= whole:
            return whole
        others = [at for r, at in self.reached.items() if r not in logging]
        return len(logging) if len(logging) + len(others) >= whole and min(others) >= cell_step else whole

    def _world(self, cell_step: int, key: str) -> list[Point]:
        values = self.waiting.pop((cell_step, key)).values()
        total = math.fsum(values)
        value = total if key.startswith(SUMMED) else total / len(values)
        return [(key, value, (self.offset or 0) + cell_step)]


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)  # a NaN loss is worth seeing
