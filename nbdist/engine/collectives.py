"""Which collective each rank entered last, and torch's collective checks: the hang doctor's data.

``install()`` wraps torch.distributed's Python collectives once per engine so that each
call records its op, the shapes and dtypes of its tensors and a running count, at the
cost of a dict update. DDP's reducer and FSDP call gloo/NCCL from C++ and are not seen
here; the process group's own sequence number (``group_seq``) counts those too.

``set_debug(True)`` turns on torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` before the group
is formed: every collective first compares its fingerprint (op, shapes, dtypes) across
ranks, so ranks calling different collectives fail at once instead of hanging.
"""

from __future__ import annotations

import collections
import functools
import inspect
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .. import compat

OPS = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "send",
    "recv",
    "isend",
    "irecv",
    "all_gather_object",
    "broadcast_object_list",
)
@dataclass(slots=True)
class Last:
    """The last collective this rank entered (one per process: ``LAST``), as %dist_where reports it."""

    op: str | None = None
    shapes: list[Any] = field(default_factory=list)
    count: int = 0  # collectives this rank entered through torch.distributed's Python functions
    since: float | None = None  # when it entered it (time.time())
    done: bool = True  # whether it returned
    # the last few: (op, shapes, 'file:line' that called it), newest last; %dist_why compares the ranks' calls from
    # the line where some of them wait (a desync: which rank called something else there)
    recent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=RECENT))


RECENT = 8
LAST = Last()
_LOCAL = threading.local()
_RECORDED: set[Any] = set()  # the wrappers record() made (a collective is wrapped once)


def install() -> None:
    """Wrap the collectives of torch.distributed (once per process)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    for name in OPS:
        fn = getattr(c10d, name, None)
        if fn is None or fn in _RECORDED:
            continue
        wrapped = _recorded(name, fn)
        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is fn:
            setattr(dist, name, wrapped)


def _recorded(name: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # a rank's traceback goes from the cell to torch's own code
        if getattr(_LOCAL, "inside", False):  # all_gather_object calls all_gather: record the outer call
            return fn(*args, **kwargs)
        LAST.op, LAST.shapes, LAST.count, LAST.since, LAST.done = name, _shapes(args), LAST.count + 1, time.time(), False
        caller = inspect.currentframe()
        caller = caller.f_back if caller is not None else None  # who called this collective
        at = f"{caller.f_code.co_filename}:{caller.f_lineno}" if caller is not None else "?"
        LAST.recent.append((name, LAST.shapes, at))
        _LOCAL.inside = True
        try:
            return fn(*args, **kwargs)
        finally:
            _LOCAL.inside = False
            LAST.done = True

    _RECORDED.add(call)
    return call


def _shapes(args: tuple[Any, ...]) -> list[str]:
    """'[4, 3] float32' for each tensor among the first arguments (lists of tensors too)."""
    out: list[str] = []
    for arg in args[:2]:
        items = arg if isinstance(arg, (list, tuple)) else [arg]
        for t in items[:4]:
            shape = getattr(t, "shape", None)
            if shape is not None:
                out.append(f"{list(shape)} {str(getattr(t, 'dtype', '')).replace('torch.', '')}")
    return out


def describe() -> dict[str, Any] | None:
    """The last collective this rank entered (op, shapes, count, whether it returned, seconds since),
    and its process group's sequence number; None before the first one."""
    group_seq = None
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            group_seq = compat.group_sequence_number(dist.group.WORLD)
    except Exception:  # a broken group
        pass
    if LAST.op is None and group_seq is None:
        return None
    out: dict[str, Any] = {"op": LAST.op, "shapes": LAST.shapes, "count": LAST.count, "done": LAST.done}
    out["recent"] = [{"op": op, "shapes": shapes, "at": at} for op, shapes, at in LAST.recent]
    out["seconds"] = round(time.time() - LAST.since, 1) if LAST.since else None
    out["group_seq"] = group_seq
    return out


def set_debug(on: bool) -> None:
    """Turn torch's collective fingerprint checks (DETAIL) on or off for groups formed from now on."""
    import torch.distributed as dist

    dist.set_debug_level(dist.DebugLevel.DETAIL if on else dist.DebugLevel.OFF)
