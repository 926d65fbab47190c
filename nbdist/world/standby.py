"""A replacement that waits in the batch queue while the world goes on without it (``--min-ranks``).

When a dead rank's replacement job is still queued at ``--timeout`` (its node is drained, the partition full),
the world goes on with the ranks left (recovery.py), and the job is kept instead of cancelled: the node may come
back. Its engines register with the controller when the job starts; the cell path then grows the world with them
at the next step boundary of the running loop, or before the next cell (cellpath.py). A grow asked by hand
(``%dist_grow``) takes the standby's engines when they have come, and cancels it when they have not, so that a
world never grows twice for one lost node. ``%dist_stop`` and the kernel's death cancel it with the other jobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Standby:
    """The engine sets (batch jobs) of a replacement still queued, the engine ids known before it, and how many
    engines it brings."""

    sets: set[str]
    known: set[int]
    count: int
    jobs: list[str]

    def named(self) -> str:
        return ", ".join(f"Slurm job {j}" for j in self.jobs) or "the replacement"

    def said(self) -> str:
        return f"{self.named()} stays queued: {self.count} rank(s) join at a step boundary once it starts"


def arrived(engines: Any) -> list[int]:
    """The engine ids of ``engines.standby`` once all of its engines have registered; [] before (or without one)."""
    standby: Standby | None = engines.standby
    if standby is None or engines.client is None:
        return []
    new = sorted(set(engines.client.ids) - standby.known - {r.engine_id for r in engines.ranks})
    return new[: standby.count] if len(new) >= standby.count else []
