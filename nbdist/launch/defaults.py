"""What ``%dist_start`` does with no arguments: how many ranks, through which launcher, and why.

- inside a Slurm allocation (salloc, sbatch, batchspawner) without ``-n``: one rank per
  allocated GPU across the allocation's nodes, or one per allocated task on CPU nodes,
  started as an ``srun --overlap`` step of the kernel's own job;
- elsewhere with two or more GPUs visible (a Kubernetes pod, a workstation): one local rank per GPU;
- elsewhere: 2 local ranks.

The backend follows from what the ranks find (``rendezvous.choose_backend``: nccl when
every rank has a GPU of its own); ``Choice.line`` puts both in one sentence.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..config import StartConfig
from . import gpus, slurm


@dataclass(frozen=True, slots=True)
class Choice:
    n: int
    launcher: str
    gpus: int = 0  # GPUs the ranks were counted from (0: none)
    ranks_per_node: int = 0  # srun --ntasks-per-node (0: srun's own placement)
    why: str = ""  # '4 ranks = 4 GPUs allocated on node1,node2 (Slurm job 7)'; '' when nothing was chosen

    def line(self, backend: str) -> str:
        """One line for the user: what was chosen and why, with the backend the world got."""
        if not self.why:
            return ""
        text = f"{self.why}; backend {backend}"
        if self.gpus and backend != "nccl":
            text += (
                " (the ranks see no CUDA device of their own: is torch a CPU build? torch.version.cuda is None there)"
            )
        return text


def choose(n: int | None, launcher: str | None, env: Mapping[str, str] | None = None) -> Choice:
    """The ranks and launcher when the user left them out; what the user gave is kept."""
    alloc = slurm.allocation(env)
    if launcher is None:
        launcher = "srun" if (alloc is not None and n is None) else "local"
    if n is not None:
        return Choice(n, launcher)
    if launcher == "srun" and alloc is not None:
        why = f"{alloc.ranks()} ranks = {alloc.describe()}; engines via srun --overlap"
        if sum(alloc.gpus) and not alloc.gpus_per_node():
            counts = "+".join(str(g) for g in alloc.gpus)
            why += f" (uneven GPUs per node: {counts}; ask Slurm for --gpus-per-node to place one rank per GPU)"
        return Choice(alloc.ranks(), launcher, sum(alloc.gpus), alloc.gpus_per_node(), why)
    if launcher == "local":
        ids, source = gpus.visible(env)
        if len(ids) > 1:  # one GPU: 2 ranks (sharing it over gloo) teach more than a world of one
            host = socket.gethostname().split(".")[0]
            return Choice(
                len(ids), launcher, len(ids), 0, f"{len(ids)} ranks = {len(ids)} GPUs visible on {host} ({source})"
            )
    return Choice(2, launcher)


def planned(
    n: int | None = None, backend: str | None = None, launcher: str | None = None, timeout: float = 45.0, **options: Any
) -> tuple[StartConfig, Choice]:
    """The StartConfig ``start`` would start with these arguments (n and the launcher chosen where left out),
    and the choice."""
    choice = choose(n, launcher)
    if choice.ranks_per_node and not options.get("ranks_per_node"):
        options["ranks_per_node"] = choice.ranks_per_node
    config = StartConfig.of(n=choice.n, backend=backend, launcher=choice.launcher, timeout=timeout, **options)
    return config, choice
