"""Launchers: how the controller and the engines of a cluster are started, and where they listen.

A launcher turns a StartConfig into an ``ipyparallel.Cluster`` (its controller and engine-set
launchers, the address the controller binds, the environment of the processes) and says
where rank 0's rendezvous store listens. ``EngineSet`` uses whatever ``launcher_for``
returns; a launcher for several hosts (ipyparallel's Slurm and MPI engine sets) is a new
class registered in ``LAUNCHERS``, with no change to ``Cluster`` or ``EngineSet``.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Protocol

from .config import StartConfig
from .errors import ConfigError
from .pool import ENGINE_CMD, WarmEngineSetLauncher

LOOPBACK = "127.0.0.1"
# ipyparallel logs every engine's whole output at WARNING when it stops an engine;
# nbdist reports failures itself, so only ipyparallel's errors get through.
IPP_LOG = logging.getLogger("nbdist.ipyparallel")
IPP_LOG.setLevel(logging.ERROR)


class Launcher(Protocol):
    name: str

    def cluster(self, config: StartConfig, profile_dir: str) -> Any:
        """An ipyparallel.Cluster, configured but not started, for ``config.n`` engines."""

    def master_address(self, rank0_host: str) -> str:
        """The address rank 0's rendezvous store binds and every rank connects to."""


class LocalLauncher:
    """Controller and engines on this machine, all on 127.0.0.1; engines served warm when they can be."""

    name = "local"

    def cluster(self, config: StartConfig, profile_dir: str) -> Any:
        import ipyparallel as ipp

        cluster = ipp.Cluster(
            profile_dir=profile_dir,
            n=config.n,
            delay=0,
            send_engines_connection_env=False,
            engine_timeout=int(config.timeout),
            controller_ip=LOOPBACK,
            controller_args=["--usethreads", f"--HeartMonitor.period={config.heartbeat_ms}"],
            controller="Local",
            engines=WarmEngineSetLauncher,
            log=IPP_LOG,
            load_profile=False,
        )
        env = process_env(config)
        c = cluster.config
        c.LocalControllerLauncher.controller_cmd = [sys.executable, "-m", "nbdist.engine.controller"]
        c.LocalEngineSetLauncher.engine_cmd = list(ENGINE_CMD)
        c.LocalEngineSetLauncher.engine_args = ["--IPEngine.enable_nanny=False"]
        c.LocalEngineSetLauncher.delay = 0.0
        c.LocalProcessLauncher.stop_seconds_until_kill = 2
        for klass in ("LocalControllerLauncher", "LocalEngineSetLauncher"):
            c[klass].environment = dict(env)
        return cluster

    def master_address(self, rank0_host: str) -> str:
        return LOOPBACK


def process_env(config: StartConfig) -> dict[str, str]:
    """Environment of the controller and engines: the kernel to watch, threads per rank, unbuffered output."""
    return {
        "NBDIST_PARENT_PID": str(os.getpid()),
        "OMP_NUM_THREADS": str(config.threads),
        "NUMBA_NUM_THREADS": str(config.threads),
        "PYTHONUNBUFFERED": "1",
    }


LAUNCHERS: dict[str, type] = {"local": LocalLauncher}


def launcher_for(config: StartConfig) -> Launcher:
    """The launcher for ``config.launcher``; a clear error for names nbdist knows but cannot run yet."""
    klass = LAUNCHERS.get(config.launcher)
    if klass is None:
        raise ConfigError(
            f"launcher {config.launcher!r} is not yet supported; use --launcher local "
            "(multi-node launchers go through ipyparallel's Slurm/MPI launchers in a later release)."
        )
    launcher: Launcher = klass()
    return launcher
