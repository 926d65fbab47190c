"""What %dist_equiv records on a rank while a training cell runs (the comparison: nbdist/equivalence.py).

``begin(one=..., steps=...)`` installs torch's global hooks; the cell then runs unchanged; ``end()`` takes them
out and returns the record. Per optimizer step (``Optimizer.step``, caught by torch's global step pre-hook):

- ``rows``: a stable hash of each input row the outermost module's forward received while training (the
  data this rank trained on in the step: compared across ranks and with the one-rank run);
- ``losses``: each one-element tensor ``backward()`` was called on;
- ``grad``/``params``: the gradients the optimizer is about to apply (after DDP's all-reduce), and for the first
  step the weights, as float64 samples at the same evenly spaced positions in every run (all of them up to
  ``SAMPLE``), with the full norm;
- ``lr``: each parameter group's learning rate;
- ``rng``: a hash of torch's CPU random state as the step's first forward began, and whether a forward or the
  code between two steps drew random numbers (dropout, augmentation).

The models seen: BatchNorm layers that keep statistics per rank (not SyncBatchNorm) and dropout layers.
``one=True`` runs the cell in a world of one rank on this rank (compat.world_of_one) with RANK/WORLD_SIZE to
match. After ``steps`` steps the next ``Optimizer.step`` ends the cell on this rank (``Enough``, a SystemExit:
the rank stays up, engine/exits.py), so a long training loop costs only the steps compared.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from typing import Any

from .. import compat

SAMPLE = 65_536  # gradient and weight values kept per step (evenly spaced over all of them)
ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


class Enough(SystemExit):
    """The steps %dist_equiv compares are recorded: the rest of the cell is skipped on this rank."""

    def __init__(self, steps: int) -> None:
        super().__init__(0)
        self.steps = steps

    def __str__(self) -> str:
        return f"nbdist: %dist_equiv recorded the {self.steps} steps it compares; the rest of the cell is skipped"


def _hash(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def _rng() -> int:
    import torch

    return _hash(torch.get_rng_state().numpy().tobytes())


def _first_tensor(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    for item in items:
        found = _first_tensor(item)
        if found is not None:
            return found
    return None


def _rows(x: Any) -> list[int]:
    """A hash per row of the batch (its first dimension), from the row's values."""
    if x.dim() == 0:
        return []
    data = x.detach().reshape(x.shape[0], -1).cpu().contiguous().numpy()
    return [_hash(row.tobytes()) for row in data]


def _sample(tensors: list[Any]) -> tuple[list[float], float, str]:
    """Evenly spaced float64 values over the tensors laid end to end, their norm, and their dtype."""
    import torch

    if not tensors:
        return [], 0.0, ""
    flat = torch.cat([t.detach().reshape(-1).to("cpu", torch.float64) for t in tensors])
    if flat.numel() > SAMPLE:
        flat_all, flat = flat, flat[torch.linspace(0, flat.numel() - 1, SAMPLE).long()]
        norm = float(flat_all.norm())
    else:
        norm = float(flat.norm())
    return flat.tolist(), norm, str(tensors[0].dtype).replace("torch.", "")


class Recorder:
    def __init__(self, steps: int) -> None:
        import torch
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self.limit = steps
        self.steps: list[dict[str, Any]] = []
        self.depth = 0
        self.rng_in: int | None = None
        self.last_rng = _rng()  # random draws between two steps show as a change from this
        self.batchnorm: set[str] = set()
        self.syncbn = 0
        self.dropout: set[str] = set()
        self.seen: set[int] = set()
        self.cur = self._fresh()
        nn = torch.nn.modules.module
        self.handles = [
            nn.register_module_forward_pre_hook(self._pre),
            nn.register_module_forward_hook(self._post, always_call=True),
            register_optimizer_step_pre_hook(self._step),
        ]
        self.backward = torch.Tensor.backward
        recorder = self

        def backward(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if tensor.numel() == 1:
                recorder.cur["losses"].append(float(tensor.detach()))
            return recorder.backward(tensor, *args, **kwargs)

        torch.Tensor.backward = backward  # type: ignore[method-assign,assignment]

    @staticmethod
    def _fresh() -> dict[str, Any]:
        return {"rows": [], "losses": [], "rng": None, "random": False}

    def _pre(self, module: Any, args: Any) -> None:
        import torch

        if self.depth == 0 and module.training and torch.is_grad_enabled():
            x = _first_tensor(args)
            if x is not None:
                self.cur["rows"] += _rows(x)
            now = _rng()
            if self.cur["rng"] is None:
                self.cur["rng"] = now
                self.cur["random"] = self.cur["random"] or now != self.last_rng
            self.rng_in = now
            self._look(module)
        self.depth += 1

    def _post(self, module: Any, args: Any, output: Any) -> None:
        self.depth = max(0, self.depth - 1)
        if self.depth == 0 and self.rng_in is not None:
            self.cur["random"] = self.cur["random"] or _rng() != self.rng_in
            self.rng_in = None

    def _look(self, model: Any) -> None:
        import torch
        from torch import nn

        BATCHNORM = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)  # noqa: N806
        DROPOUT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)  # noqa: N806
        if id(model) in self.seen:
            return
        self.seen.add(id(model))
        shared: list[str] = []  # layers that normalise over the world's rows (parallel/syncbn.py)
        for name, m in model.named_modules():
            if getattr(m, "world_statistics", False):
                shared.append(name + ".")
            if isinstance(m, torch.nn.SyncBatchNorm) or getattr(m, "world_statistics", False):
                self.syncbn += 1
            elif any(name.startswith(prefix) for prefix in shared):
                continue
            elif isinstance(m, BATCHNORM) and m.training:
                self.batchnorm.add(f"{name or type(model).__name__} ({type(m).__name__})")
            elif isinstance(m, DROPOUT) and m.p > 0:
                self.dropout.add(f"{name} ({type(m).__name__}, p={m.p})")

    def _step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if len(self.steps) >= self.limit:
            raise Enough(self.limit)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        with_grad = [p for p in params if p.grad is not None]
        grad, grad_norm, dtype = _sample([p.grad for p in with_grad])
        record = {
            **self.cur,
            "lr": [float(group.get("lr", 0.0)) for group in optimizer.param_groups],
            "grad": grad,
            "grad_norm": grad_norm,
            "dtype": dtype,
        }
        if not self.steps:
            record["params"], record["params_norm"], _ = _sample(params)
        self.steps.append(record)
        self.cur = self._fresh()
        self.last_rng = _rng()

    def close(self) -> dict[str, Any]:
        import torch

        for handle in self.handles:
            handle.remove()
        torch.Tensor.backward = self.backward  # type: ignore[method-assign]
        return {
            "steps": self.steps,
            "batchnorm": sorted(self.batchnorm),
            "syncbn": self.syncbn,
            "dropout": sorted(self.dropout),
        }


_ACTIVE: dict[str, Any] = {}


def begin(one: bool, steps: int) -> None:
    """Record the next cell on this rank; ``one``: run it in a world of one rank."""
    end()  # a begin without its end (the kernel went away between them)
    stack = contextlib.ExitStack()
    if one:
        saved = {k: os.environ.get(k) for k in ENV}
        stack.callback(_restore_env, saved)
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        stack.enter_context(compat.world_of_one())
    _ACTIVE.update(stack=stack, recorder=Recorder(steps), one=one)


def end() -> dict[str, Any] | None:
    """Stop recording (and leave the world of one); this rank's record, or None when nothing was recorded."""
    import torch.distributed as dist

    if not _ACTIVE:
        return None
    recorder, stack, one = _ACTIVE.pop("recorder"), _ACTIVE.pop("stack"), _ACTIVE.pop("one")
    try:
        record = recorder.close()
        record.update(one=one, rank=dist.get_rank() if dist.is_initialized() else 0)
        record["world_size"] = dist.get_world_size() if dist.is_initialized() else 1
    finally:
        stack.close()
    return record


def _restore_env(saved: dict[str, str | None]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
