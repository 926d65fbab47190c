"""Sharded data: each rank sees its own disjoint part, reshuffled every epoch, resumable mid-epoch."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ..engine import preempt
from ..engine.state import STATE
from ..errors import ConfigError
from . import instrument, peer


class _Sampler(DistributedSampler):
    """A DistributedSampler whose next pass can start ``skip`` samples in (a resumed epoch), and after
    ``offset`` places of the epoch's order that an earlier world read (a world that shrank or grew mid-epoch:
    the rest of the order is split over the ranks now, strided as the sampler splits a whole epoch)."""

    skip = 0
    offset = 0

    def __iter__(self) -> Iterator[int]:
        skip, self.skip = self.skip, 0
        offset, self.offset = self.offset, 0
        if not offset:
            return itertools.islice(super().__iter__(), skip, None)
        return itertools.islice(iter(rest_of_epoch(self, offset)), skip, None)


def rest_of_epoch(sampler: DistributedSampler, offset: int) -> list[int]:
    """This rank's indices of the sampler's epoch from place ``offset`` of its order on: the rest of the order,
    cut (drop_last) or padded as DistributedSampler does a whole epoch, to the same count on every rank."""
    n = len(sampler.dataset)  # type: ignore[arg-type]
    if sampler.shuffle:
        g = torch.Generator()
        g.manual_seed(sampler.seed + sampler.epoch)
        order = torch.randperm(n, generator=g).tolist()
    else:
        order = list(range(n))
    rest, size = order[offset:], sampler.num_replicas
    if sampler.drop_last:
        rest = rest[: len(rest) // size * size]
    elif rest and len(rest) % size:
        pad = size - len(rest) % size
        rest += (rest * (pad // len(rest) + 1))[:pad]
    return rest[sampler.rank :: size]


class ShardedLoader:
    """A DataLoader over a DistributedSampler that calls ``set_epoch`` for you.

    Forgetting ``sampler.set_epoch(epoch)`` is the classic DDP mistake: every epoch
    then sees the same order. Here each full pass over the loader advances the epoch,
    so the order changes on its own; ``set_epoch`` still works to jump to an epoch.

    It also knows its position (``epoch``, ``batch`` read in this epoch, ``step`` in
    all), which ``save_checkpoint(..., loader=)`` stores and ``load_checkpoint`` restores:
    the next pass then continues mid-epoch with the batches an uninterrupted run would
    have read. ``steps(total)`` counts steps across epochs; any loop over the loader (a plain ``for``,
    ``enumerate``) survives a rank's death under ``--max-restarts`` (parallel/peer.py). A loop around it that
    counts epochs begins where the loader is: ``for epoch in range(loader.epoch, 3)``.
    """

    def __init__(self, loader: DataLoader, sampler: DistributedSampler) -> None:
        self.loader = loader
        self.sampler = sampler
        self.epoch = 0
        self.batch = 0  # batches handed out in the current epoch
        self.step = 0  # batches handed out in all
        self.offset = 0  # places of this epoch's order read by an earlier world of another size (``load_state_dict``)
        self._epoch_rng: torch.Tensor | None = None  # the RNG when this epoch's pass began
        self.began: tuple[int, int] = (-1, 0)  # the cell (engine/state.py's count) of its last pass, and its epoch then

    def passes(self) -> int:
        """Passes over this loader the running cell finished (a cell run again from its first line would repeat
        a loop around the loader, ``for epoch in range(3)``, that many times more)."""
        return self.epoch - self.began[1] if self.began[0] == STATE.cell else 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.batch, self.offset = epoch, 0, 0

    def __iter__(self) -> Iterator[Any]:
        if self.began[0] != STATE.cell:
            self.began = (STATE.cell, self.epoch)
        # With --max-restarts: what a lost rank would be rebuilt from, kept at each step boundary (parallel/peer.py);
        # the first before the DataLoader draws its seed, as a pass restored to this place will.
        peer.watch(self)
        peer.boundary(self, first=True)
        self.sampler.set_epoch(self.epoch)
        if (self.batch or self.offset) and self._epoch_rng is not None:
            # Mid-epoch: skip what was read, and let the DataLoader draw its seed from the RNG
            # state the interrupted pass drew it from, so workers and the RNG match that run.
            now = torch.get_rng_state()
            torch.set_rng_state(self._epoch_rng)
            self.sampler.skip = self.batch * self.loader.batch_size  # type: ignore[attr-defined,operator]
            self.sampler.offset = self.offset  # type: ignore[attr-defined]
            it = iter(self.loader)
            torch.set_rng_state(now)
        else:
            self.batch, self.offset = 0, 0
            self._epoch_rng = torch.get_rng_state()
            it = iter(self.loader)
        clock, first = time.perf_counter, True
        while True:
            if not first:
                peer.boundary(self)  # before the next batch is read
            first = False
            tic = clock()
            try:
                item = next(it)
            except StopIteration:
                break
            instrument.data_waited(clock() - tic, self.step)  # the step's "data wait" part, and its number
            self.batch += 1
            self.step += 1
            yield item
        self.epoch += 1
        self.batch, self.offset = 0, 0
        peer.pass_over()

    def steps(self, total: int, preemptible: bool = True) -> Iterator[tuple[int, Any]]:
        """``(step, batch)`` until ``total`` steps in all, across epochs, from where the loader is.

        After ``load_checkpoint(..., loader=)`` (or nbdist's automatic recovery) the loop
        continues at the checkpointed step with the data an uninterrupted run would have
        seen. Each step is a preemption point (engine/preempt.py: a flag exchange that the
        step never waits for); a SIGTERM to any rank then saves on every rank at the same
        step and ends the loop with Preempted.
        """
        it, fresh = iter(self), False
        while self.step < total:
            if preemptible:
                preempt.point(self.step)  # before the next batch is read: the step count is what is done
            try:
                batch = next(it)
            except StopIteration:
                if fresh:
                    raise ConfigError(f"the loader yields no batch; it cannot give {total} steps.") from None
                it, fresh = iter(self), True
                continue
            fresh = False
            yield self.step - 1, batch
        if preemptible:
            preempt.settle(self.step)

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "batch": self.batch,
            "step": self.step,
            "epoch_rng": self._epoch_rng,
            "offset": self.offset,
            "world": self.sampler.num_replicas,
            "batch_size": self.loader.batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on where ``state`` was. Saved by a world of another size (a world that shrank or grew): the places
        of this epoch's order it read are skipped, and the rest is split over this world's ranks, so every
        sample of the epoch is read once (but for the tail drop_last drops, as in any epoch)."""
        self.epoch, self.batch, self.step = int(state["epoch"]), int(state["batch"]), int(state["step"])
        self.offset = int(state.get("offset", 0))
        self._epoch_rng = state.get("epoch_rng")
        world = int(state.get("world", self.sampler.num_replicas))
        if world != self.sampler.num_replicas:
            self.offset += self.batch * int(state.get("batch_size") or self.loader.batch_size or 1) * world
            self.batch = 0

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
    sampler: DistributedSampler = _Sampler(
        dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
    )
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **loader_kwargs)
    return ShardedLoader(loader, sampler)
