"""LR schedulers by the optimizer they hold: what a checkpoint keeps without being told.

A loop's scheduler is part of its state: resumed with its scheduler started over, a run takes other
steps from there on, silently (a StepLR reset moved final weights by 3.5e-4). A scheduler holds its
optimizer (``.optimizer``), so ``save_checkpoint(path, model, opt, step)`` can find the ones bound to
``opt`` (parallel/checkpoint.py). ``install`` notes every scheduler made from then on, in the order
made, through ``LRScheduler.__new__`` (every torch scheduler and subclass goes through it, also those
whose ``__init__`` skips LRScheduler's: ReduceLROnPlateau, SequentialLR, ChainedScheduler); the
first ``bound`` also looks once through the heap for schedulers made before (a script that imports
nbdist after making its scheduler). Notes are weak: a scheduler dropped is forgotten.
"""

from __future__ import annotations

import gc
import itertools
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

_MADE: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()  # scheduler -> order made
_COUNT = itertools.count()
@dataclass(slots=True)
class _Done:
    installed: bool = False  # LRScheduler.__new__ notes each scheduler made
    swept: bool = False  # the schedulers made before it were looked for


_DONE = _Done()


def install(first: bool = False) -> None:
    """Note every LR scheduler made from now on (once per process); ``first``: before any user code ran in
    this process (a rank's configure), so there is nothing made before to look for."""
    if first and not _DONE.installed:
        _DONE.swept = True
    if _DONE.installed:
        return
    from torch.optim.lr_scheduler import LRScheduler

    def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:  # noqa: N807 - the slot's own name
        obj: Any = object.__new__(cls)
        _MADE[obj] = next(_COUNT)
        return obj

    LRScheduler.__new__ = __new__  # type: ignore[method-assign,assignment]
    _DONE.installed = True


def _sweep() -> None:
    """Once: note the schedulers made before ``install`` (one pass over the heap, about 0.1 s)."""
    from torch.optim.lr_scheduler import LRScheduler

    _DONE.swept = True
    before = -(10**12)  # made before every scheduler install() noted
    for obj in gc.get_objects():
        if issubclass(type(obj), LRScheduler) and obj not in _MADE:  # type(): no proxy's __class__ is asked
            _MADE[obj] = before
            before += 1


def bound(optimizer: Any, known: Iterable[Any] = ()) -> list[Any]:
    """The LR schedulers holding ``optimizer``, in the order they were made, but those in ``known`` and
    those inside another one found (SequentialLR's and ChainedScheduler's parts are saved with it)."""
    if optimizer is None:
        return []
    install()
    if not _DONE.swept:
        _sweep()
    known = list(known)
    skip = {id(o) for o in known}
    found = sorted(
        (s for s in list(_MADE.keys()) if getattr(s, "optimizer", None) is optimizer and id(s) not in skip),
        key=lambda s: _MADE.get(s, 0),
    )
    inner = {id(part) for s in [*found, *known] for part in getattr(s, "_schedulers", None) or []}
    return [s for s in found if id(s) not in inner]
