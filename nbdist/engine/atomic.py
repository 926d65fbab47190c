"""A stretch of a cell's code that a release must not cut in two: SIGINT is held from ``hold()`` to ``let_go()``, and
the KeyboardInterrupt it would have raised is raised at ``let_go()``.

``optimizer.step()`` updates a model's parameters one after another; a KeyboardInterrupt raised inside it (the
release after a peer died lands wherever the main thread is) leaves them half updated, and a recovery from a live
peer cannot give such a rank's part (parallel/peer_give.py refuses it): the cell ran again from its start, and a
rank that died once in it died there again (CI, test_peer_recovery, 2026-12-04). The peer hooks hold SIGINT from a
step's beginning to its end (parallel/peer.py); a step takes milliseconds, so the release waits that long.

The release's watcher thread still hears the signal at once (``signal.set_wakeup_fd`` writes for every signal a
Python handler catches), and breaks the group as before: a step that needs the group (a sharded optimizer's) fails
on its broken connections and ends the hold with its error. A hold left open by a step that raised is dropped by the
next cell (held per cell): a SIGINT in a later cell is never held for it.
"""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass
from typing import Any

from .state import STATE


@dataclass
class _Hold:
    on: bool = False
    cell: int = -1  # the cell whose code holds SIGINT
    previous: Any = None  # the handler to put back
    pending: bool = False  # a SIGINT came while held


_HOLD = _Hold()


def hold() -> None:
    """From now until ``let_go()``, a SIGINT waits (a hold already on, one a step that raised left open, stays as it
    is: the next ``let_go()`` ends it). Only the main thread has signal handlers; elsewhere nothing is held."""
    if threading.current_thread() is not threading.main_thread() or held():
        return
    try:
        previous = signal.signal(signal.SIGINT, _held)
    except (ValueError, TypeError):  # no handler of ours can go in here
        return
    if previous is _held:  # a hold an earlier cell left open (its handler never put back): keep the one before it
        previous = _HOLD.previous
    _HOLD.on, _HOLD.previous, _HOLD.pending, _HOLD.cell = True, previous, False, STATE.cell


def let_go() -> None:
    """The held stretch is over: the handler as it was, and a SIGINT that came meanwhile handled now."""
    if not held() or threading.current_thread() is not threading.main_thread():
        return
    pending, previous = _HOLD.pending, _HOLD.previous
    _HOLD.on, _HOLD.pending = False, False
    if signal.getsignal(signal.SIGINT) is _held:  # else replaced meanwhile (the cell's end went deaf): leave it
        signal.signal(signal.SIGINT, previous)
    if pending:
        _deliver(previous)


def held() -> bool:
    """Whether SIGINT is held now."""
    return _HOLD.on and _HOLD.cell == STATE.cell


def _held(signum: int, frame: Any) -> None:
    if _HOLD.cell != STATE.cell:  # a hold an earlier cell left open: the signal is this cell's, as usual
        _HOLD.on, _HOLD.pending = False, False
        signal.signal(signal.SIGINT, _HOLD.previous)
        _deliver(_HOLD.previous, frame)
        return
    _HOLD.pending = True


def _deliver(handler: Any, frame: Any = None) -> None:
    if callable(handler):
        handler(signal.SIGINT, frame)
    elif handler != signal.SIG_IGN:  # the default (or unknown): what Python's own handler does
        raise KeyboardInterrupt
