"""nbdist.tools.why: run a training cell with each step's phases timed on every rank, and say which rank holds the
world back and why (%dist_why); a hang is named while the cell still hangs.

The cell runs once, unchanged, with engine/why.py's timer on every rank; its output is shown as usual. While it
runs, a step that no rank finishes for ``STALL_S`` seconds (and five typical steps) makes nbdist ask every rank
where it is (SIGUSR1, as %dist_where): a rank that never entered the collective the others wait in, or ranks
that called different ones, are named at once, with the cell line (why.hang), before any timeout. When the cell
ends, why.slow judges the steps; ``verdict_of(result)`` judges a finished cell's rows again.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import Any

from ..cells import transcript
from ..cells.output import TaggedPrinter
from ..cluster import Cluster, current
from ..engine import why as timer
from ..equivalence import Verdict
from ..errors import NbdistError
from ..results import RunResult
from ..stragglers import hang, slow
from ..world import reports

STALL_S = 3.0  # no new step on any rank for this long (and 5 typical steps): ask the ranks where they are
CALL_S = 60.0


class Watching(TaggedPrinter):
    """The cell's output as usual, plus each rank's step rows, and a look at the ranks when the steps stop."""

    def __init__(self, cluster: Cluster, ranks: list[int], **kwargs: Any) -> None:
        super().__init__(ranks=ranks, **kwargs)
        self.cluster = cluster
        self.rows: dict[int, list[dict[str, Any]]] = {r: [] for r in ranks}
        self.moved = time.monotonic()  # the last time a rank finished a step (or the cell started)
        self.looked = 0.0
        self.hung: Verdict | None = None

    def metrics(self, rank: int, rows: list[dict[str, Any]]) -> None:
        super().metrics(rank, rows)
        mine = [r for r in rows if "why/step_s" in r]
        if mine:
            self.rows.setdefault(rank, []).extend(mine)
            self.moved = time.monotonic()

    def tick(self, now: float | None = None) -> None:
        super().tick(now)
        now = time.monotonic()
        steps = [r["why/step_s"] for rs in self.rows.values() for r in rs[-5:]]
        limit = max(STALL_S, 5 * (sorted(steps)[len(steps) // 2] if steps else 0.0))
        if self.hung is not None or now - self.moved < limit or now - self.looked < limit:
            return
        self.looked = now
        engines = self.cluster.engines
        if engines is None:
            return
        said = reports.where(engines, list(self.rows), wait=1.0)
        self.hung = hang(said, now - self.moved)
        if self.hung is not None:
            self.flush()
            print(f"nbdist: {self.hung.text}", file=sys.stderr, flush=True)


def why(code: str, cluster: Cluster | None = None, timeout: float | None = None) -> Verdict:
    """Run ``code`` (a training cell) on every rank with its steps timed; the verdict on what holds the world."""
    cluster = cluster or current()
    engines = cluster.engines
    assert engines is not None  # current() is a running cluster
    ranks = list(range(cluster.world_size))
    engines.call(ranks, timer.begin, timeout=CALL_S).ordered("%dist_why", ranks)
    # kept as %%distributed keeps a cell: for a page opened later, and the world panel's line (the verdict's words)
    kept = transcript.start(engines.workdir)
    sink = Watching(cluster, ranks, transcript=kept)
    result = None
    try:
        result = cluster.run(code, timeout=timeout, sink=sink)
    finally:
        engines.call(ranks, timer.end, timeout=CALL_S)  # a dead rank has nothing to stop
        if kept is not None:
            kept.end(result if isinstance(result, RunResult) else None)
    if sink.hung is not None:
        return sink.hung
    assert isinstance(result, RunResult)
    if not result.ok:  # said as %%distributed says it; the steps before it are still judged
        try:
            result.raise_for_error()
        except NbdistError as err:
            print(err, file=sys.stderr)
    return verdict_of(result, cluster.world_size, crowding(cluster))


def crowding(cluster: Cluster) -> str:
    """'4 ranks on 2 cores' when the ranks on this machine take all its cores (or more), else '': the kernel and
    everything else then take turns with them (a 2-rank balanced run on 2 cores, inside the test suite, waited 62% of
    each step for the all-reduce)."""
    here = socket.gethostname()
    local = sum(1 for row in cluster.status() if row.get("host") in (here, "localhost", "127.0.0.1"))
    cores = os.cpu_count() or 1
    return f"{local} ranks on {cores} cores" if local >= cores else ""


def verdict_of(result: RunResult, world: int | None = None, crowded: str = "") -> Verdict:
    """The verdict on a finished cell's step rows (a cell run under %dist_why, or whose ranks logged why/ rows)."""
    rows = {r: [x for x in rs if "why/step_s" in x] for r, rs in (result.metrics or {}).items()}
    failed = [r.rank for r in result.failed]
    verdict = slow(rows, world or len(result.ranks), crowded)
    if failed and verdict.cause != "cannot":
        verdict.text += f" (rank(s) {', '.join(map(str, failed))} did not finish the cell: the steps before count)"
    return verdict
