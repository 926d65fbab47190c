"""Gradient compression as DDP communication hooks.

``kernels`` (Numba; numpy in and out, no torch), ``compressors`` (the pure compress and
decompress steps), ``hooks`` (the DDP hooks and their state). ``make_hook("topk:0.01")``
builds a (hook, state) pair from a short spec; ``apply_ddp(model, compression=...)`` uses it.
"""

from __future__ import annotations

from typing import Any

import torch

from ..config import did_you_mean
from ..errors import ConfigError
from .compressors import DGC, NAMES, QSGD, Cast, Identity, RandomK, Sign, TopK, parse

__all__ = ["NAMES", "make_hook"]


def _number(name: str, arg: str | None, default: float, kind: type = float) -> Any:
    if arg is None:
        return kind(default)
    try:
        return kind(arg)
    except ValueError:
        raise ConfigError(f"{name}:{arg} has a parameter that is not a number; write e.g. {name}:{default}.") from None


def make_hook(spec: str, *, process_group: Any = None, start_iter: int = 2, seed: int = 0) -> tuple[Any, Any]:
    """(hook, state) for a spec such as 'none', 'fp16', 'bf16', 'topk:0.01', 'randomk:0.01',
    'qsgd:127', 'signsgd' (EF), 'signsgd:noef', 'powersgd:2', 'dgc:0.01' (top-k with momentum
    correction, momentum 0.9; 'dgc:0.01:0.95' sets it: train with SGD *without* momentum)."""
    from .hooks import HookState, PowerSGDHookState, compression_hook, powersgd_hook

    name, arg = parse(spec)
    if name not in NAMES:
        raise ConfigError(f"compression {name!r} is not known; {did_you_mean(name, NAMES)}")
    if name == "powersgd":
        rank = _number(name, arg, 2, int)
        return powersgd_hook, PowerSGDHookState(rank=rank, start_iter=start_iter, process_group=process_group)
    if name == "dgc":
        ratio_arg, _, momentum_arg = (arg or "").partition(":")
        ratio = _number(name, ratio_arg or None, 0.01)
        momentum = _number(name, momentum_arg or None, 0.9)
        if not 0 < ratio <= 1 or not 0 <= momentum < 1:
            raise ConfigError(
                f"dgc:{arg} needs a ratio in (0, 1] and a momentum in [0, 1); e.g. dgc:0.01 "
                "(1%, momentum 0.9) or dgc:0.01:0.95."
            )
        comp: Any = DGC(ratio, momentum)
    elif name in ("topk", "randomk"):
        ratio = _number(name, arg, 0.01)
        if not 0 < ratio <= 1:
            raise ConfigError(f"{name} ratio ({ratio}) must be in (0, 1]; e.g. {name}:0.01 keeps 1%.")
        comp = TopK(ratio) if name == "topk" else RandomK(ratio)
    elif name == "qsgd":
        levels = _number(name, arg, 127, int)
        if not 1 <= levels <= 127:
            raise ConfigError(f"qsgd levels ({levels}) must be 1..127 to fit in int8; e.g. qsgd:127.")
        comp = QSGD(levels)
    elif name == "signsgd":
        if arg not in (None, "ef", "noef"):
            raise ConfigError(f"signsgd takes 'ef' or 'noef', not {arg!r}; e.g. signsgd (with error feedback).")
        comp = Sign(error_feedback=arg != "noef")
    elif name in ("fp16", "bf16"):
        comp = Cast(torch.float16 if name == "fp16" else torch.bfloat16)
    else:
        comp = Identity()
    return compression_hook, HookState(comp, start_iter=start_iter, seed=seed, process_group=process_group)
