"""A rank's own part (what ``ckpt_rank`` keeps per rank: RNG states, loaders' positions, buffers, ``extra=``),
taken and turned into bytes fast enough to do twice a step (parallel/peer.py).

``torch.save`` and ``torch.load`` cost about 0.6 and 0.4 ms for these 20 KB, as much as the small
models' whole step; the tensors here are flat bytes instead (dtype and shape beside them), and the
rest is plain values, so ``pickle`` takes about 10 us. ``decode`` gives the tensors back.
"""

from __future__ import annotations

import pickle
import random
import sys
from typing import Any

import torch


def take(loaders: dict[str, Any], models: dict[str, Any], extra: dict | None, step: int, passes: int) -> bytes:
    """This rank's own part now, as bytes: the positions of ``loaders`` and the buffers of ``models``, by name,
    ``step``, the loop's step (of the loader it runs over), and the ``passes`` over it the running cell finished."""
    rng: dict[str, Any] = {"torch": _raw(torch.get_rng_state()), "random": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = [_raw(s) for s in torch.cuda.get_rng_state_all()]
    np = sys.modules.get("numpy")
    if np is not None:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        rng["numpy"] = (kind, keys.tobytes(), pos, has_gauss, gauss)
    positions = {}
    for name, loader in loaders.items():
        position = dict(loader.state_dict())
        if isinstance(position.get("epoch_rng"), torch.Tensor):
            position["epoch_rng"] = _raw(position["epoch_rng"])
        positions[name] = position
    buffers = {key: {name: _raw(b) for name, b in model.named_buffers()} for key, model in models.items()}
    part = {"rng": rng, "loaders": positions, "buffers": buffers, "extra": extra, "step": step, "passes": passes}
    return pickle.dumps(part, protocol=pickle.HIGHEST_PROTOCOL)


def step_of(data: bytes) -> tuple[int, int]:
    """The loop step the part goes on from, and the passes over its loader the running cell had finished."""
    part = pickle.loads(data)
    return int(part["step"]), int(part["passes"])


def with_extra(data: bytes, extra: dict | None) -> bytes:
    part = pickle.loads(data)
    part["extra"] = extra
    return pickle.dumps(part, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> dict[str, Any]:
    """The part with its tensors back: ``rng`` as ``ckpt_rank.set_rng_states`` takes it, ``loaders`` (by name),
    ``buffers`` (by model), ``extra`` and ``step``."""
    part = pickle.loads(data)
    rng = dict(part["rng"])
    rng["torch"] = _tensor(rng["torch"])
    if "cuda" in rng:
        rng["cuda"] = [_tensor(s) for s in rng["cuda"]]
    if "numpy" in rng:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = rng["numpy"]
        rng["numpy"] = (
            kind,
            torch.from_numpy(np.frombuffer(keys, dtype=np.uint32).astype(np.int64)),
            pos,
            has_gauss,
            gauss,
        )
    loaders = {
        name: dict(p, epoch_rng=_tensor(p["epoch_rng"])) if isinstance(p.get("epoch_rng"), tuple) else p
        for name, p in part["loaders"].items()
    }
    buffers = {key: {name: _tensor(raw) for name, raw in mine.items()} for key, mine in part["buffers"].items()}
    return {"rng": rng, "loaders": loaders, "buffers": buffers, "extra": part["extra"], "step": part["step"]}


def _raw(t: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return str(flat.dtype).removeprefix("torch."), tuple(t.shape), flat.view(torch.uint8).numpy().tobytes()


def _tensor(raw: tuple[str, tuple[int, ...], bytes]) -> torch.Tensor:
    dtype, shape, data = raw
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return flat.view(getattr(torch, dtype)).reshape(shape).clone()
