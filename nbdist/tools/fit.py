"""nbdist.fit: the forecast (nbdist.forecast) asked from the notebook. When a world is running, its ranks measure
the collectives the forecast prices (a few seconds), and its ``--setup`` cells run before the forecast's cell, so the
classes and helpers they define are there; without a world, two gloo processes measure the collectives."""

from __future__ import annotations

from typing import Any

from .. import forecast
from ..cluster import current
from ..errors import ClusterError
from ..forecast.comm import measure_here

MEASURE_S = 120.0  # the most the ranks may take to measure the collectives


def fit(source: str, *, setup: bool = True, watch: str | None = None, **config: Any) -> forecast.Forecast:
    """``forecast.fit`` with what the live world knows: its measured collectives and (``setup``) its setup cells.

    ``source`` defines ``model`` and ``batch`` (see nbdist.forecast.fit for the rest); ``config``: ``strategies``,
    ``world_sizes``, ``memory`` ("16GiB"), ``microbatches``, ``timeout``, ``cores``. ``watch``: the strategy the run
    will use (default: the one that fits, when ``memory`` is given; "none": no watching): the live world's
    dashboards then draw its forecast step time (and GPU peak) and say when a step is over it.
    """
    try:
        cluster = current()
    except ClusterError:
        fc = forecast.fit(source, **config)
        if watch not in (None, "none"):
            fc.advice = "no world is running to watch it: %dist_start, then forecast again with --watch"
        return fc
    engines = cluster.engines
    ranks = list(range(cluster.world_size))
    comm = None
    if engines is not None and cluster.world_size >= 2:
        comm = engines.call(ranks, measure_here, timeout=MEASURE_S).ordered(
            "%%dist_fit (measuring collectives)", ranks
        )[0]
    cells = [c.code for c in cluster.history.setup_cells()] if setup else []
    fc = forecast.fit(source, comm=comm, measured_at=cluster.world_size, setup=cells, **config)
    watched = watch or (fc.best.strategy if fc.best is not None else None)
    if watched == "none":
        cluster.expect = None
    elif watched is not None:
        cluster.expect = fc.expectation(watched)
        fc.watched = watched
    return fc
