"""Which rank holds the world back, and what holds it: the verdict %dist_why prints (rows: engine/why.py).

``slow(rows)``: ``rows`` is each rank's step rows (``why/...`` seconds). Over the last ``WINDOW`` steps (the first
``SKIP`` are warm-up) each rank's typical phase times are compared with the other ranks'. A rank whose phase
takes longer than the others' by at least ``SHARE`` of a step (and ``FLOOR`` seconds) holds the world back: in a
synchronous step every other rank waits for it in the next collective. Where ranks share cores their turns on
them move every phase, so the bar is ``CROWDED_SHARE``, or ``SHARE`` in ``STEADY`` of the steps (a fault's extra
time comes every step; a turn moves from rank to rank). The cause is that phase, said in words:

- ``data``: slow input on that rank (the loader, host-to-device copies, anything before the forward);
- ``compute``: compute skew (forward, backward's computation and the optimizer: more work, or a slower device);
- ``hook``: slow communication on that rank (its DDP communication hook);
- ``gc`` / ``other``: a pause on the host inside the step (garbage collection; I/O, sleeps, logging);
- ``save`` / ``eval``: a checkpoint or an evaluation inside the loop.

A phase that takes ``SHARE`` of every rank's step is said for all ranks (a checkpoint every rank writes; the
all-reduce waited for after backward: ``comm``). Nothing over the bar is ``balanced``, with the largest difference
given. ``hang(reports)``: from the ranks' reports (doctor.py), the rank that never entered the collective the
others wait in, or the ranks that called different collectives (``desync``), with the file and line.
"""

from __future__ import annotations

import statistics
from typing import Any

from .doctor import ranks_text
from .equivalence import Verdict

SKIP = 2  # warm-up steps left out
WINDOW = 20  # the steps compared (the last ones)
SHARE = 0.10  # of a step: a rank's phase this much longer than the others' holds the world back
# where ranks share cores their turns on them move each rank's phases: balanced 4-rank runs on 2 cores showed
# differences up to 12% of a step (benchmarks/why.py), and 21% once in CI (notebook 17, 2026-12-01), so there the bar is
# higher
CROWDED_SHARE = 0.30
# ... unless the difference is steady: a fault's extra time comes every step, while turns on a core move from rank
# to rank. Where ranks share cores a rank is also named when its phase exceeds the others' by ``SHARE`` of the step
# in this share of the window's steps (each step against the other ranks' median in that step)
STEADY = 0.8
STEADY_MIN = 5  # steps: fewer compared (DDP's split of backward, read on some steps only) cannot show steadiness
FLOOR = 0.002  # seconds: differences below this are noise whatever the step
COMM = 0.5  # of a step waited for the all-reduce on every rank: communication-bound (when ranks do not share cores)
SPECIFIC = ("save", "eval", "gc", "hook")  # named before compute or data when they explain half the excess
SPARSE = ("save", "eval", "gc")  # happen on some steps only: averaged, not the median
# timed exactly (inside torch.save; forwards without gradients) and nothing on a rank that does neither: sharing
# cores stretches them but cannot make them appear, so a rank's own save or evaluation needs only ``SHARE``
EXACT = ("save", "eval")
WORDS = {
    "data": ("slow input", "waits for its input (the loader and anything before the forward)"),
    "compute": ("compute skew", "computes (forward, backward and the optimizer: more work, or a slower device)"),
    "hook": ("slow communication", "spends in its DDP communication hook"),
    "gc": ("a pause on the host", "spends in garbage collection"),
    "other": ("a pause on the host", "spends outside the model and the optimizer (I/O, sleeps, logging in the loop)"),
    "save": ("a checkpoint inside the loop", "spends in torch.save"),
    "eval": ("an evaluation inside the loop", "spends in forwards without gradients (evaluation)"),
}


def _phases(row: dict[str, float]) -> dict[str, float]:
    g = row.get
    compute = g("why/forward_s", 0.0) + g("why/optimizer_s", 0.0) - g("why/collective_s", 0.0)  # FSDP2's waits
    compute += g("why/backward_compute_s", g("why/backward_s", 0.0) - g("why/hook_s", 0.0))
    return {
        "data": g("why/data_s", 0.0),
        "compute": compute,
        "hook": g("why/hook_s", 0.0),
        "gc": g("why/gc_s", 0.0),
        "other": g("why/other_s", 0.0),
        "save": g("why/save_s", 0.0),
        "eval": g("why/eval_s", 0.0),
        "comm": g("why/exposed_s", 0.0) + g("why/collective_s", 0.0),
        "step": g("why/step_s", 0.0),
    }


def _typical(rows: list[dict[str, float]]) -> dict[str, float]:
    phases = [_phases(r) for r in rows]
    typical = {k: (statistics.fmean if k in SPARSE else statistics.median)([p[k] for p in phases]) for k in phases[0]}
    # DDP's split of backward is read on some steps only (engine/why.py DDP_EVERY): compute and communication
    # come from those rows (in the others backward's wait for the all-reduce would count as compute)
    split = [p for p, r in zip(phases, rows, strict=True) if "why/exposed_s" in r]
    if split and len(split) < len(phases):
        typical.update({k: statistics.median(p[k] for p in split) for k in ("compute", "comm")})
    return typical


def _steady(timed: dict[int, list[dict[str, Any]]], rank: int, phase: str, bar: float) -> tuple[int, int]:
    """In how many of the window's steps ``rank``'s ``phase`` exceeded the other ranks' median that step by ``bar``,
    and of how many. Each rank logs a row a step, so the rows line up from the end; compute and communication
    are compared in the steps where every rank split DDP's backward (see ``_typical``)."""
    n = min(len(rs) for rs in timed.values())
    window = {r: [_phases(x) for x in rs[-n:]] for r, rs in timed.items()}
    steps = list(range(n))
    if phase in ("compute", "comm"):
        split = [i for i in steps if all("why/exposed_s" in timed[r][len(timed[r]) - n + i] for r in timed)]
        steps = split or steps
    over = sum(
        window[rank][i][phase] - statistics.median(window[q][i][phase] for q in window if q != rank) >= bar
        for i in steps
    )
    return over, len(steps)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def slow(rows: dict[int, list[dict[str, Any]]], world: int | None = None, crowded: str = "") -> Verdict:
    """The verdict for each rank's step rows (those with ``why/step_s``). ``crowded``: why the ranks share cores
    ('4 ranks on 2 cores'), when they take all of them: their waits for each other are then turns on a core, not
    communication, and their phases move more (the bar is ``CROWDED_SHARE``)."""
    timed = {r: [x for x in rs if "why/step_s" in x] for r, rs in rows.items()}
    timed = {r: rs[SKIP:][-WINDOW:] if len(rs) > SKIP + 2 else rs[-WINDOW:] for r, rs in timed.items() if rs}
    world = world or len(rows)
    if not timed or max(len(rs) for rs in timed.values()) < 3:
        return Verdict(
            "cannot",
            "cannot tell: fewer than 3 training steps were timed (%dist_why times the steps of a "
            "loop that calls optimizer.step() after the model's forward and backward); run a loop of at "
            "least 5 steps.",
        )
    missing = sorted(set(range(world)) - set(timed))
    said = f" (rank(s) {', '.join(map(str, missing))} timed no step: dead, or not training)" if missing else ""
    typical = {r: _typical(rs) for r, rs in timed.items()}
    step = statistics.median(t["step"] for t in typical.values())
    figures: dict[str, Any] = {"step_s": step, "steps": min(len(rs) for rs in timed.values()), "typical": typical}
    if len(typical) < 2:
        t = next(iter(typical.values()))
        parts = ", ".join(f"{k} {_ms(t[k])}" for k in ("data", "compute", "other") if t[k] >= FLOOR)
        return Verdict(
            "cannot",
            f"cannot compare ranks: only one rank timed steps{said}. Its step is {_ms(step)}"
            + (f" ({parts})." if parts else "."),
            None,
            figures,
        )
    share = CROWDED_SHARE if crowded else SHARE
    bar = max(share * step, FLOOR)
    excess: dict[tuple[int, str], float] = {}
    for r, t in typical.items():
        others = [o for q, o in typical.items() if q != r]
        for phase in WORDS:
            excess[(r, phase)] = t[phase] - statistics.median(o[phase] for o in others)
    (rank, phase), most = max(excess.items(), key=lambda kv: kv[1])
    for specific in SPECIFIC:
        if excess[(rank, specific)] >= 0.5 * most:
            phase = specific
            most = excess[(rank, specific)]
            break
    quiet = max(SHARE * step, FLOOR)
    steady = ""
    if most < bar and crowded:
        exact = max(((r, p) for r in typical for p in EXACT), key=lambda rp: excess[rp])
        over, of = _steady(timed, rank, phase, quiet)
        figures["steady"] = (over, of)
        if excess[exact] >= quiet:
            (rank, phase), most, bar = exact, excess[exact], quiet
        elif most >= quiet and of >= STEADY_MIN and over >= STEADY * of:
            bar = quiet
            steady = f" It did so in {over} of the last {of} steps: steady, not the turns of ranks that share cores."
    figures.update(rank=rank, phase=phase, excess_s=most, bar_s=bar)
    if most >= bar:
        culprits = sorted(r for r in typical if excess[(r, phase)] >= 0.5 * most)
        rest = [t[phase] for r, t in typical.items() if r not in culprits] or [0.0]
        name, does = WORDS[phase]
        if phase == "compute" and any(x.get("why/cuda") for r in culprits for x in timed[r]):
            does += " on its GPU (CUDA events)"
        figures["ranks"] = culprits
        return Verdict(
            phase,
            f"{name} on {ranks_text(culprits)}: it {does} {_ms(typical[rank][phase])} a step, the "
            f"other ranks {_ms(statistics.median(rest))}; with a step of {_ms(step)} that is "
            f"{most / step:.0%} of every step the others wait for it (in the next collective)." + steady + said,
            None,
            figures,
        )
    for shared in ("save", "eval", "gc", "comm"):
        everyone = statistics.median(t[shared] for t in typical.values())
        if (
            everyone >= bar
            and everyone >= (COMM * step if shared == "comm" else 0)
            and not (shared == "comm" and crowded)
        ):
            figures.update(phase=shared, share=everyone / step)
            what = {
                "save": "a checkpoint inside the loop on every rank: torch.save takes",
                "eval": "an evaluation inside the loop on every rank: forwards without gradients take",
                "gc": "a pause on the host on every rank: garbage collection takes",
                "comm": "communication on every rank: waiting for the all-reduce after backward takes",
            }[shared]
            tail = (
                " No rank holds it: a slow link, or communication that does not overlap backward (larger "
                "buckets, fewer of them)."
                if shared == "comm"
                else " Do it less often, or outside the loop."
            )
            return Verdict(
                shared if shared != "comm" else "comm",
                f"{what} {_ms(everyone)} of a {_ms(step)} step ({everyone / step:.0%}).{tail}" + said,
                None,
                figures,
            )
    comm = statistics.median(t["comm"] for t in typical.values())
    return Verdict(
        "balanced",
        f"balanced: no rank stands out over the last {figures['steps']} steps (the largest "
        f"difference, rank {rank}'s {phase}, is {_ms(max(most, 0))}, {max(most, 0) / step:.0%} of a "
        f"{_ms(step)} step; the bar is {share:.0%}"
        + (f", or {SHARE:.0%} in {STEADY:.0%} of the steps" if crowded else "")
        + ")"
        + (f"; the all-reduce is waited for {comm / step:.0%} of a step" if comm else "")
        + (f" ({crowded}: each waits for the others' turns on a core)" if comm and crowded else "")
        + "."
        + said,
        None,
        figures,
    )


def hang(reports: dict[int, dict[str, Any]], stalled_s: float) -> Verdict | None:
    """The ranks that hold a collective for good, from their reports; None when nothing stands out.

    A rank waits when it is inside torch.distributed, or inside backward (where DDP waits for its gradient
    all-reduce) while no step has ended for seconds; the ranks that do not wait hold the others (still in the cell
    elsewhere, or out of it). When every rank waits, ranks waiting in different collectives (another op, other
    shapes, or backward's all-reduce against one called in the cell) are a desync. Collective counts are not
    compared: a cell released earlier leaves the ranks' counts apart."""
    busy = {r: rep for r, rep in reports.items() if rep.get("busy")}
    waiting = {r for r, rep in busy.items() if _waits(rep)}
    if not waiting:
        return None
    figures: dict[str, Any] = {"stalled_s": stalled_s}
    held = sorted(set(reports) - waiting)
    if held:
        figures["ranks"] = held
        return Verdict(
            "hang",
            f"hang: {ranks_text(held)} never entered the collective that {ranks_text(sorted(waiting))} wait in (no "
            f"step for {stalled_s:.1f} s). {_where({r: reports[r] for r in held})}",
            None,
            figures,
        )
    calls = {r: _call(rep) for r, rep in busy.items()}
    groups = sorted(set(calls.values()), key=lambda c: min(r for r in calls if calls[r] == c))
    if len(groups) < 2:
        return None  # every rank waits in the same collective: nothing here says which one is missing
    sizes = {c: sum(1 for r in calls if calls[r] == c) for c in groups}
    fewest = min(sizes.values())
    figures["ranks"] = sorted(r for r in calls if sizes[calls[r]] == fewest)  # the odd ones out (all, on a tie)
    said = "; ".join(f"{ranks_text([r for r in calls if calls[r] == c])} {c}" for c in groups)
    tie = list(sizes.values()).count(fewest) > 1
    odd = _odd_call(busy) if tie else None
    if odd is not None:  # where they wait ties; what each called last does not
        figures["ranks"], theirs, others = odd
        told = f"; from the line where they wait, {ranks_text(figures['ranks'])} called {theirs}, the others {others}"
    elif tie:
        told = "; the groups are as large, so which side called the odd one cannot be told from where they wait"
    else:
        told = ""
    return Verdict(
        "desync",
        f"desync: the ranks wait in different collectives, which never match: {said} (no step for "
        f"{stalled_s:.1f} s){told}. {_where(busy)}",
        None,
        figures,
    )


def _odd_call(reports: dict[int, dict[str, Any]]) -> tuple[list[int], str, str] | None:
    """The ranks that called something else than the others from the line where some of them wait in a collective:
    (those ranks, their call, the others'); None when that does not single out a minority. A mismatched collective
    can return on some ranks (gloo pairs them up), which then wait in backward beside a rank that is in step: where
    they wait ties, what each called from that line does not. Each rank's last few collectives come with the file
    and line that called them (engine/collectives.py)."""
    recent = {r: (rep.get("collective") or {}).get("recent") or [] for r, rep in reports.items()}
    lines = {_site(calls[-1]) for r, calls in recent.items() if calls and reports[r].get("in_collective")}
    if len(lines) != 1:
        return None
    [line] = lines
    called = {}
    for r, calls in recent.items():
        there = [c for c in calls if _site(c) == line]
        if not there:
            return None  # a rank's call from that line is out of its recent ones
        called[r] = f"{there[-1]['op']} {', '.join(there[-1].get('shapes') or [])}".strip()
    kinds = sorted(set(called.values()), key=lambda c: sum(1 for v in called.values() if v == c))
    if len(kinds) != 2:
        return None
    theirs, others = kinds
    ranks = sorted(r for r, c in called.items() if c == theirs)
    if len(ranks) * 2 >= len(called):  # not a minority
        return None
    return ranks, theirs, others


def _site(call: dict[str, Any]) -> str:
    """'3106666263.py:64' of a call's 'file:line': a cell's file is in a folder of each rank's own (ipykernel_PID)."""
    return str(call.get("at", "")).replace("\\", "/").rsplit("/", 1)[-1]


def _waits(rep: dict[str, Any]) -> bool:
    inner = " ".join(rep.get("stack") or [])
    return bool(rep.get("in_collective")) or "torch/autograd" in inner.replace("\\", "/")


def _call(rep: dict[str, Any]) -> str:
    """What a waiting rank waits in: the collective it called from Python, or backward's all-reduce (DDP)."""
    c = rep.get("collective") or {}
    if rep.get("in_collective") and c.get("op"):
        return f"{c.get('op')} {', '.join(c.get('shapes') or [])}".strip()
    return "backward (DDP's gradient all-reduce)"


def _where(reports: dict[int, dict[str, Any]]) -> str:
    """'rank 2 is at cell line 9 (x = loader_next()), in <module>' for each rank."""
    out = []
    for r, rep in sorted(reports.items()):
        stack = rep.get("cell_stack") or []
        code = f" ({stack[-1].get('code')})" if stack and stack[-1].get("code") else ""
        line = f"cell line {rep['cell_line']}{code}" if rep.get("cell_line") else "library code"
        out.append(f"rank {r} is at {line}, in {rep.get('function')}")
    return "; ".join(out) + "."
