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
    "load_ipython_extension",
    "log",
    "on_preempt",
    "start",
    "unload_ipython_extension",
]

from .errors import ClusterError, ConfigError, NbdistError, RankError, RunTimeout


def __getattr__(name: str) -> Any:
    # Keep `import nbdist` (and `python -m nbdist.engine`) light: ipyparallel loads on first use.
    if name in ("Cluster", "start", "current", "attach"):
        from . import cluster

        return getattr(cluster, name)
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


def load_ipython_extension(ipython: Any) -> None:
    """%load_ext nbdist: register the magics (imported only now)."""
    from .magics import load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    from .magics import unload

    unload(ipython)
