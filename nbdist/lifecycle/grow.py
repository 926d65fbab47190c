"""Growing a world between cells (``%dist_grow N``, ``Cluster.grow``): more ranks join a data-parallel world
that is training, and it goes on where it was.

1. every rank holds its state as it is (parallel/peer_give.hold, as for a recovery from a live peer);
2. the launcher starts the new engines; every rank gets its new rank and world size, and a new process group
   is formed (``Membership.add``);
3. the ``%%distributed --setup`` cells run again on every rank (the model and optimizer belong to the old
   group), the new ranks included;
4. one living rank sends what all hold alike (parameters, optimizer, schedulers, ``state=``); each old rank
   takes its own part back (RNG states, loader position, buffers, ``extra=``); a new rank takes the loader
   position, buffers and ``extra=`` of that rank and keeps the RNG states its setup cells gave it (a copy
   would repeat that rank's random numbers). Every loader then splits the rest of the epoch over the larger
   world (parallel/data.py), so no sample is read twice.

Nothing is recomputed and nothing is read from a file. Where the namespace holds no single optimizer with its
model and a loader of ``shard``, the setup cells' state is what every rank has, and the line says so.

While a ``--noblock`` cell trains (``while_running``), the ranks are asked (SIGUSR2) to stop at the next step
boundary of ``loader.steps()`` they agree on (engine/preempt.py); the grow above is then made from the state of
that boundary, and the cell runs again on the larger world from there (cellpath.py: ``CellPath.grow_while_running``).
"""

from __future__ import annotations

import time
from typing import Any

from ..config import StartConfig
from ..errors import ClusterError, ConfigError
from ..results import RunResult
from ..world.engineset import EngineSet
from ..world.standby import arrived
from . import peer_recovery
from .membership import Resize
from .recovery import Replay, replay_setup


def grow(count: int, replay: Replay) -> str:
    """Add ``count`` ranks to ``replay``'s world (see the module's docstring); the line that says what was done (its
    membership says it too). ConfigError for a count or a size the launcher cannot give, ClusterError when a step
    failed."""
    membership = replay.membership
    engines, config = membership.live(), membership.config
    before = len(engines.ranks)
    check_count(count)
    try:
        StartConfig.of(**{**config.flat(), "n": before + count, "min_ranks": None})  # the launcher's checks: cores, hosts
    except ConfigError as exc:
        raise ConfigError(f"cannot grow the world from {before} to {before + count} ranks: {exc}") from None
    if not replay.setup:
        raise ConfigError(
            "cannot grow the world: no cell is marked %%distributed --setup, so the new ranks would have no model or "
            "data. Mark the cells that build them (%%distributed --setup) and run them, then %dist_grow."
        )
    tic = time.perf_counter()
    joining = engines.standby if arrived(engines) and engines.standby and engines.standby.count == count else None
    said, why = peer_recovery.ask(engines, [], replay.timeout, now=True)
    try:
        membership.add(count)
    except Exception as exc:
        raise ClusterError(
            f"could not grow the world: {str(exc).splitlines()[0][:300]}; it goes on with its {before} ranks."
        ) from exc
    added = ", ".join(map(str, range(before, before + count)))
    what = [f"started rank(s) {added}", "rebuilt the process group"]
    if joining is not None:  # the replacement queued since the world went on without it (world/standby.py)
        what[0] = f"rank(s) {added} joined from {joining.named()}, queued since the world shrank"
    replay_setup(replay, "growing the world")
    what.append(f"replayed {len(replay.setup)} setup cell(s) on every rank")
    chosen, why = peer_recovery.decide(said, []) if said is not None else (None, why)
    step = None
    if chosen is not None:
        step = peer_recovery.give(engines, chosen, replay.timeout, joined=count)
        what.append(f"gave every rank step {step} from rank {chosen.source}'s memory (nothing recomputed)")
    else:
        what.append(f"no training state to give ({why}): every rank holds what the setup cells made")
    membership.resized(Resize(before, before + count, step, [], time.time()))
    line = f"grew the world from {before} to {before + count} ranks: {', '.join(what)} in {time.perf_counter() - tic:.1f} s."
    membership.say(line)
    return line


def check_count(count: Any) -> None:
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ConfigError(f"the number of ranks to add ({count!r}) must be a whole number, 1 or more: %dist_grow 2.")


def stopped_for_it(result: RunResult) -> bool:
    """Did every rank end the cell at a step boundary for a change of size (engine/preempt.py's ``Resizing``)?"""
    return bool(result.ranks) and all((r.error or {}).get("ename") == "Resizing" for r in result.ranks)


def _forget_on_rank() -> None:
    from ..engine import preempt

    preempt.forget_resize()


def forget(engines: EngineSet) -> None:
    """No grow is coming: the ranks that never reached a step boundary forget that one was asked."""
    engines.call_each({r: (_forget_on_rank, (), {}) for r in range(len(engines.ranks))}, timeout=10.0)
