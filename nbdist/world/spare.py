"""One engine started ahead of need: registered with the controller, idle, and no rank, until a rank dies.

A dead rank's replacement is then an engine that is already there. Without it, the recovery starts a new engine and
waits for it to register: about 0.3 s of the 1 s from kill to progress at 8 ranks on this 2-core machine
(issue 52). A world keeps one when it runs on this machine (the local launcher) and recovers by itself
(``--max-restarts``); ``NBDIST_SPARE=0`` turns it off. A spare taken is started again before the next cell, not
during the recovery, whose CPU it would share. Once it has registered it imports what a replayed setup cell will
(``engine.warm.cell_helpers``): forked early in a world's life, it may have left the warm process (engine/warm.py)
before that process imported them in its idle time.

The spare is one of the cluster's engine sets: ``%dist_stop`` ends it with the others. A spare that has not
registered when it is wanted (or whose process has ended) is stopped, never counted as another's engine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ..engine.warm import cell_helpers
from ..launch import procs


def wanted(multi_host: bool, max_restarts: int) -> bool:
    """Does a world keep a spare: on this machine, recovering by itself, not turned off (``NBDIST_SPARE=0``)."""
    return not multi_host and max_restarts > 0 and os.environ.get("NBDIST_SPARE", "1") != "0"


@dataclass(slots=True)
class Spare:
    """The spare's engine set (its key in the ipyparallel cluster) and the engine ids known before it started."""

    wanted: bool
    key: str | None = None
    known: set[int] = field(default_factory=set)
    warmed: bool = False  # it was asked to import what a setup cell will
    taken: list[int] = field(default_factory=list)  # the engine ids taken as ranks, in order (what the tests read)

    def up(self, cluster: Any, client: Any, launcher: Any, ranks: list[Any]) -> None:
        """Start the spare when the world keeps one and has none; not waited for (it registers meanwhile). Once it
        has registered, have it import what a replayed setup cell will (``cell_helpers``), also not waited for."""
        if not self.wanted:
            return
        if self.key is not None:
            new = self._arrived(client, ranks)
            if not self.warmed and len(new) == 1:
                client[new[0]].apply_async(cell_helpers)
                self.warmed = True
            return
        self.known, self.warmed = set(client.ids) | {r.engine_id for r in ranks}, False
        before = set(cluster.engines)
        launcher.later(cluster)
        cluster.start_engines_sync(1)
        self.key = next(iter(set(cluster.engines) - before), None)

    def pids(self, cluster: Any) -> list[int]:
        """The processes of the spare's engine set, which a stop ends at once as it ends the ranks' (a SIGTERM would
        run an engine's way out, about 0.3 s)."""
        if self.key is None or cluster is None:
            return []
        return [el.pid for el in _launchers(cluster, self.key) if getattr(el, "pid", None)]

    def take(self, cluster: Any, client: Any, ranks: list[Any]) -> tuple[int | None, str | None]:
        """(the spare's engine id, None) when it has registered and its process runs: it is the caller's now; (None,
        its engine set's key) when it has not (the caller stops that set); (None, None) when there is no spare."""
        key, self.key = self.key, None
        if key is None:
            return None, None
        new = self._arrived(client, ranks)
        runs = key in cluster.engines and not any(procs.exited(el) for el in _launchers(cluster, key))
        if len(new) == 1 and runs:
            self.taken.append(new[0])
            return new[0], None
        return None, key

    def _arrived(self, client: Any, ranks: list[Any]) -> list[int]:
        """Engine ids the controller knows that it did not before the spare started and that are no rank's."""
        return sorted(set(client.ids) - self.known - {r.engine_id for r in ranks})


def _launchers(cluster: Any, key: str) -> list[Any]:
    """The launcher objects of one of the cluster's engine sets (a local set holds one per engine)."""
    return list((getattr(cluster.engines.get(key), "launchers", None) or {}).values())
