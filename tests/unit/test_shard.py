"""Sharding rules, checked without a process group (ranks given explicitly)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from nbdist.errors import ConfigError
from nbdist.parallel import scale_lr, shard


def _ds(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def _indices(n=103, world=2, batch=4, shuffle=True, seed=0, epoch=0):
    return [
        shard(_ds(n), batch, shuffle=shuffle, seed=seed, num_replicas=world, rank=r).indices(epoch)
        for r in range(world)
    ]


def test_without_shuffle_rank_r_gets_r_plus_multiples_of_n():
    idx = _indices(n=20, world=2, shuffle=False)
    assert idx[0] == list(range(0, 20, 2)) and idx[1] == list(range(1, 20, 2))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_shards_are_disjoint_equal_and_cover_up_to_drop_last(world):
    idx = _indices(n=103, world=world)
    flat = [i for part in idx for i in part]
    assert len(set(flat)) == len(flat)  # disjoint
    assert len({len(p) for p in idx}) == 1  # equal length
    assert len(flat) == 103 - 103 % world  # everything but the remainder
    loaders = [shard(_ds(103), 4, num_replicas=world, rank=r) for r in range(world)]
    assert len({len(loader) for loader in loaders}) == 1  # same number of batches on every rank


def test_reshuffled_each_epoch_and_reproducible_with_the_same_seed():
    assert _indices(epoch=0) != _indices(epoch=1)
    assert _indices(epoch=3, seed=7) == _indices(epoch=3, seed=7)
    assert _indices(seed=1) != _indices(seed=2)


def test_iterating_advances_the_epoch_by_itself():
    loader = shard(_ds(16), 2, num_replicas=2, rank=0, seed=0)
    first = [b[0].tolist() for b in loader]
    second = [b[0].tolist() for b in loader]
    assert loader.epoch == 2 and first != second
    assert sorted(sum(first, [])) != [] and len(first) == len(second) == 4


def test_too_small_dataset_is_a_clear_error():
    with pytest.raises(ConfigError, match="fewer than one batch of 8 for each of 2 ranks"):
        shard(_ds(10), 8, num_replicas=2, rank=0)


def test_lr_scaling_rules():
    assert scale_lr(0.1, 4, "linear") == pytest.approx(0.4)
    assert scale_lr(0.1, 4, "sqrt") == pytest.approx(0.2)
    assert scale_lr(0.1, 4, "none") == 0.1
    with pytest.raises(ConfigError, match="did you mean 'linear'"):
        scale_lr(0.1, 4, "linaer")
