"""Preemption on a rank: SIGTERM runs the save hooks on every rank at the same step, then the rank leaves.

Slurm preemption, ``scancel --signal=TERM`` and a Kubernetes eviction all send SIGTERM,
and kill for good some seconds later. Saving from inside the signal handler is unsafe:
the ranks are at different points of a step and the save's own collectives would pair
with the training's. So the handler only takes note, and the ranks agree at a step
boundary (``point``, which ``ShardedLoader.steps`` calls once per step) to run the hooks
together and end the cell with ``Preempted``. The ranks that were signalled then leave;
the others stay for ``--max-restarts`` or ``%dist_restart``.

The agreement costs the step nothing it waits for: each point starts an all_reduce of one
flag per rank without waiting (``async_op``) on nbdist's own gloo group
(``world.control_group``: on the CPU, beside the training's collectives, never a GPU
synchronisation), and reads the one the previous point started, which finished during
the step. Every rank reads the same exchange at the same point, so every rank acts at the
same step: the step after the one during which the signal came. ``settle`` (the end of a
``steps()`` loop) reads the last exchange without starting another.

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
from typing import Any

from .state import STATE

Hook = Callable[[int | None], Any]  # hook(step): the step the ranks agreed on, None when idle
HOOKS: list[Hook] = []
DEFAULT: list[Hook] = []  # save_checkpoint registers "save again at this step" here
PREEMPT: dict[str, Any] = {"asked": None, "installed": False, "previous": None, "grace": 25.0, "left": False}
EXCHANGE: dict[str, Any] = {"work": None, "flags": None, "group": None}  # the flag all_reduce in flight


class Preempted(RuntimeError):
    """The world is going down: a rank received SIGTERM; the save hooks ran on every rank."""


def on_preempt(fn: Hook | None = None, *, grace: float | None = None) -> Any:
    """Run ``fn(step)`` on every rank when any rank receives SIGTERM (usable as a decorator).

    Without hooks of its own a rank saves again through the last ``save_checkpoint`` call
    (same path, model, optimizer and loader) at the agreed step. ``grace``: seconds from
    the signal until the rank leaves regardless (default 25; Slurm's KillWait is 30).
    """
    if grace is not None:
        if grace <= 0:
            raise ValueError(f"grace ({grace!r}) must be positive seconds, such as 25.")
        PREEMPT["grace"] = float(grace)
    install()
    if fn is None:
        return lambda f: on_preempt(f)
    if fn not in HOOKS:
        HOOKS.append(fn)
    return fn


def install() -> None:
    """Take SIGTERM over from ipyparallel's engine (whose handler stops it; it is called at the end)."""
    if PREEMPT["installed"] or threading.current_thread() is not threading.main_thread():
        return
    PREEMPT["previous"] = signal.signal(signal.SIGTERM, _on_sigterm)
    PREEMPT["installed"] = True


def _on_sigterm(signum: int, frame: Any) -> None:
    if PREEMPT["asked"] is not None:
        return
    PREEMPT["asked"] = time.time()
    threading.Thread(target=_deadline, name="nbdist-preempt", daemon=True).start()
    if STATE.get("busy_since") is None:  # no cell: save now, then go
        _run_hooks(None)
        leave()


def _deadline() -> None:
    time.sleep(PREEMPT["grace"])
    print(
        f"nbdist: SIGTERM {PREEMPT['grace']:.0f} s ago and the hooks have not finished; leaving.", file=sys.__stderr__
    )
    os._exit(143)


def asked() -> bool:
    return PREEMPT["asked"] is not None


def point(step: int | None = None) -> None:
    """A step boundary: if any rank was sent SIGTERM, run the hooks on every rank and raise Preempted.

    Every rank must call it at the same steps (it holds one collective)."""
    _act(_exchange(start_next=True), step)


def settle(step: int | None = None) -> None:
    """The last boundary of a loop: act on the exchange in flight, start no other."""
    _act(_exchange(start_next=False), step)


def _exchange(start_next: bool) -> list[int]:
    """The ranks the previous exchange found signalled; then (``start_next``) start the next one."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [0] if asked() else []
    from .world import control_group

    group = control_group("preempt")
    signalled: list[int] = []
    work, flags, of = EXCHANGE["work"], EXCHANGE["flags"], EXCHANGE["group"]
    EXCHANGE.update(work=None, flags=None, group=None)
    if work is not None and of is group:  # an exchange of another world (rebuilt since) is dropped
        work.wait()
        signalled = [r for r, f in enumerate(flags.tolist()) if f]
    if start_next:
        flags = torch.zeros(dist.get_world_size(), dtype=torch.int32)
        flags[dist.get_rank()] = int(asked())
        EXCHANGE.update(work=dist.all_reduce(flags, group=group, async_op=True), flags=flags, group=group)
    return signalled


def _act(signalled: list[int], step: int | None) -> None:
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
    if PREEMPT["left"]:
        return
    PREEMPT["left"] = True
    previous = PREEMPT["previous"]
    threading.Timer(3.0, os._exit, args=(143,)).start()  # if the clean stop hangs
    if callable(previous):
        previous(signal.SIGTERM, None)
    else:
        os._exit(143)
