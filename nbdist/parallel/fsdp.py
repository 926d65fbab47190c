"""FSDP2 (``fully_shard`` over a DeviceMesh) per block, and a per-rank memory report to compare with DDP."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ConfigError
from .ddp import device


def mesh_1d() -> Any:
    """A 1-D DeviceMesh over every rank, on this rank's device type."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device().type, (dist.get_world_size(),))


def apply_fsdp(
    model: torch.nn.Module,
    *,
    blocks: Iterable[torch.nn.Module] | type | None = None,
    mesh: Any = None,
    reshard_after_forward: bool = True,
    mp_policy: Any = None,
    metrics: bool = True,
) -> torch.nn.Module:
    """Shard ``model`` with FSDP2: each block first, then the root.

    ``blocks`` is a list of submodules or a module class (every instance is a block);
    by default every direct child that has parameters. Sharding per block lets FSDP
    gather one block's parameters at a time instead of the whole model. With
    ``metrics=True`` every training step logs its time, time in FSDP's all-gathers and
    reduce-scatters, bytes and samples/s for the dashboard (nbdist.parallel.instrument).
    """
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        raise ConfigError("apply_fsdp needs a process group; run it in a %%distributed cell after %dist_start.")
    model = model.to(device())
    mesh = mesh or mesh_1d()
    if blocks is None:
        chosen = [m for m in model.children() if any(True for _ in m.parameters())]
    elif isinstance(blocks, type):
        chosen = [m for m in model.modules() if isinstance(m, blocks) and m is not model]
    else:
        chosen = list(blocks)
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    for block in chosen:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    if metrics:
        from .instrument import instrument_fsdp

        instrument_fsdp(model)
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def memory_report(model: torch.nn.Module, optimizer: Any = None) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer state (local shards only)."""
    params = sum(_local(p).numel() * _local(p).element_size() for p in model.parameters())
    grads = sum(
        _local(p.grad).numel() * _local(p.grad).element_size() for p in model.parameters() if p.grad is not None
    )
    optim = 0
    if optimizer is not None:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    optim += _local(value).numel() * _local(value).element_size()
    return {"params": params, "grads": grads, "optim": optim, "total": params + grads + optim}
