"""Gradient compression as DDP communication hooks.

``kernels`` (Numba; numpy in and out, no torch), ``compressors`` (the pure compress and
decompress steps), ``hooks`` (the DDP hooks and their state). ``make_hook("topk:0.01")``
builds a (hook, state) pair from a short spec; ``apply_ddp(model, compression=...)`` uses it.
"""

from __future__ import annotations

from typing import Any

from ..config import did_you_mean
from ..errors import ConfigError
from .base import REGISTRY
from .compressors import DGC, Cast, Identity, RandomK, TopK  # noqa: F401  (they register)
from .quantizers import QSGD, Sign  # noqa: F401

__all__ = ["NAMES", "make_hook"]

HOOKS = ("powersgd",)  # names served by a hook of their own (torch's PowerSGD), not a Compressor
NAMES = (*REGISTRY, *HOOKS)


def parse(spec: str) -> tuple[str, str | None]:
    """'topk:0.01' -> ('topk', '0.01')."""
    name, _, arg = spec.partition(":")
    return name.strip().lower(), (arg.strip() or None)


def make_hook(spec: str, *, process_group: Any = None, start_iter: int = 2, seed: int = 0) -> tuple[Any, Any]:
    """(hook, state) for a spec such as 'none', 'fp16', 'bf16', 'topk:0.01', 'randomk:0.01',
    'qsgd:127', 'signsgd' (EF), 'signsgd:noef', 'powersgd:2', 'dgc:0.01' (top-k with momentum
    correction, momentum 0.9; 'dgc:0.01:0.95' sets it: train with SGD *without* momentum).
    Each name is a Compressor class's ``spec_names`` (``base.REGISTRY``), which parses its own parameter."""
    from .base import spec_number
    from .hooks import HookState, PowerSGDHookState, compression_hook, powersgd_hook

    name, arg = parse(spec)
    if name == "powersgd":
        rank = spec_number(name, arg, 2, int)
        return powersgd_hook, PowerSGDHookState(rank=rank, start_iter=start_iter, process_group=process_group)
    if name not in REGISTRY:
        raise ConfigError(f"compression {name!r} is not known; {did_you_mean(name, NAMES)}")
    comp = REGISTRY[name].from_spec(name, arg)
    return compression_hook, HookState(comp, start_iter=start_iter, seed=seed, process_group=process_group)
