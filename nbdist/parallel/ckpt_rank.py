"""The part of a checkpoint that differs from rank to rank: ``rank-N.pt`` beside the DCP files.

- **RNG states** (torch, CUDA once initialised, numpy when imported, random): dropout masks and
  shuffles continue as they would have;
- **the loader's position** (a ShardedLoader: epoch, batch, the RNG its epoch began with);
- **the model's buffers, this rank's own.** They are not replicated the way parameters are:
  under DDP each rank's BatchNorm updates its running statistics from its own batch after DDP
  broadcast rank 0's at the start of the forward, so at a step boundary the ranks hold different
  values. DCP saves a replicated tensor once, from whichever rank its planner picks (the planner
  spreads the writes over the ranks), and every rank loads that one copy: each rank would resume
  with another rank's statistics, or a mix;
- the world size, the step, and ``extra``: plain values, read back by ``load_checkpoint(extra=)``.

The ``state=`` objects (a scheduler, a GradScaler, an EMA model) go through DCP with the model and
the optimizer, so the same holds for them: a tensor inside one that differs from rank to rank comes
back from one rank. The usual ones are the same on every rank; the model's buffers are kept here.

Loaded with ``torch.load(weights_only=True)``, so a checkpoint never runs code; that is why
``extra`` holds plain values only.
"""

from __future__ import annotations

import os
import random
import sys
from typing import Any

import torch

from ..errors import ConfigError

PLAIN = (int, float, str, bool, type(None), torch.Tensor)


def check_plain(extra: dict, where: str = "extra") -> None:
    """Raise ConfigError naming the first value of ``extra`` that is not a plain value."""
    for key, value in extra.items():
        _check(value, f"{where}[{key!r}]")


def _check(value: Any, where: str) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            _check(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check(item, f"{where}[{i}]")
    elif not isinstance(value, PLAIN):
        raise ConfigError(
            f"{where} (a {type(value).__name__}) is not a plain value (numbers, text, tensors, lists and dicts of "
            "them); pass objects with state_dict()/load_state_dict() in state= instead."
        )


def save(directory: str, rank: int, model: torch.nn.Module, loader: Any, step: int, extra: dict) -> None:
    world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    own = {
        "rng": rng_states(),
        "loader": loader.state_dict() if loader is not None else None,
        "buffers": {name: b.detach().to("cpu", copy=True) for name, b in model.named_buffers()},
        "world_size": world_size,
        "step": step,
        "extra": extra,
    }
    torch.save(own, os.path.join(directory, f"rank-{rank}.pt"))


def load(
    directory: str, rank: int, world_size: int, per_rank: bool, saved_as: int | None = None
) -> dict[str, Any] | None:
    """This rank's part (``per_rank``), or only rank 0's ``extra``; ConfigError when it is missing,
    unreadable, or from a world of another size. ``saved_as``: the part this process saved under another
    rank number, in a world of another size (one that went on with fewer ranks): read as it is."""
    if saved_as is not None and per_rank:
        rank = saved_as
    name = f"rank-{rank}.pt" if per_rank else "rank-0.pt"
    file = os.path.join(directory, name)
    if not os.path.exists(file):
        if not os.path.exists(os.path.join(directory, "rank-0.pt")):
            return None  # a checkpoint saved without the per-rank part (DCP files only)
        saved = _read(os.path.join(directory, "rank-0.pt")).get("world_size")
        if saved == world_size:
            raise ConfigError(
                f"{directory} has no {name} although a world of {saved} rank(s) saved it: that checkpoint is "
                "damaged; load another step (load_checkpoint(path, ..., step=N))."
            )
        raise ConfigError(
            f"{directory} has no {name}: it was saved by a world of {saved} rank(s), and this one has {world_size}. "
            f"Start %dist_start -n {saved}, or pass per_rank=False to load all but the per-rank part "
            "(RNG states, loader position, buffers)."
        )
    own = _read(file)
    saved = own.get("world_size")
    if per_rank and saved_as is None and saved is not None and saved != world_size:
        raise ConfigError(
            f"{directory} was saved by a world of {saved} rank(s), and this one has {world_size}: its RNG states, "
            f"loader positions and buffers are per rank. Start %dist_start -n {saved}, or pass per_rank=False to "
            "load all but those."
        )
    return own if per_rank else {"extra": own.get("extra")}


def _read(file: str) -> dict[str, Any]:
    try:
        return torch.load(file, weights_only=True)
    except Exception as exc:
        first = next((ln for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
        raise ConfigError(
            f"{file} is unreadable ({first[:200]}): that checkpoint is damaged; load another step "
            f"(load_checkpoint(path, ..., step=N))."
        ) from None


def put_back_own(own: dict[str, Any], model: torch.nn.Module, loader: Any) -> None:
    """Put this rank's part back: RNG states, buffers, the loader's position (what the file has)."""
    if own.get("rng") is not None:
        set_rng_states(own["rng"])
    buffers = own.get("buffers") or {}
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in buffers:
                buffer.copy_(buffers[name])
    if loader is not None and own.get("loader") is not None:
        loader.load_state_dict(own["loader"])


def rng_states() -> dict[str, Any]:
    """This process's random states: torch (CPU, and CUDA once initialised), numpy (when imported), random."""
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "random": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        out["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss)  # loadable weights_only
    return out


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["random"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    if "numpy" in states:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = states["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss))
