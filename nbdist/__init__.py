"""nbdist: distributed PyTorch from a notebook.

``nbdist.start(n=2)`` starts n ipyparallel engines whose torch.distributed process
group is already initialised; ``%load_ext nbdist`` adds the ``%%distributed`` magics.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = [
    "Cluster",
    "ClusterError",
    "ConfigError",
    "NbdistError",
    "RankError",
    "RunTimeout",
    "__version__",
    "attach",
    "batch_script",
    "breakpoint",
    "current",
    "equiv",
    "fit",
    "headline",
    "load_ipython_extension",
    "log",
    "on_preempt",
    "start",
    "track",
    "unload_ipython_extension",
    "untrack",
    "why",
]

from .errors import ClusterError, ConfigError, NbdistError, RankError, RunTimeout


def __getattr__(name: str) -> Any:
    # Keep `import nbdist` (and `python -m nbdist.engine`) light: ipyparallel loads on first use.
    if name in ("Cluster", "start", "current", "attach"):
        from . import cluster

        return getattr(cluster, name)
    if name == "why":
        from .tools.why import why

        return why
    if name == "fit":
        from .tools.fit import fit

        return fit
    if name in ("track", "untrack"):
        from .tools import track

        return getattr(track, name)
    if name == "equiv":
        from .tools.equiv import equiv

        return equiv
    if name == "log":
        from .engine.metrics import log

        return log
    if name == "batch_script":
        from .launch.hosts import script_of

        return script_of
    if name == "breakpoint":
        from .engine.debug import breakpoint

        return breakpoint
    if name == "on_preempt":
        from .engine.preempt import on_preempt

        return on_preempt
    raise AttributeError(f"module 'nbdist' has no attribute {name!r}")


def headline(result: Any = None) -> dict[str, Any]:
    """The numbers a cell's dashboard headline shows, computed by the dashboard's own code, to print or check.

    ``result``: a cell's RunResult (``nbdist.current().last`` by default). Keys, where the ranks logged them:
    ``step``, ``loss`` (its name, the mean of the ranks), ``samples_per_s`` (all ranks), ``comm_pct`` (the time from
    the first gradient bucket handed to the all-reduce until the last one finished, as a share of the step: the
    mean of the ranks) and ``comm_pct_per_rank``, ``slowest`` (rank, % slower than the fastest), and ``recent``:
    each rank's numbers are the mean of its last ``recent`` steps.
    """
    from .stragglers import slow
    from .widgets.store import headline_of

    if result is None:
        from .cluster import current

        result = current().last
    return headline_of(getattr(result, "metrics", None) or {}, judge=slow)


def load_ipython_extension(ipython: Any) -> None:
    """%load_ext nbdist: register the magics (imported only now)."""
    from .magics import load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    from .magics import unload

    unload(ipython)
