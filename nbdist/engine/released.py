"""What a cell that nbdist released leaves on its rank: whether its process group was lost, and torch's grad mode put
back as the cell began.

A release is asynchronous: its SIGINT raises KeyboardInterrupt at whatever bytecode the main thread runs next. After
a peer's death that is often a context manager's ``__exit__`` running for gloo's error: DDP's forward broadcasts its
buffers inside ``torch.no_grad()``, and a KeyboardInterrupt raised at the top of its ``__exit__`` leaves grad mode
off on that thread for good. The recovery then ran the cell again with grad off, and ``loss.backward()`` said
"element 0 of tensors does not require grad" (CI, test_peer_loops, gradient accumulation, 2026-12-03). The mode the
cell began with is put back once a cell whose group was lost is over: a cell run again begins as it first began.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from .. import wire
from .state import STATE

BREAK_S = 5.0  # a BREAK_NOW file older than this is left over from an earlier release
LOST_GROUP = ("gloo/transport", "Connection reset by peer", "Connection closed by peer")  # gloo's words for a lost peer
_AT_START: list[bool] = []  # grad mode when the running cell began (none while torch was not yet imported)


def break_now() -> bool:
    """Whether the client asked this release to break the group at once (a rank died: the group is lost anyway)."""
    try:
        with open(os.path.join(STATE.report_dir or "", wire.BREAK_NOW)) as fh:
            return abs(time.time() - float(fh.read())) < BREAK_S
    except (OSError, ValueError):
        return False


def group_lost(exc: BaseException | None) -> bool:
    """Whether ``exc`` ended a cell whose process group is lost: nbdist's watcher shut its connections, the release
    said a rank died (``break_now``), or gloo lost a peer (in ``exc`` or what it was raised while handling)."""
    if exc is None:
        return False
    if STATE.aborted or break_now():
        return True
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if any(word in str(exc) for word in LOST_GROUP):
            return True
        exc = exc.__context__
    return False


def at_start() -> None:
    """Note torch's grad mode as the cell begins (the pre-cell hook); a break of the group in an earlier cell is no
    longer this cell's to tell."""
    STATE.broke = None
    torch = sys.modules.get("torch")
    _AT_START[:] = [bool(torch.is_grad_enabled())] if torch is not None else []


def at_end(result: Any) -> None:
    """Once a cell whose group was lost is over: grad mode as the cell began (the post-cell hook)."""
    torch = sys.modules.get("torch")
    exc = getattr(result, "error_in_exec", None)
    if torch is not None and _AT_START and group_lost(exc) and torch.is_grad_enabled() != _AT_START[0]:
        torch.set_grad_enabled(_AT_START[0])
