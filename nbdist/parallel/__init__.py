"""Helpers called inside %%distributed cells: thin over PyTorch's own APIs.

Each one removes boilerplate or a common mistake and otherwise stays out of the way,
so the notebooks teach real torch code.
"""

from __future__ import annotations

from ..engine.preempt import Preempted
from ..engine.preempt import point as preemption_point
from .checkpoint import latest_step, load_checkpoint, save_checkpoint
from .data import ShardedLoader, shard
from .ddp import accumulate, apply_ddp, autocast, device, grad_scaler, scale_lr
from .fsdp import apply_fsdp, memory_report, mesh_1d
from .metrics import all_reduce_mean, all_reduce_sum, gather_values
from .pipeline import bubble_fraction, make_schedule, pipeline_step, split_sequential
from .profiling import profile, trace_links
from .syncbn import sync_batchnorm
from .tensor import ColumnParallelLinear, RowParallelLinear

__all__ = [
    "ColumnParallelLinear",
    "Preempted",
    "preemption_point",
    "RowParallelLinear",
    "apply_fsdp",
    "bubble_fraction",
    "make_schedule",
    "memory_report",
    "mesh_1d",
    "pipeline_step",
    "sync_batchnorm",
    "profile",
    "trace_links",
    "split_sequential",
    "ShardedLoader",
    "accumulate",
    "all_reduce_mean",
    "all_reduce_sum",
    "apply_ddp",
    "autocast",
    "device",
    "gather_values",
    "grad_scaler",
    "latest_step",
    "load_checkpoint",
    "save_checkpoint",
    "scale_lr",
    "shard",
]
