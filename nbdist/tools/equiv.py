"""nbdist.tools.equiv: run a training cell on one rank and on every rank, and say why they differ (%dist_equiv).

The cell runs twice, unchanged, in the ranks' own namespaces: first on rank 0 alone in a world of one rank,
then on every rank of the world, each time with the recorder of engine/equiv.py on and its output kept back
(a failure is said in the verdict). The cell should seed itself: both runs must build the same model. What it
leaves in the namespaces is the N-rank run's, as after a %%distributed cell. nbdist/equivalence.py compares.
"""

from __future__ import annotations

import time
from typing import Any

from ..cells.output import Sink
from ..cluster import Cluster, current
from ..engine import equiv as recorder
from ..equivalence import Verdict, compare
from ..errors import ConfigError, RankError

STEPS = 20
CALL_S = 60.0  # the most a begin or an end may take on the ranks (each is a few milliseconds)


def equiv(code: str, cluster: Cluster | None = None, steps: int = STEPS, timeout: float | None = None) -> Verdict:
    """Run ``code`` (a training cell) on one rank and on N ranks; the verdict on whether they train alike."""
    if not isinstance(steps, int) or steps < 1:
        raise ConfigError(
            f"steps ({steps!r}) must be a whole number of steps, 1 or more; %dist_equiv compares 20 by default."
        )
    cluster = cluster or current()
    n = cluster.world_size
    if n < 2:
        return compare({"steps": []}, [{"steps": []}] * n)
    dead = cluster.dead_ranks()
    if dead:
        return Verdict(
            "cannot",
            f"cannot tell: rank(s) {', '.join(map(str, dead))} are dead; bring them back "
            f"(%dist_restart --ranks {','.join(map(str, dead))}) and run %dist_equiv again.",
        )
    started = time.monotonic()
    one, failed = _recorded(cluster, code, [0], True, steps, timeout)
    if failed:
        return Verdict(
            "cannot",
            f"cannot tell: the cell failed on one rank (in a world of one rank), so it has no "
            f"one-rank run to compare with: {failed}. The cell must run at any world size.",
        )
    world, failed = _recorded(cluster, code, list(range(n)), False, steps, timeout)
    if failed:
        return Verdict("cannot", f"cannot tell: the cell failed on the {n} ranks: {failed}")
    verdict = compare(one[0], world)
    verdict.figures["seconds"] = time.monotonic() - started
    return verdict


def _recorded(
    cluster: Cluster, code: str, ranks: list[int], one: bool, steps: int, timeout: float | None
) -> tuple[list[dict[str, Any]], str]:
    """Each rank's record of one run of the cell, and what failed ('' when nothing did)."""
    engines = cluster.engines
    assert engines is not None  # current() is a running cluster
    what = "%dist_equiv (one rank)" if one else f"%dist_equiv ({len(ranks)} ranks)"
    engines.call(ranks, recorder.begin, one=one, steps=steps, timeout=CALL_S).ordered(what, ranks)
    try:
        result = cluster.run(code, ranks=ranks, timeout=timeout, sink=Sink())
    finally:
        records = engines.call(ranks, recorder.end, timeout=CALL_S).ordered(what, ranks)
    try:
        result.raise_for_error()  # type: ignore[union-attr]
    except RankError as exc:
        return records, str(exc).strip().splitlines()[0]
    return records, ""
