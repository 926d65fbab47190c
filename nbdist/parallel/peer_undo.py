"""An optimizer as it was before a step that is not its batch's last (a GAN's first of two): what a living rank
found between two steps of one batch puts back, to go on from the batch's beginning (parallel/peer.py)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from ..engine import schedulers


@dataclass(slots=True)
class Undo:
    """An optimizer as it was before a step that is not its batch's last: its parameters, its state, its schedulers."""

    optimizer: Any
    params: list[torch.Tensor]
    state: dict[str, Any]
    schedulers: list[dict[str, Any]]

    @classmethod
    def take(cls, optimizer: Any) -> Undo:
        params = [p.detach().clone() for group in optimizer.param_groups for p in group["params"]]
        return cls(
            optimizer,
            params,
            copy.deepcopy(optimizer.state_dict()),
            [copy.deepcopy(s.state_dict()) for s in schedulers.bound(optimizer)],
        )

    def put_back(self) -> None:
        with torch.no_grad():
            mine = [p for group in self.optimizer.param_groups for p in group["params"]]
            for p, saved in zip(mine, self.params, strict=True):
                p.copy_(saved)
        self.optimizer.load_state_dict(self.state)
        for sched, state in zip(schedulers.bound(self.optimizer), self.schedulers, strict=False):
            sched.load_state_dict(state)
