"""BatchNorm whose statistics are the whole world's batch, on CPU too (torch's SyncBatchNorm wants a GPU).

``sync_batchnorm(model)`` swaps every BatchNorm layer for one that normalises with the mean and variance of
all ranks' rows together, as one process with the whole batch would: on CUDA it is torch's own
``nn.SyncBatchNorm.convert_sync_batchnorm``; elsewhere each layer all-reduces its per-channel sums (one
all-reduce of 2C+1 numbers a layer, differentiable: ``torch.distributed.nn.functional.all_reduce``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

BATCHNORM = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


class WorldBatchNorm(nn.Module):
    """A BatchNorm layer's weights and running statistics, normalised over every rank's rows while training."""

    world_statistics = True  # what %dist_equiv's recorder looks for (engine/equiv.py)

    def __init__(self, bn: nn.BatchNorm1d | nn.BatchNorm2d | nn.BatchNorm3d, group: Any = None) -> None:
        super().__init__()
        self.bn, self.group = bn, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bn = self.bn
        if not (bn.training and dist.is_initialized() and dist.get_world_size(self.group) > 1):
            return bn(x)
        from torch.distributed.nn.functional import all_reduce

        dims = [d for d in range(x.dim()) if d != 1]
        count = torch.tensor([x.numel() / x.shape[1]], dtype=x.dtype, device=x.device)
        sums = all_reduce(torch.cat([x.sum(dims), (x * x).sum(dims), count]), group=self.group)
        c = x.shape[1]
        total = sums[-1]
        mean = sums[:c] / total
        var = sums[c : 2 * c] / total - mean * mean
        if bn.track_running_stats and bn.running_mean is not None and bn.running_var is not None:
            with torch.no_grad():
                tracked = bn.num_batches_tracked
                if tracked is not None:
                    tracked.add_(1)
                m = bn.momentum if bn.momentum is not None else 1.0 / float(tracked if tracked is not None else 1)
                bn.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
                bn.running_var.mul_(1 - m).add_((var * total / (total - 1)).detach(), alpha=m)
        shape = [1, c] + [1] * (x.dim() - 2)
        y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + bn.eps)
        if bn.affine:
            y = y * bn.weight.view(shape) + bn.bias.view(shape)
        return y


def sync_batchnorm(model: nn.Module, group: Any = None) -> nn.Module:
    """The model with each BatchNorm layer normalising over all ranks' rows (call before DDP)."""
    if any(p.is_cuda for p in model.parameters()):
        return nn.SyncBatchNorm.convert_sync_batchnorm(model, group)
    if isinstance(model, BATCHNORM):
        return WorldBatchNorm(model, group)
    for name, child in model.named_children():
        setattr(model, name, sync_batchnorm(child, group))
    return model


__all__ = ["WorldBatchNorm", "sync_batchnorm"]
