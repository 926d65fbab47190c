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


def _order(n: int, seed: int, epoch: int) -> list[int]:
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).tolist()


@pytest.mark.parametrize(("before", "after", "read"), [(4, 3, 3), (4, 2, 5), (3, 4, 2), (2, 5, 1)])
def test_a_world_of_another_size_reads_the_rest_of_the_epoch_each_sample_once(before, after, read):
    """A world that shrank or grew mid-epoch (load_state_dict of a loader saved by another world size): what
    both worlds read is a prefix of the epoch's order, no sample twice, and the places left unread are fewer
    than one batch per new rank plus one sample per rank (drop_last's tail, as in any epoch)."""
    n, batch, seed = 103, 4, 9
    old = [shard(_ds(n), batch, seed=seed, num_replicas=before, rank=r) for r in range(before)]
    streams = [iter(loader) for loader in old]
    seen = [i for _ in range(read) for it in streams for i in next(it)[0].tolist()]
    state = old[0].state_dict()
    new = [shard(_ds(n), batch, seed=seed, num_replicas=after, rank=r) for r in range(after)]
    for loader in new:
        loader.load_state_dict(state)
    rest = [[i for b in loader for i in b[0].tolist()] for loader in new]  # one pass: to the epoch's end
    assert len({len(r) for r in rest}) == 1  # every rank the same number of batches: none waits in a collective
    seen += [i for r in rest for i in r]
    places = sorted(_order(n, seed, 0).index(i) for i in seen)
    assert places == list(range(len(seen))), "not a prefix of the epoch's order, or a sample read twice"
    assert n - len(seen) < after * batch + after
    assert all(loader.epoch == 1 and loader.step == read + len(rest[0]) // batch for loader in new)
    assert new[0].state_dict()["offset"] == 0  # the next epoch is whole again, split over the new world
