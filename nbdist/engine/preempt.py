"""Preemption on a rank: SIGTERM runs the save hooks on every rank at the same step, then the rank leaves.

Slurm preemption, ``scancel --signal=TERM`` and a Kubernetes eviction all send SIGTERM,
and kill for good some seconds later. Saving from inside the signal handler is unsafe:
the ranks are at different points of a step and the save's own collectives would pair
with the training's. So the handler only takes note, and the ranks agree at a step
boundary (``point``, which ``ShardedLoader.steps`` calls once per step) to run the hooks
together and end the cell with ``Preempted``. The ranks that were signalled then leave;
the others stay for ``--max-restarts`` or ``%dist_restart``.

The agreement costs the steps nothing measurable. An exchange (engine/flags.py: each rank's
flag, over the world's store, or an all-reduce on nbdist's own gloo group where nbdist did not
form the world; on the CPU, never a GPU synchronisation) is said without waiting and read at the
next exchange, when every rank has long said its part. Exchanges happen every ``k`` points, ``k``
chosen so that they are about ``period(size)`` seconds apart (PERIOD; longer in worlds of hundreds of ranks, whose
parts rank 0's store serves in turn): each one also carries every rank's time
per step since the last, so every rank reads the same numbers and computes the same next ``k``
(an exchange must come at the same point on every rank). Every rank therefore acts at the same step, at most about two periods
after the signal, well inside the grace. ``settle`` (the end of a ``steps()`` loop) reads the
exchange in flight without starting another.

The same exchange carries a second flag: a world asked to change size while a loop runs
(``%dist_grow`` beside a ``--noblock`` cell sends SIGUSR2 to the ranks, ``asking_to_resize``). Every rank then
ends the cell at the same step with ``Resizing``, holding the state of that step boundary; the client grows
the world and runs the cell again, which goes on from there (grow.py).

A rank signalled while no cell runs runs its hooks at once (every rank of a preempted
job is signalled). In every case the rank is gone ``grace`` seconds after the signal,
hooks done or not: the time is bounded.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .state import STATE

Hook = Callable[[int | None], Any]  # hook(step): the step the ranks agreed on, None when idle
HOOKS: list[Hook] = []
DEFAULT: list[Hook] = []  # save_checkpoint registers "save again at this step" here


@dataclass(slots=True)
class Preemption:
    """This rank's side of preemption and of a resize asked while a loop runs (one per process: ``PREEMPT``)."""

    asked: float | None = None  # when SIGTERM came (time.time())
    installed: bool = False  # the SIGTERM handler is on
    previous: Any = None  # the handler it replaced
    grace: float = 25.0  # seconds the hooks get before this rank leaves anyway
    left: bool = False  # this rank is on its way out
    resize: bool = False  # %dist_grow asked the running loop to stop at its next step boundary (SIGUSR2)


@dataclass(slots=True)
class Exchange:
    """The flag exchange in flight (``pending``, of the world ``of``: flags.world()), and when the next starts:
    ``countdown`` points from now (``calls`` of them since the last exchange began at ``since``, a perf_counter
    time). ``index`` counts the exchanges said in world ``of``; it goes on across loops and a resize asked, so no
    two exchanges of one world share their keys in its store."""

    pending: Any = None
    of: Any = None
    index: int = 0
    countdown: int = 1
    since: float | None = None
    calls: int = 0

    def clear(self) -> None:
        self.pending = self.since = None
        self.countdown, self.calls = 1, 0


PREEMPT = Preemption()
EXCHANGE = Exchange()
PERIOD = 0.5  # seconds between exchanges, about (the signal is acted on within about two)
PERIOD_RANKS = 256  # from this many ranks the period grows with the world (``period``), up to LONGEST_PERIOD
LONGEST_PERIOD = 2.0
MAX_EVERY = 100_000  # points between exchanges at most


class Preempted(RuntimeError):
    """The world is going down: a rank received SIGTERM; the save hooks ran on every rank."""


class Resizing(RuntimeError):
    """The world changes size at this step boundary: every rank ends the cell here, and the client runs it
    again once the world has its new size (grow.py)."""


def asking_to_resize(signum: int = 0, frame: Any = None) -> None:
    """SIGUSR2's handler (engine/runtime.py installs it): the client asks the world to change size; every
    rank stops at the next step boundary they agree on."""
    PREEMPT.resize = True


def on_preempt(fn: Hook | None = None, *, grace: float | None = None) -> Any:
    """Run ``fn(step)`` on every rank when any rank receives SIGTERM (usable as a decorator).

    Without hooks of its own a rank saves again through the last ``save_checkpoint`` call
    (same path, model, optimizer and loader) at the agreed step. ``grace``: seconds from
    the signal until the rank leaves regardless (default 25; Slurm's KillWait is 30).
    """
    if grace is not None:
        if grace <= 0:
            raise ValueError(f"grace ({grace!r}) must be positive seconds, such as 25.")
        PREEMPT.grace = float(grace)
    install()
    if fn is None:
        return lambda f: on_preempt(f)
    if fn not in HOOKS:
        HOOKS.append(fn)
    return fn


def install() -> None:
    """Take SIGTERM over from ipyparallel's engine (whose handler stops it; it is called at the end)."""
    if PREEMPT.installed or threading.current_thread() is not threading.main_thread():
        return
    PREEMPT.previous = signal.signal(signal.SIGTERM, _on_sigterm)
    PREEMPT.installed = True


def _on_sigterm(signum: int, frame: Any) -> None:
    if PREEMPT.asked is not None:
        return
    PREEMPT.asked = time.time()
    threading.Thread(target=_deadline, name="nbdist-preempt", daemon=True).start()
    if STATE.busy_since is None:  # no cell: save now, then go
        _run_hooks(None)
        leave()


def _deadline() -> None:
    time.sleep(PREEMPT.grace)
    print(
        f"nbdist: SIGTERM {PREEMPT.grace:.0f} s ago and the hooks have not finished; leaving.", file=sys.__stderr__
    )
    os._exit(143)


def asked() -> bool:
    return PREEMPT.asked is not None


def period(size: int) -> float:
    """About how many seconds apart a world of ``size`` ranks exchanges its flags: PERIOD, and from PERIOD_RANKS
    ranks on, longer in proportion, up to LONGEST_PERIOD. Rank 0's store serves every rank's part and read in turn,
    on one thread, so an exchange's cost to it grows with the ranks (benchmarks/store_load.py: 12-17 ms of its CPU at
    256 ranks, 61-80 ms at 1,024); a longer period keeps its share of that thread's time at 256 ranks' (about 3% of a
    core) up to 1,024 ranks. A signal is still acted on within about two periods, well inside a grace."""
    return min(LONGEST_PERIOD, PERIOD * max(1.0, size / PERIOD_RANKS))


def steps_between(per_step: float, size: int) -> int:
    """How many step boundaries apart the next exchange comes, from the ranks' time per step (every rank reads the
    same, so every rank computes the same number)."""
    return max(1, min(MAX_EVERY, int(period(size) / per_step))) if per_step > 0 else 1


def point(step: int | None = None) -> None:
    """A step boundary: if any rank was sent SIGTERM, run the hooks on every rank and raise Preempted.

    Every rank must call it at the same steps (every k-th call holds one collective)."""
    EXCHANGE.countdown -= 1
    if EXCHANGE.countdown > 0:
        return
    _act(*_exchange(start_next=True), step)


def reset() -> None:
    """Forget the exchange in flight and exchange at the next point (the world was rebuilt: every rank
    starts counting afresh, whatever point each had reached when the old world broke)."""
    EXCHANGE.clear()
    EXCHANGE.of, EXCHANGE.index = None, 0  # the world left: nothing of it is kept (its group, if it had one)
    PREEMPT.resize = False  # asked of the world that was: the new one has its size


def settle(step: int | None = None) -> None:
    """The last boundary of a loop: act on the exchange in flight, start no other."""
    _act(*_exchange(start_next=False), step)


def _exchange(start_next: bool) -> tuple[list[int], bool]:
    """The ranks the previous exchange found signalled, and whether it found a resize asked; then
    (``start_next``) start the next one."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        EXCHANGE.countdown = 1
        return ([0] if asked() else []), bool(PREEMPT.resize)
    from . import flags

    of, now = flags.world(), time.perf_counter()
    if EXCHANGE.of is not of:  # a world rebuilt since: its exchange in flight is dropped, and its count starts afresh
        EXCHANGE.clear()
        EXCHANGE.of, EXCHANGE.index = of, 0
    pending, EXCHANGE.pending = EXCHANGE.pending, None
    said = pending.read() if pending is not None else flags.Said([], 0.0, False)
    every = steps_between(said.per_step, dist.get_world_size())
    if start_next:
        since, calls = EXCHANGE.since, EXCHANGE.calls
        per_step_us = int(1e6 * (now - since) / calls) if since is not None and calls else 0
        EXCHANGE.pending = flags.start(of, EXCHANGE.index, asked(), per_step_us, PREEMPT.resize)
        EXCHANGE.index += 1
        EXCHANGE.since, EXCHANGE.calls, EXCHANGE.countdown = now, every, every
    else:
        EXCHANGE.since, EXCHANGE.calls, EXCHANGE.countdown = None, 0, 1
    return said.signalled, said.resize


def _act(signalled: list[int], resize: bool, step: int | None) -> None:
    if resize and not signalled:
        EXCHANGE.clear()  # the exchange in flight still carries the flag: never read (its index is not said again)
        PREEMPT.resize = False
        raise Resizing(
            f"the world changes size at step {step}: every rank stopped here, and the cell runs again once it has."
        )
    if not signalled:
        return
    saved = _run_hooks(step)
    who = ", ".join(map(str, signalled))
    leaving = "it leaves" if len(signalled) == 1 else "they leave"
    raise Preempted(
        f"rank(s) {who} received SIGTERM (preemption); the save hooks ran on every rank at step {step}"
        f"{' (' + saved + ')' if saved else ''}; {leaving} now. Resume from the checkpoint after a restart."
    )


def _run_hooks(step: int | None) -> str:
    """Run the user's hooks, or the default save; return what the last one returned, as text."""
    out: Any = None
    for hook in HOOKS or DEFAULT[-1:]:
        try:
            out = hook(step)
        except Exception:
            traceback.print_exc(file=sys.__stderr__)
    return str(out) if isinstance(out, str) else ""


def leave() -> None:
    """End this engine the way ipyparallel ends it on SIGTERM (once the cell is over)."""
    if PREEMPT.left:
        return
    PREEMPT.left = True
    previous = PREEMPT.previous
    threading.Timer(3.0, os._exit, args=(143,)).start()  # if the clean stop hangs
    if callable(previous):
        previous(signal.SIGTERM, None)
    else:
        os._exit(143)


def forget_resize() -> None:
    """No grow is coming (lifecycle/grow.py): a loop that never reached a step boundary forgets that one was asked."""
    PREEMPT.resize = False
