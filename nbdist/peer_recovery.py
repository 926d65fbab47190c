"""Recovery from a live peer, the notebook's side (parallel/peer.py is the rank's): after a rank died,
ask the living ranks what they hold, decide whether the world can be rebuilt from them, and after the
restart and the setup cells' replay, have them give it. Anything short of exact falls back to the
last checkpoint (recovery.py), and the reason is said in the recovery's line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import ClusterError
from .world.engineset import EngineSet


@dataclass(frozen=True, slots=True)
class Plan:
    """Rebuild from ``source`` at ``step``; each restarted rank's own part from the rank in ``parts_from``."""

    source: int
    step: int
    names: dict[str, str]
    parts_from: dict[int, int]


def hold_on_rank() -> dict[str, Any]:
    from .parallel import peer

    return peer.hold()


def restore_on_rank(source: int, names: dict[str, str], parts_from: dict[int, int]) -> int:
    from .parallel import peer

    return peer.restore(source, names, parts_from)


def plan(engines: EngineSet, dead: list[int], timeout: float) -> tuple[Plan | None, str]:
    """Ask every living rank to hold its state (before the setup cells replace its objects); a Plan, or
    None and why not in a few words."""
    living = [r for r in range(len(engines.ranks)) if r not in dead]
    if not living:
        return None, "no rank lived to give its state"
    answers = engines.call(living, hold_on_rank, timeout=timeout)
    try:
        said = answers.ordered("holding the state for recovery from a peer", living)
    except ClusterError as exc:
        return None, str(exc)
    return decide(said, dead)


def decide(said: list[dict[str, Any]], dead: list[int]) -> tuple[Plan | None, str]:
    """From what each living rank said (parallel/peer.hold): all at the same step with the same parameters,
    and each dead rank's own part kept by a living rank at that step."""
    why = next((s["why"] for s in said if s.get("why")), "")
    if why:
        return None, why
    steps = sorted({s["step"] for s in said})
    if len(steps) > 1:
        at = ", ".join(f"rank {s['rank']} at step {s['step']}" for s in said)
        return None, f"the living ranks stopped at different steps ({at})"
    sums: dict[str, list[int]] = {}
    for s in said:
        sums.setdefault(s["checksum"], []).append(s["rank"])
    if len(sums) > 1:
        groups = "; ".join(f"rank(s) {', '.join(map(str, ranks))}: {digest[:8]}" for digest, ranks in sums.items())
        return None, f"the living ranks hold different parameters (checksums {groups}), so none can be copied"
    parts_from: dict[int, int] = {}
    for rank in dead:
        keeper = next((s for s in said if s.get("keeps") == rank), None)
        if keeper is None:
            return None, f"rank {rank}'s own part (RNG states, loader position, buffers) was kept by no living rank"
        if keeper["keeps_step"] != steps[0]:
            return None, (
                f"rank {rank}'s own part reached rank {keeper['rank']} for step {keeper['keeps_step']}, "
                f"and the world stopped at step {steps[0]}"
            )
        parts_from[rank] = keeper["rank"]
    source = min(s["rank"] for s in said)
    names = next(s["names"] for s in said if s["rank"] == source)
    if not all(names.values()):
        return None, f"the model, optimizer or loader has no variable name on rank {source} ({names})"
    return Plan(source=source, step=steps[0], names=names, parts_from=parts_from), ""


def restore(engines: EngineSet, chosen: Plan, timeout: float) -> int:
    """On every rank of the rebuilt world at once (a broadcast and a gather): the step it goes on from."""
    every = list(range(len(engines.ranks)))
    answers = engines.call(every, restore_on_rank, chosen.source, chosen.names, chosen.parts_from, timeout=timeout)
    steps = answers.ordered(f"recovery from rank {chosen.source}", every)
    return int(steps[0])
