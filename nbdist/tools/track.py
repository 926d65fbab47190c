"""nbdist.track: what every rank logs, and nbdist's own step metrics, go to one run of an experiment tracker for the
world (tracking/), from the next cell on, until ``untrack`` or the world's stop."""

from __future__ import annotations

from ..cluster import current
from ..errors import ConfigError
from ..tracking import Tracker, open_run


def track(kind: str = "tensorboard", name: str | None = None, folder: str | None = None) -> Tracker:
    """Track the running world in one new run of ``kind`` (tensorboard) named ``name`` under ``folder`` (default:
    runs/, a dated name): each rank's metrics under ``rank{r}/``, the world's (the mean over the ranks; samples/s
    summed) at the top, the world's size as ``world/size``, each cell's source and the world's config as text."""
    cluster = current()  # no world: ClusterError naming %dist_start
    tracker = cluster.cells.listener
    if tracker is not None:
        raise ConfigError(
            f"this world is tracked already (the {tracker.kind} run at {tracker.run.where}); %dist_track off ends "
            "that run first."
        )
    run = open_run(kind, name, folder)
    cluster.cells.listener = tracker = Tracker(run, kind, cluster.membership.config.flat())
    return tracker


def untrack() -> str:
    """End the world's run (what is queued is written first); what was done, in words."""
    cluster = current()
    tracker, cluster.cells.listener = cluster.cells.listener, None
    if tracker is None:
        return "this world is not tracked; %dist_track tensorboard starts a run."
    tracker.close()
    return f"the {tracker.kind} run at {tracker.run.where} ended"
