"""Why N ranks do not train like one: the verdict %dist_equiv prints, from two records (engine/equiv.py).

``compare(one, world)``: ``one`` is the record of the cell run on one rank in a world of one, ``world`` the
records of the same cell on every rank of the N-rank world. Step by step it compares the data (the rows each
step trained on), the first step's weights, the gradients the optimizer applied and the learning rate, finds
the first step where the runs part, and names why, with the number behind it:

- ``start``: the weights differ before the first step (the cell does not seed its model);
- ``same_batch``: every rank trained on the same rows (the loader is not split across ranks);
- ``per_rank_batch``: the world trained on N times one rank's rows a step (the per-rank batch is the global one);
- ``padding`` / ``drop_last``: rows seen twice, or never, that one rank sees once (DistributedSampler's
  padding, a dropped last batch);
- ``order``: the same rows, in other steps;
- ``averaged_twice`` / ``summed``: gradients 1/N (or N) times one rank's, in the same direction;
- ``lr``: the same gradients, another learning rate (scaled by the world size);
- ``batchnorm``: gradients that part in direction while BatchNorm layers keep per-rank statistics;
- ``same_random`` / ``random``: they part while the step draws random numbers, every rank the same ones (or
  not: then no exact comparison is possible);
- ``not_averaged``: the ranks applied different gradients;
- ``equivalent``: the runs agree within the floating-point order of the reduction (the figure is given);
- ``unknown`` and ``cannot``: said as such, never a guess.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

# relative difference within which two runs count as the same, by the gradients' dtype: the reduction's order
# (one batch's mean against the mean of N ranks' means) moves the last bits, and 20 steps carry that forward
TOLERANCE = {"float64": 1e-9, "float32": 1e-4}
LOOSE = 1e-2  # bfloat16, float16
PROPORTIONAL = 1e-3  # gradients this close to a multiple of the one-rank ones point the same way


@dataclass
class Verdict:
    cause: str
    text: str
    step: int | None = None  # the first step (0-based) where the runs part
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def equivalent(self) -> bool:
        return self.cause == "equivalent"

    def __str__(self) -> str:
        return self.text

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # a cell's value (%%dist_equiv) reads as its text
        printer.text(self.text)


def _rel(a: list[float], b: list[float]) -> float:
    """|a - b| / |b| (0 when both are zero)."""
    diff = math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b, strict=True)))
    size = math.sqrt(sum(y * y for y in b))
    return diff / size if size else (0.0 if diff == 0 else math.inf)


def _ratio(a: list[float], b: list[float]) -> tuple[float, float]:
    """The multiple r of b closest to a, and how far a is from r*b (relative to a)."""
    bb = sum(y * y for y in b)
    if not bb:
        return math.nan, math.inf
    r = sum(x * y for x, y in zip(a, b, strict=True)) / bb
    return r, _rel([r * y for y in b], a)


def _near(value: float, target: float) -> bool:
    return abs(value - target) <= 0.05 * abs(target)


def _loss(steps: list[dict[str, Any]]) -> float | None:
    """The world's loss for one step: each rank's last loss, weighted by the rows it trained on."""
    pairs = [(s["losses"][-1], len(s["rows"]) or 1) for s in steps if s["losses"]]
    if len(pairs) != len(steps):
        return None
    return sum(v * w for v, w in pairs) / sum(w for _, w in pairs)


def _rows_text(n: int) -> str:
    return f"{n} row{'s' if n != 1 else ''}"


def compare(one: dict[str, Any], world: list[dict[str, Any]]) -> Verdict:
    """The verdict for a cell's one-rank record and its N-rank records (ordered by rank)."""
    n = len(world)
    if n < 2:
        return Verdict(
            "cannot",
            "cannot tell: the world has 1 rank, so there is nothing to compare one rank with; "
            "start more (%dist_start -n 4) and run %dist_equiv again.",
        )
    counts = [len(r["steps"]) for r in world]
    k = min([len(one["steps"]), *counts])
    if k == 0:
        return Verdict(
            "cannot",
            "cannot tell: no training step was seen (no optimizer.step() on "
            f"{'one rank' if not one['steps'] else 'the ' + str(n) + ' ranks'}); %dist_equiv compares "
            "the steps of a loop that calls optimizer.step(), with the model's forward and backward.",
        )
    tol = TOLERANCE.get(one["steps"][0]["dtype"], LOOSE)
    figures: dict[str, Any] = {"steps": k, "ranks": n, "tolerance": tol}
    notes = [] if len(set(counts)) == 1 else [f"(the ranks took {', '.join(map(str, counts))} steps; compared {k})"]
    ones, ranks = one["steps"][:k], [r["steps"][:k] for r in world]

    start = _rel(ranks[0][0].get("params", []), ones[0].get("params", []))
    figures["start"] = start
    if start > tol:
        return Verdict(
            "start",
            "cannot compare: the weights differ before the first step (relative difference "
            f"{start:.2g}), so the two runs start from different models; seed the cell before it builds "
            "the model (torch.manual_seed(0)) and run %dist_equiv again.",
            0,
            figures,
        )

    losses = [(ones[s]["losses"][-1] if ones[s]["losses"] else None, _loss([r[s] for r in ranks])) for s in range(k)]
    figures["losses"] = losses  # (one rank, N ranks) a step
    found = _data(ones, ranks, one, world, figures) or _gradients(ones, ranks, one, world, figures, tol)
    if found is not None:
        found.figures = figures
        found.text = " ".join([found.text, *notes])
        return found
    loss = max((abs(b - a) / max(abs(a), 1e-30) for a, b in losses if a is not None and b is not None), default=None)
    grad = max(_rel(ranks[0][s]["grad"], ones[s]["grad"]) for s in range(k))
    figures.update(loss=loss, grad=grad)
    said = f"the loss by at most {loss:.2g} (relative) and " if loss is not None else ""
    return Verdict(
        "equivalent",
        f"equivalent: over {k} steps {n} ranks and one rank differ in {said}the gradients "
        f"by at most {grad:.2g}: the order of floating-point sums only (within {tol:g})."
        + "".join(" " + x for x in notes),
        None,
        figures,
    )


def _data(
    ones: list[dict[str, Any]],
    ranks: list[list[dict[str, Any]]],
    one: dict[str, Any],
    world: list[dict[str, Any]],
    figures: dict[str, Any],
) -> Verdict | None:
    n = len(ranks)
    for s, o in enumerate(ones):
        each = [r[s]["rows"] for r in ranks]
        together = [h for rows in each for h in rows]
        if Counter(together) == Counter(o["rows"]):
            continue
        figures.update(rows_one=len(o["rows"]), rows_world=len(together))
        if all(rows == each[0] for rows in each) and each[0]:
            return Verdict(
                "same_batch",
                f"at step {s} every rank trained on the same {_rows_text(len(each[0]))}: "
                "the loader is not split across the ranks, so the world repeats one rank's data. Give "
                "each rank its share: DataLoader(data, sampler=DistributedSampler(data), batch_size=B // "
                "world_size).",
                s,
            )
        if len(together) == n * len(o["rows"]):
            b = len(o["rows"])
            return Verdict(
                "per_rank_batch",
                f"at step {s} each rank trained on {_rows_text(b)}, as many as the "
                f"one-rank run's whole batch: the world's batch is {n} x {b} = {n * b} rows. The batch size "
                f"the cell gives is each rank's; for one rank's batch of {b}, give each rank {b} // "
                "world_size (and keep the learning rate).",
                s,
            )
        seen_one = Counter(h for step in ones for h in step["rows"])
        seen_world = Counter(h for r in ranks for step in r for h in step["rows"])
        extra, missing = seen_world - seen_one, seen_one - seen_world
        twice = sum((Counter(together) - Counter(set(together))).values())
        if twice or (extra and not missing):
            here = sum((Counter(together) - Counter(o["rows"])).values())
            return Verdict(
                "padding",
                f"at step {s} the world trained on {len(together)} rows and one rank on {len(o['rows'])}: "
                f"{_rows_text(here)} of the world's are repeats (over the run, {sum(extra.values())} more row visits "
                "than one rank makes). DistributedSampler "
                "pads the data to a multiple of the world size by repeating rows. Drop the short last batch on both: "
                "DistributedSampler(data, drop_last=True) and DataLoader(..., drop_last=True) (or a dataset "
                "whose length is a multiple of world_size x batch).",
                s,
            )
        if missing and not extra:
            return Verdict(
                "drop_last",
                f"at step {s} the world trained on {len(together)} rows, one rank on "
                f"{len(o['rows'])}: {_rows_text(sum(missing.values()))} one rank trains on never reach the "
                "world (a dropped last batch, or drop_last on one side only). Drop the short last batch "
                "on both: DistributedSampler(data, drop_last=True) and DataLoader(..., drop_last=True).",
                s,
            )
        if not extra and not missing:
            return Verdict(
                "order",
                f"at step {s} the world trained on other rows than one rank at that step, though "
                "over the run they saw the same rows: the order differs. Shuffle with one seed on every "
                "rank (DistributedSampler(data, shuffle=True, seed=0) and sampler.set_epoch(epoch) each "
                "epoch), as one rank does.",
                s,
            )
        new = sum((Counter(together) - Counter(o["rows"])).values())
        parted = f"{new} of the {len(together)} rows the model trained on are not among one rank's {len(o['rows'])}"
        return _random(s, parted, one, world, ranks) or Verdict(
            "unknown", f"at step {s} {parted}: %dist_equiv cannot name why the data differs.", s
        )
    return None


def _gradients(
    ones: list[dict[str, Any]],
    ranks: list[list[dict[str, Any]]],
    one: dict[str, Any],
    world: list[dict[str, Any]],
    figures: dict[str, Any],
    tol: float,
) -> Verdict | None:
    n = len(ranks)
    for s, o in enumerate(ones):
        spread = max(_rel(r[s]["grad"], ranks[0][s]["grad"]) for r in ranks)
        if spread > tol:
            figures["rank_spread"] = spread
            return Verdict(
                "not_averaged",
                f"at step {s} the ranks applied different gradients (relative spread "
                f"{spread:.2g}): they are not averaged across the ranks, so the copies drift apart. Wrap "
                "the model in DistributedDataParallel (or all_reduce each gradient and divide by the world "
                "size) before optimizer.step().",
                s,
            )
        g, g1 = ranks[0][s]["grad"], o["grad"]
        rel = _rel(g, g1)
        if rel > tol:
            r, off = _ratio(g, g1)
            figures.update(grad=rel, ratio=r, off_ratio=off)
            if off <= PROPORTIONAL and _near(r, 1 / n):
                return Verdict(
                    "averaged_twice",
                    f"at step {s} the gradients are 1/{n} of one rank's ({r:.4g} times, "
                    "same direction): the loss is divided by the world size on top of DDP's average (or "
                    "averaged across ranks twice). Drop the division: DDP already averages the gradients.",
                    s,
                )
            if off <= PROPORTIONAL and _near(r, n):
                return Verdict(
                    "summed",
                    f"at step {s} the gradients are {n} times one rank's ({r:.4g}, same "
                    "direction): they are summed across ranks, not averaged (loss * world_size, or an "
                    "all_reduce of the gradients not divided by the world size). Average them.",
                    s,
                )
            if off <= PROPORTIONAL:
                return Verdict(
                    "scaled",
                    f"at step {s} the gradients are {r:.4g} times one rank's, in the same "
                    "direction: the loss or the gradients are scaled differently on N ranks.",
                    s,
                )
            return _parted(s, rel, one, world, ranks)
        lr1, lr = o["lr"], ranks[0][s]["lr"]
        if lr != lr1:
            r = lr[0] / lr1[0] if lr1 and lr1[0] else math.nan
            figures.update(lr_one=lr1, lr_world=lr, lr_ratio=r)
            scaled = f"scaled by {r:.4g}" + (" (the world size)" if _near(r, n) else "")
            return Verdict(
                "lr",
                f"at step {s} the gradients agree but the learning rate is {lr[0]:g} on {n} ranks and "
                f"{lr1[0]:g} on one, {scaled}: the batch is the same {_rows_text(len(o['rows']))} either "
                "way, so there is nothing to scale for. Use one rank's learning rate (scale it only when "
                "each rank keeps one rank's whole batch).",
                s,
            )
    return None


def _parted(
    s: int, rel: float, one: dict[str, Any], world: list[dict[str, Any]], ranks: list[list[dict[str, Any]]]
) -> Verdict:
    """The gradients part in direction at step s: BatchNorm, random draws, or unknown."""
    bn = sorted(set(world[0]["batchnorm"]))
    parted = f"the gradients part from one rank's (relative difference {rel:.2g})"
    if bn:
        names = ", ".join(bn[:3]) + (f" and {len(bn) - 3} more" if len(bn) > 3 else "")
        return Verdict(
            "batchnorm",
            f"at step {s} {parted} while the model has BatchNorm layers that normalise with "
            f"each rank's own rows: {names}. Share the statistics across ranks before DDP: "
            "nbdist.parallel.sync_batchnorm(model) (on CUDA it is nn.SyncBatchNorm.convert_sync_batchnorm, "
            "which needs a GPU).",
            s,
        )
    return _random(s, parted, one, world, ranks) or Verdict(
        "unknown",
        f"at step {s} {parted} on the same data, weights and learning rate, for a reason %dist_equiv cannot name.",
        s,
    )


def _random(
    s: int, parted: str, one: dict[str, Any], world: list[dict[str, Any]], ranks: list[list[dict[str, Any]]]
) -> Verdict | None:
    """Random draws in the steps up to s explain a difference: every rank the same ones, or not; None if none."""
    steps = [r[s] for r in ranks]
    drawn = any(r[t]["random"] for r in ranks for t in range(s + 1))
    if not drawn and not one["dropout"]:
        return None
    what = f"dropout: {', '.join(world[0]['dropout'])}" if world[0]["dropout"] else "augmentation or other draws"
    if len({st["rng"] for st in steps}) == 1:
        return Verdict(
            "same_random",
            f"at step {s} {parted}; the steps draw random numbers ({what}) and every rank "
            f"starts step {s} with the same random state, so the {len(steps)} ranks draw the same numbers "
            "for different rows. Key the randomness to the row (a generator seeded by the row's index), "
            "or at least seed each rank apart after building the model (torch.manual_seed(seed + rank)).",
            s,
        )
    return Verdict(
        "random",
        f"cannot tell exactly: at step {s} {parted}, and the steps draw random numbers ({what}) "
        "that one rank and N ranks draw differently. Key the randomness to the row (a generator seeded by "
        "the row's index), or turn it off, and compare again.",
        s,
    )
