"""DDP in one call, plus the three habits the guides teach with it: LR scaling,
gradient accumulation without needless all-reduces, and mixed precision."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ..config import did_you_mean
from ..errors import ConfigError


def device() -> torch.device:
    """This rank's device: under nccl the GPU nbdist bound it to (``torch.cuda.current_device()``:
    LOCAL_RANK, or 0 when the launcher gave the task one GPU of its own); else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def apply_ddp(
    model: torch.nn.Module,
    *,
    find_unused_parameters: bool = False,
    bucket_cap_mb: float | None = 25.0,
    comm_hook: Any = None,
    hook_state: Any = None,
    compression: str | None = None,
    metrics: bool = True,
    **ddp_kwargs: Any,
) -> DDP:
    """Move ``model`` to this rank's device and wrap it in DistributedDataParallel.

    DDP broadcasts rank 0's parameters at construction, so every replica starts equal.
    ``bucket_cap_mb`` is passed to DDP as given, which also turns off DDP's smaller first
    bucket (1 MB): a model under 25 MB is one bucket, reduced once backward ends (the fastest
    here, with ranks sharing cores; see notebook 01). ``bucket_cap_mb=None`` gives DDP's own
    bucketing, whose first bucket's reduction overlaps the rest of backward.
    ``comm_hook`` (with ``hook_state``) is registered with ``register_comm_hook``;
    or name a compressor, ``compression="topk:0.01"`` (see nbdist.compression.make_hook).
    The hook's state, with its byte and time records, is then ``model.compression_state``.
    With ``metrics=True`` every training step logs its time, time in collectives,
    bytes and samples/s through ``nbdist.log`` (see nbdist.parallel.instrument), which
    the notebook's dashboard plots live.
    """
    if compression is not None:
        if comm_hook is not None:
            raise ConfigError("pass either compression= or comm_hook=, not both.")
        from ..compression import make_hook

        # the hook talks to DDP's own group (a subgroup, or one row of a mesh), not to every rank
        comm_hook, hook_state = make_hook(compression, process_group=ddp_kwargs.get("process_group"))
    if not dist.is_initialized():
        raise ConfigError("apply_ddp needs a process group; run it in a %%distributed cell after %dist_start.")
    if dist.get_debug_level() == dist.DebugLevel.DETAIL and dist.get_backend() == "gloo":
        raise ConfigError(
            "DDP crashes the rank (a segfault in DDP's logger, torch 2.13) when the gloo world checks collectives "
            "(--debug-collectives, TORCH_DISTRIBUTED_DEBUG=DETAIL); debug the collectives without DDP, or "
            "%dist_start again without --debug-collectives."
        )
    dev = device()
    model = model.to(dev)
    ids = [dev.index] if dev.type == "cuda" else None
    wrapped = DDP(
        model,
        device_ids=ids,
        find_unused_parameters=find_unused_parameters,
        bucket_cap_mb=bucket_cap_mb,
        **ddp_kwargs,
    )
    if comm_hook is not None:
        wrapped.register_comm_hook(hook_state, comm_hook)
        wrapped.compression_state = hook_state
    if metrics:
        from .instrument import instrument

        instrument(wrapped, hook_registered=comm_hook is not None, hook_state=hook_state if compression else None)
    return wrapped


def scale_lr(base_lr: float, world_size: int | None = None, rule: str = "linear") -> float:
    """The learning rate for a global batch world_size times larger.

    ``linear`` (Goyal et al. 2017) multiplies by the world size; ``sqrt`` by its square
    root, gentler for adaptive optimizers. Warm up when the factor is large.
    """
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_initialized() else 1
    rules = ("linear", "sqrt", "none")
    if rule not in rules:
        raise ConfigError(f"rule {rule!r} is not known; {did_you_mean(rule, rules)}")
    if rule == "linear":
        return base_lr * world_size
    if rule == "sqrt":
        return base_lr * math.sqrt(world_size)
    return base_lr


@contextlib.contextmanager
def accumulate(model: torch.nn.Module, step: int, every: int) -> Iterator[bool]:
    """Accumulate gradients over ``every`` micro-batches; all-reduce only on the last.

    Yields True on the micro-batch after which the optimizer should step. Inside
    the other micro-batches DDP's ``no_sync`` skips the gradient all-reduce.
    """
    if every < 1:
        raise ConfigError(f"every ({every}) must be at least 1 micro-batch.")
    last = (step + 1) % every == 0
    if last or not isinstance(model, DDP):
        yield last
    else:
        with model.no_sync():
            yield last


def autocast(enabled: bool = True, dtype: torch.dtype | None = None) -> Any:
    """Mixed precision for this rank's device: bf16 on CPU, fp16 on CUDA (pair it with a GradScaler)."""
    dev = device()
    if dtype is None:
        dtype = torch.float16 if dev.type == "cuda" else torch.bfloat16
    return torch.autocast(device_type=dev.type, dtype=dtype, enabled=enabled)


def grad_scaler(enabled: bool = True) -> Any:
    """A GradScaler for fp16 on CUDA; on CPU (bf16 needs none) a disabled one, so the same loop runs everywhere."""
    dev = device()
    return torch.amp.GradScaler(dev.type, enabled=enabled and dev.type == "cuda")
