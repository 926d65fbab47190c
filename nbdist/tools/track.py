"""nbdist.track: what every rank logs, and nbdist's own step metrics, go to one run of an experiment tracker for the
world (tracking/), from the next cell on, until ``untrack`` or the world's stop."""

from __future__ import annotations

from ..cluster import current
from ..errors import ConfigError
from ..tracking import Tracker, open_run


def track(
    kind: str = "tensorboard",
    name: str | None = None,
    folder: str | None = None,
    project: str | None = None,
    uri: str | None = None,
) -> Tracker:
    """Track the running world in one new run of ``kind`` (tensorboard, mlflow, wandb or trackio) named ``name``
    (default: a dated name), in ``folder``, ``project`` or MLflow's ``uri`` (tracking/sinks.py says each default):
    each rank's metrics under ``rank{r}/``, the world's (the mean over the ranks; samples/s summed) at the top, the
    world's size as ``world/size``, each cell's source where its steps begin, the world's config as parameters."""
    cluster = current()  # no world: ClusterError naming %dist_start
    tracker = cluster.cells.listener
    if tracker is not None:
        raise ConfigError(
            f"this world is tracked already (the {tracker.kind} run at {tracker.run.where}); %dist_track off ends "
            "that run first."
        )
    params = cluster.membership.config.flat()
    run = open_run(kind, name, folder, project, uri, params)
    cluster.cells.listener = tracker = Tracker(run, kind, params, cluster.membership.workdir)
    return tracker


def untrack() -> str:
    """End the world's run (what is queued is written first); what was done, in words."""
    cluster = current()
    tracker, cluster.cells.listener = cluster.cells.listener, None
    if tracker is None:
        return "this world is not tracked; %dist_track tensorboard (or mlflow, wandb, trackio) starts a run."
    tracker.close()
    return f"the {tracker.kind} run at {tracker.run.where} ended"
