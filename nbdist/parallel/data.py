"""Sharded data: each rank sees its own disjoint part, reshuffled every epoch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ..errors import ConfigError


class ShardedLoader:
    """A DataLoader over a DistributedSampler that calls ``set_epoch`` for you.

    Forgetting ``sampler.set_epoch(epoch)`` is the classic DDP mistake: every epoch
    then sees the same order. Here each full pass over the loader advances the epoch,
    so the order changes on its own; ``set_epoch`` still works to jump to an epoch
    (after loading a checkpoint, say).
    """

    def __init__(self, loader: DataLoader, sampler: DistributedSampler) -> None:
        self.loader = loader
        self.sampler = sampler
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.epoch)
        yield from self.loader
        self.epoch += 1

    def __len__(self) -> int:
        return len(self.loader)

    def indices(self, epoch: int | None = None) -> list[int]:
        """The dataset indices this rank reads in the given (default: next) epoch."""
        self.sampler.set_epoch(self.epoch if epoch is None else epoch)
        return list(iter(self.sampler))


def shard(
    dataset: Dataset,
    batch_size: int,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = True,
    num_replicas: int | None = None,
    rank: int | None = None,
    **loader_kwargs: Any,
) -> ShardedLoader:
    """A loader of this rank's shard of ``dataset``.

    Without shuffle, rank r of N reads samples r, r+N, r+2N, ... With
    ``drop_last=True`` (the default) every rank gets the same number of full batches,
    so no rank waits in a collective for a batch that never comes.
    """
    if batch_size < 1:
        raise ConfigError(f"batch_size ({batch_size}) must be at least 1; it is the batch per rank.")
    if num_replicas is None:
        num_replicas = dist.get_world_size() if dist.is_initialized() else 1
    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
    if drop_last and len(dataset) < num_replicas * batch_size:  # type: ignore[arg-type]
        raise ConfigError(
            f"the dataset has {len(dataset)} samples, fewer than one batch of {batch_size} "  # type: ignore[arg-type]
            f"for each of {num_replicas} ranks; use a smaller batch_size or drop_last=False."
        )
    sampler: DistributedSampler = DistributedSampler(
        dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
    )
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **loader_kwargs)
    return ShardedLoader(loader, sampler)
