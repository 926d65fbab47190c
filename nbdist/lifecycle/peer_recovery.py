"""Recovery from a live peer, the notebook's side (parallel/peer.py is the rank's): after a rank died,
ask the living ranks what they hold, decide whether the world can be rebuilt from them, and after the
restart and the setup cells' replay, have them give it. Anything short of exact falls back to the
last checkpoint (recovery.py), and the reason is said in the recovery's line.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.recovering import give_on_rank, hold_on_rank
from ..errors import ClusterError
from ..wire import HOLDING_VERSION, Holding, Names
from ..world.engineset import EngineSet
from . import rerun


@dataclass(frozen=True, slots=True)
class Plan:
    """Go on after ``done`` optimizer steps, at loop step ``step``: what every rank holds alike from
    ``source``; each restarted rank's own part from the rank in ``parts_from``."""

    done: int
    step: int
    passes: int  # over the loop's loader, that the cell had finished (rerun.py)
    source: int
    names: Names
    parts_from: dict[int, int]
    ahead: tuple[int, ...] = ()  # living ranks a step past ``done``: they take the source's state too


def ask(engines: EngineSet, dead: list[int], timeout: float, now: bool = False) -> tuple[list[Holding] | None, str]:
    """Ask every living rank to hold its state (before the setup cells replace its objects): what each
    said (``decide`` reads it), or None and why not in a few words. ``now``: the state as it is between cells
    (a world about to grow), not the parts kept during the loop."""
    living = [r for r in range(len(engines.ranks)) if r not in dead]
    if not living:
        return None, "no rank lived to give its state"
    answers = engines.call(living, hold_on_rank, now, timeout=timeout)
    try:
        return answers.ordered("holding the state for recovery from a peer", living), ""
    except ClusterError as exc:
        return None, str(exc)


def decide(
    said: list[Holding], dead: list[int], renumbered: dict[int, int] | None = None, code: str = ""
) -> tuple[Plan | None, str]:
    """From what each living rank said (parallel/peer_give.hold): go on after the fewest optimizer steps any
    living rank completed (a rank can be one step ahead: it passed the step whose exchange failed on
    another); the source completed exactly those, every living rank kept its own part for that point,
    each dead rank's part is kept by a living rank, and the ranks at that point hold the same parameters.
    ``dead``: the ranks restarted (none when the world goes on without them); ``renumbered``: the living
    ranks' new numbers in a world that went on with fewer (the Plan's ranks are the new world's)."""
    other = next((s for s in said if s.version != HOLDING_VERSION), None)
    if other is not None:
        return None, (
            f"rank {other.rank} answers in another nbdist's words (message version {other.version}, this notebook's "
            f"{HOLDING_VERSION}): install the same nbdist on the ranks' hosts as in the notebook"
        )
    why = next((s.why for s in said if s.why), "")
    if why:
        return None, why
    done = min(s.done for s in said)
    lacking = [s.rank for s in said if done not in s.steps]
    if lacking:
        at = ", ".join(f"rank {s.rank} after {s.done}" for s in said)
        return None, f"rank(s) {', '.join(map(str, lacking))} kept no part for optimizer step {done} ({at})"
    steps = {s.steps[done] for s in said}
    if len(steps) > 1:
        return None, f"the living ranks' loaders disagree on the step after optimizer step {done} ({sorted(steps)})"
    sums: dict[str, list[int]] = {}
    for s in said:
        if s.done == done:
            sums.setdefault(s.checksum, []).append(s.rank)
    if len(sums) > 1:
        groups = "; ".join(f"rank(s) {', '.join(map(str, ranks))}: {digest[:8]}" for digest, ranks in sums.items())
        return None, f"the living ranks hold different parameters (checksums {groups}), so none can be copied"
    parts_from: dict[int, int] = {}
    extra = next((s.names.extra for s in said if s.names.extra), "")
    for rank in dead:
        keeper = next((s for s in said if done in s.keeps and s.keeps[done][0] == rank), None)
        if keeper is not None and extra and not keeper.keeps[done][1]:
            return None, (
                f"rank {rank} died after its optimizer step {done} and before the next step began, and the "
                f"{extra} it updates in between (extra= of save_checkpoint) died with it"
            )
        if keeper is None:
            kept = [f"rank {s.rank}: {sorted(i for i, k in s.keeps.items() if k[0] == rank)}" for s in said]
            return None, (
                f"rank {rank}'s own part (RNG states, loader position, buffers) for optimizer step {done} "
                f"reached no living rank (kept: {'; '.join(kept)})"
            )
        parts_from[rank] = keeper.rank
    source = min(s.rank for s in said if s.done == done)
    names = next(s.names for s in said if s.rank == source)
    if not names.complete():
        return None, f"the model, optimizer or loader has no variable name on rank {source} ({names})"
    passes = next(s.passes.get(done, 0) for s in said if s.rank == source)
    outer = rerun.starts_over(code, names.loader or "") if passes and code else ""
    if outer:
        return None, (
            f"the cell runs again from its first line, and its `{outer}` would begin again although it had "
            f"finished {passes} pass(es) over {names.loader}: {rerun.fix(outer, names.loader or '')}"
        )
    ahead = tuple(s.rank for s in said if s.done != done)
    if renumbered:
        source, parts_from = renumbered[source], {renumbered.get(r, r): renumbered[k] for r, k in parts_from.items()}
        ahead = tuple(renumbered[r] for r in ahead)
    plan = Plan(
        done=done, step=steps.pop(), passes=passes, source=source, names=names, parts_from=parts_from, ahead=ahead
    )
    return plan, ""


def give(engines: EngineSet, chosen: Plan, timeout: float, joined: int = 0) -> int:
    """On every rank of the rebuilt world at once (point to point from the source and the parts' keepers, to the
    ranks that lack them; parallel/peer_give.give): the step it goes on from.
    ``joined``: the last ranks are new to a world that grew (they take the source's part)."""
    every = list(range(len(engines.ranks)))
    answers = engines.call(
        every,
        give_on_rank,
        chosen.done,
        chosen.source,
        chosen.names,
        chosen.parts_from,
        joined,
        chosen.ahead,
        timeout=timeout,
    )
    steps = answers.ordered(f"recovery from rank {chosen.source}", every)
    return int(steps[0])
