"""torch's private names nbdist relies on (process groups, DDP's logger and timers, FSDP2's collectives)."""

from __future__ import annotations

from typing import Any


def group_sequence_number(group: Any) -> int:
    """How many collectives this process group has issued (its sequence number), C++ callers included."""
    return int(group._get_sequence_number_for_group())


def abort_process_group() -> None:
    """Abort the default process group (NCCL): collectives blocked on it return with an error."""
    import torch.distributed as dist

    dist.distributed_c10d._abort_process_group()


def ddp_time_every_step(model: Any) -> Any:
    """Have DDP's reducer time every step's gradient reduction; return DDP's C++ logger."""
    model._set_ddp_runtime_logging_sample_rate(1)
    return model.logger


def ddp_timers(logger: Any) -> dict[str, int]:
    """DDP's timers for the last step (nanoseconds): backward_comm_time, *_start, *_end, ..."""
    logger.set_runtime_stats_and_log()  # what DDP's next forward would do; idempotent
    return dict(logger._get_ddp_logging_data().ints_map)


def fsdp_collective_classes() -> tuple[type, type]:
    """FSDP2's default all-gather and reduce-scatter callables (subclassed to time them)."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    return DefaultAllGather, DefaultReduceScatter
