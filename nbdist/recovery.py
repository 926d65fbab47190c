"""Automatic recovery (``--max-restarts N``): a rank died during a cell, and the cell still succeeds.

What it does, in order, each step on every rank together:

1. restart the dead ranks (same rank numbers, fresh engines) and rebuild the process
   group on every rank (``Cluster.restart``): a group that lost a member cannot be mended;
2. replay the cells marked ``%%distributed --setup`` (imports, model, optimizer, data), in
   the order they last ran, on the ranks they ran on: the survivors too, since their
   model and optimizer belong to the old process group; setup cells may hold collectives;
3. load the latest checkpoint of the last ``save_checkpoint`` into the rebuilt objects
   (model, optimizer, the loader's position, each rank's RNG states);
4. run the interrupted cell again, and say in one line what happened and how long it took.

The budget counts down over the session; when it is spent, a death fails the cell as
before. Only deaths are recovered: an error raised by the cell, a timeout or Ctrl-C is
the user's to see, and a hang would hang again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from .config import RunConfig
from .engine import runtime
from .errors import ClusterError
from .output import Sink
from .results import RankStatus, RunResult
from .run import execute


@dataclass(slots=True)
class Recovery:
    """A cluster's recovery state: the budget left and the last checkpoint's whereabouts (the setup cells
    to replay come from the cluster's history)."""

    budget: int = 0
    used: int = 0
    checkpoint: dict[str, Any] | None = None  # {"path": ..., "names": {"model": ..., ...}}

    @property
    def left(self) -> int:
        return self.budget - self.used

    def wants(self, result: RunResult, killed: list[int]) -> list[int]:
        """The ranks to recover from this result: those that died by themselves, while budget is left."""
        if self.left <= 0:
            return []
        return sorted(r.rank for r in result.ranks if r.status == RankStatus.DEAD and r.rank not in killed)


def recover(cluster: Any, dead: list[int], say: Any) -> str:
    """Restart ``dead``, rebuild the world, replay the setup cells, restore the checkpoint; return what
    was done as one line (``say`` gets it too). Raises ClusterError naming the step that failed."""
    rec: Recovery = cluster.recovery
    rec.used += 1
    tic = time.perf_counter()
    listed = ", ".join(map(str, dead))
    try:
        cluster.restart(dead)
    except Exception as exc:
        raise ClusterError(f"automatic recovery could not restart rank(s) {listed}: {exc}; run %dist_restart.") from exc
    setup = cluster.history.setup_cells()
    for i, cell in enumerate(setup, 1):
        result = execute(
            cluster.engines,
            cell.code,
            RunConfig(ranks=cell.ranks),
            grace=cluster.config.grace,
            watchdog=cluster.config.watchdog,
            on_done=lambda r, k: None,
            sink=Sink(),
        )
        assert isinstance(result, RunResult)  # a blocking run
        if not result.ok:
            why = result.failed[0].failure().summary
            raise ClusterError(f"automatic recovery: setup cell {i} of {len(setup)} failed when replayed: {why}")
    restored = _restore(cluster, rec.checkpoint)
    what = [f"restarted rank(s) {listed}", "rebuilt the process group"]
    if setup:
        what.append(f"replayed {len(setup)} setup cell(s)")
    else:
        what.append("no cell is marked %%distributed --setup, so restarted ranks start empty")
    if restored is not None:
        what.append(f"restored step {restored} from {rec.checkpoint['path']}")  # type: ignore[index]
    line = (
        f"rank(s) {listed} died during the cell; {', '.join(what)} in {time.perf_counter() - tic:.1f} s, "
        f"and ran the cell again (automatic restarts left: {rec.left} of {rec.budget})."
    )
    say(line)
    return line


def _restore(cluster: Any, checkpoint: dict[str, Any] | None) -> int | None:
    """Load the latest checkpoint on every rank at once (DCP loads collectively); its step or None."""
    if not checkpoint:
        return None
    engines = cluster.engines
    futures = [
        engines.apply(r, runtime.restore_checkpoint, checkpoint["path"], checkpoint["names"])
        for r in range(cluster.world_size)
    ]
    steps = []
    for rank, fut in enumerate(futures):
        try:
            steps.append(fut.get(timeout=cluster.config.timeout))
        except Exception as exc:
            raise ClusterError(f"automatic recovery: rank {rank} could not load {checkpoint['path']}: {exc}") from exc
    return steps[0]
