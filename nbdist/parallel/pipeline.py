"""Pipeline parallelism with torch.distributed.pipelining: one stage per rank, GPipe or 1F1B."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..config import did_you_mean
from ..errors import ConfigError
from .ddp import device

SCHEDULES = ("gpipe", "1f1b")


def split_sequential(model: torch.nn.Sequential, num_stages: int | None = None) -> list[torch.nn.Sequential]:
    """Split a Sequential into num_stages contiguous parts with layer counts as even as possible."""
    num_stages = num_stages or dist.get_world_size()
    layers = list(model)
    if len(layers) < num_stages:
        raise ConfigError(f"the model has {len(layers)} layers, fewer than {num_stages} stages; use fewer ranks.")
    base, extra = divmod(len(layers), num_stages)
    parts, start = [], 0
    for s in range(num_stages):
        size = base + (1 if s < extra else 0)
        parts.append(torch.nn.Sequential(*layers[start : start + size]))
        start += size
    return parts


def make_schedule(
    model: torch.nn.Sequential, n_microbatches: int, loss_fn: Any, schedule: str = "gpipe"
) -> tuple[Any, torch.nn.Module]:
    """This rank's stage of ``model`` and a schedule to run it; returns (schedule, stage module)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    if schedule not in SCHEDULES:
        raise ConfigError(f"schedule {schedule!r} is not known; {did_you_mean(schedule, SCHEDULES)}")
    rank, world = dist.get_rank(), dist.get_world_size()
    part = split_sequential(model, world)[rank].to(device())
    stage = PipelineStage(part, stage_index=rank, num_stages=world, device=device())
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    return cls(stage, n_microbatches=n_microbatches, loss_fn=loss_fn), part


def pipeline_step(sched: Any, x: torch.Tensor, y: torch.Tensor) -> float | None:
    """One forward+backward over all micro-batches; the mean micro-batch loss on the last stage."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        sched.step(x.to(device()))
        return None
    if rank == world - 1:
        losses: list[torch.Tensor] = []
        sched.step(target=y.to(device()), losses=losses)
        return float(torch.stack(losses).mean().item())
    sched.step()
    return None


def bubble_fraction(num_stages: int, n_microbatches: int) -> float:
    """The idle share of a GPipe/1F1B step in theory: (p - 1) / (m + p - 1)."""
    return (num_stages - 1) / (n_microbatches + num_stages - 1)
