"""Which LR schedulers a checkpoint keeps without being told (engine/schedulers.py): those that hold the
optimizer, in the order made, the parts of a SequentialLR inside it, and those made before nbdist looked."""

from __future__ import annotations

import torch
from torch.optim import lr_scheduler

from nbdist.engine import schedulers


def _opt():
    return torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)


def test_the_schedulers_that_hold_an_optimizer_in_the_order_made_and_no_others():
    opt, other = _opt(), _opt()
    made_before = lr_scheduler.StepLR(opt, 3)  # maybe before install(): found by the one-time sweep
    schedulers.install()
    plateau = lr_scheduler.ReduceLROnPlateau(opt)  # its __init__ skips LRScheduler's
    lr_scheduler.ExponentialLR(other, 0.9)
    assert schedulers.bound(opt) == [made_before, plateau]
    assert schedulers.bound(opt, known=[made_before]) == [plateau]
    assert schedulers.bound(None) == []


def test_a_sequential_schedulers_parts_are_kept_inside_it_not_beside_it():
    opt = _opt()
    warm = lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=2)
    cosine = lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    both = lr_scheduler.SequentialLR(opt, [warm, cosine], milestones=[2])
    assert schedulers.bound(opt) == [both]
    assert schedulers.bound(opt, known=[both]) == []


def test_a_scheduler_dropped_is_forgotten():
    import gc

    opt = _opt()
    lr_scheduler.StepLR(opt, 3)
    gc.collect()
    assert schedulers.bound(opt) == []
