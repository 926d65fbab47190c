"""What a recovery runs on each rank (lifecycle/peer_recovery.py and lifecycle/recovery.py send them): hold the state
and give it (from a living rank), or load the latest checkpoint.

They live here, where the engines have imported their package before any recovery, because a call's function is
imported by the engine that runs it: from the notebook's side (nbdist.lifecycle, with nbdist.world behind it) that
was 25 ms of a core on each living rank at once, about 0.1 s of a recovery at 8 ranks on 2 cores (issue 52).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..wire import Holding, Names


def hold_on_rank(now: bool = False) -> Holding:
    from ..parallel import peer_give

    return peer_give.hold(now)


def give_on_rank(
    done: int, source: int, names: Names, parts_from: dict[int, int], joined: int = 0, ahead: tuple[int, ...] = ()
) -> int:
    from ..parallel import peer_give
    from . import group

    with group.broken_on_error():
        return peer_give.give(done, source, names, parts_from, joined, ahead)


def load_latest_on_rank(path: str, names: dict[str, Any], saved_as: int | None = None) -> int | None:
    """Load the latest checkpoint under ``path`` into the variables ``names`` (``saved_as``: the rank number this
    process saved its own part under, in a world that since went on with fewer ranks)."""
    from ..parallel.checkpoint import restore_latest
    from . import group

    with group.broken_on_error():
        return restore_latest(path, names, saved_as)
