"""Growing a world between cells (``%dist_grow N``, ``Cluster.grow``): more ranks join a data-parallel world
that is training, and it goes on where it was.

1. every rank holds its state as it is (parallel/peer_give.hold, as for a recovery from a live peer);
2. the launcher starts the new engines; every rank gets its new rank and world size, and a new process group
   is formed (``Cluster.resize``);
3. the ``%%distributed --setup`` cells run again on every rank (the model and optimizer belong to the old
   group), the new ranks included;
4. one living rank sends what all hold alike (parameters, optimizer, schedulers, ``state=``); each old rank
   takes its own part back (RNG states, loader position, buffers, ``extra=``); a new rank takes the loader
   position, buffers and ``extra=`` of that rank and keeps the RNG states its setup cells gave it (a copy
   would repeat that rank's random numbers). Every loader then splits the rest of the epoch over the larger
   world (parallel/data.py), so no sample is read twice.

Nothing is recomputed and nothing is read from a file. Where the namespace holds no single optimizer with its
model and a loader of ``shard``, the setup cells' state is what every rank has, and the line says so.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from . import peer_recovery
from .config import StartConfig
from .errors import ClusterError, ConfigError
from .recovery import Recovery, Replay, Resize, replay_setup
from .world.engineset import EngineSet


def grow(
    count: int,
    engines: EngineSet,
    config: StartConfig,
    resize: Callable[..., dict[int, int]],
    replay: Replay,
    recovery: Recovery,
    say: Callable[[str], None],
) -> str:
    """Add ``count`` ranks (see the module's docstring); the line that says what was done (``say`` gets it too).
    ConfigError for a count or a size the launcher cannot give, ClusterError when a step failed."""
    before = len(engines.ranks)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ConfigError(f"the number of ranks to add ({count!r}) must be a whole number, 1 or more: %dist_grow 2.")
    try:
        dataclasses.replace(config, n=before + count, min_ranks=None)  # the launcher's own checks: cores, hosts
    except ConfigError as exc:
        raise ConfigError(f"cannot grow the world from {before} to {before + count} ranks: {exc}") from None
    if not replay.setup:
        raise ConfigError(
            "cannot grow the world: no cell is marked %%distributed --setup, so the new ranks would have no model or "
            "data. Mark the cells that build them (%%distributed --setup) and run them, then %dist_grow."
        )
    tic = time.perf_counter()
    said, why = peer_recovery.ask(engines, [], replay.timeout, now=True)
    try:
        resize([], count)
    except Exception as exc:
        raise ClusterError(
            f"could not grow the world: {str(exc).splitlines()[0][:300]}; it goes on with its {before} ranks."
        ) from exc
    added = ", ".join(map(str, range(before, before + count)))
    what = [f"started rank(s) {added}", "rebuilt the process group"]
    replay_setup(replay, "growing the world")
    what.append(f"replayed {len(replay.setup)} setup cell(s) on every rank")
    chosen, why = peer_recovery.decide(said, []) if said is not None else (None, why)
    step = None
    if chosen is not None:
        step = peer_recovery.restore(engines, chosen, replay.timeout, joined=count)
        what.append(f"gave every rank step {step} from rank {chosen.source}'s memory (nothing recomputed)")
    else:
        what.append(f"no training state to give ({why}): every rank holds what the setup cells made")
    recovery.sizes.append(Resize(before, before + count, step, [], time.time()))
    line = f"grew the world from {before} to {before + count} ranks: {', '.join(what)} in {time.perf_counter() - tic:.1f} s."
    say(line)
    return line
