"""Metric sync across ranks. gloo has no ReduceOp.AVG, so the mean is a sum divided by the world size."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _as_tensor(value: Any) -> tuple[torch.Tensor, bool]:
    if isinstance(value, torch.Tensor):
        return value.detach().clone().float(), True
    return torch.tensor(float(value)), False


def all_reduce_sum(value: Any) -> Any:
    """Sum over ranks; returns the same kind it was given (float or tensor)."""
    t, was_tensor = _as_tensor(value)
    if dist.is_initialized() and dist.get_world_size() > 1:
        if dist.get_backend() == "nccl" and t.device.type == "cpu":
            t = t.cuda()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t if was_tensor else t.item()


def all_reduce_mean(value: Any) -> Any:
    """Mean over ranks (works on gloo, which lacks ReduceOp.AVG)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    total = all_reduce_sum(value)
    return total / world


def gather_values(value: Any) -> list[Any]:
    """Every rank's value of a small Python object, in rank order, on every rank."""
    if not dist.is_initialized():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out
