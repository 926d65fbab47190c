"""Launchers: how the controller and the engines of a cluster are started, and where they listen.

A launcher turns a StartConfig into an ``ipyparallel.Cluster`` (its controller and engine-set
launchers, the address the controller binds, the environment of the processes) and says
where rank 0's rendezvous store listens. ``Launcher`` holds the defaults for one host,
``build_cluster`` builds the ipyparallel cluster every launcher starts, and ``LocalLauncher``
runs everything here on 127.0.0.1. The base for several hosts is across.py's, nbdist's own
launchers for them are in hosts.py; ``launcher_for`` finds a launcher by its name (config/launchers.py).
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
from dataclasses import dataclass
from typing import Any

from .. import wire
from ..config import LauncherOptions, LauncherSpec, StartConfig, option
from ..config.launchers import launcher_class
from ..config.values import did_you_mean
from ..errors import ConfigError
from . import pool, procs
from .net import LOOPBACK
from .pool import ENGINE_CMD, WarmEngineSetLauncher

# ipyparallel logs every engine's whole output at WARNING when it stops an engine;
# nbdist reports failures itself, so only ipyparallel's errors get through.
IPP_LOG = logging.getLogger("nbdist.ipyparallel")
IPP_LOG.setLevel(logging.ERROR)


class Launcher:
    """How a cluster's processes start. Defaults describe one host; launchers for several override them."""

    spec: LauncherSpec  # its name, summary, whether engines may run elsewhere, the options it declares
    rank_vars: tuple[str, ...] = ()  # env vars that carry each engine's launch rank (SLURM_PROCID, ...)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def multi_host(self) -> bool:
        """Engines may run on other hosts: no local pids, signals go through ipyparallel."""
        return self.spec.multi_host

    def cluster(self, config: StartConfig, profile_dir: str, fresh: bool = True) -> Any:
        """An ipyparallel.Cluster, configured but not started, for ``config.world.n`` engines (``fresh``: with a new
        controller's keys; False: for engines of a controller already running on this profile)."""
        raise NotImplementedError

    def master_address(self, rank0_addr: str) -> str:
        """The address rank 0's rendezvous store binds and every rank connects to.

        ``rank0_addr`` is rank 0's own address on the route to the controller.
        """
        return LOOPBACK

    def workdir_base(self) -> str | None:
        """Where the cluster's private directory goes (None: the temp dir); several hosts need a shared one."""
        return None

    def queue(self, engine_launchers: list[Any]) -> tuple[str, list[Any]]:
        """One look at the batch queue: why engines are not running yet (a pending job, in words; ''
        when nothing waits), and the engine launchers whose job has left the queue (their engines
        will never register)."""
        return "", []

    def job_ids(self, engine_launchers: list[Any]) -> list[str]:
        """The batch jobs these engine launchers submitted."""
        return []

    def unreachable_hint(self) -> str:
        """What to do when an engine cannot reach the controller."""
        return ""

    def why_gone(self) -> str:
        """Why what this launcher runs the engines in ended them all, when it says ('' here)."""
        return ""

    def cancel(self, job_ids: list[str]) -> None:
        """Cancel these batch jobs (after ipyparallel's own stop: nothing of them may outlive the cluster)."""

    def stopped(self) -> None:
        """The cluster stopped: end what this launcher started for it beyond its engines."""

    def formed(self) -> None:
        """The world's first engines formed it: start ahead what engines started later will use (nothing here)."""

    def later(self, cluster: Any) -> None:
        """Engines started after the world's first (replacements, a grow) go where there is room: set ``cluster``'s
        engine launcher for them (the first start's spread over nodes need not hold)."""

    def release(self, job_ids: list[str], hosts: set[str]) -> list[str]:
        """The world went on with its ranks on ``hosts`` only: give back what these batch jobs hold elsewhere;
        what was done, in words."""
        return []


IP_HELP = "address the controller listens on (default: the one that reaches the nodes; local: 127.0.0.1 only)"


START_HELP = (
    "how each rank's process is made: fork (from nbdist's warm process, which imported torch ahead: the fastest), "
    "forkserver (from a fresh process begun for this world that imports only torch and ipyparallel's engine), spawn "
    "(a fresh Python per rank)"
)


@dataclass(kw_only=True)
class LocalOptions(LauncherOptions):
    """--ip is for launchers on several hosts; here it may only say what is so. --start: how ranks are made."""

    ip: str | None = option(help=IP_HELP, metavar="ADDR")
    start: str = option("fork", help=START_HELP, metavar="METHOD")

    def check(self, n: int) -> None:
        if self.start not in pool.START_METHODS:
            raise ConfigError(
                f"--start {self.start!r} is not a start method; {did_you_mean(str(self.start), pool.START_METHODS)} "
                "(fork: from the warm process, the fastest; forkserver: from a fresh fork server of this world's; "
                "spawn: a fresh Python per rank)."
            )
        if self.ip not in (None, LOOPBACK):
            raise ConfigError(
                f"--ip {self.ip} is for launchers on several hosts; the local launcher listens on {LOOPBACK} only. "
                "Use --launcher slurm, srun, mpi or ray, or leave --ip out."
            )


class LocalLauncher(Launcher):
    """Controller and engines on this machine, all on 127.0.0.1; engines served warm when they can be."""

    spec = LauncherSpec("local", "every rank on this machine, on 127.0.0.1", multi_host=False, options=LocalOptions)

    def __init__(self) -> None:
        self._server: int | None = None  # a fork server this start began itself (pool.py)
        self._threads = 1

    def cluster(self, config: StartConfig, profile_dir: str, fresh: bool = True) -> Any:
        # No warm process for these engines yet (a script, a first start with other settings): begin
        # one now, beside the controller, so torch is imported once, not once per rank. It serves
        # %dist_restart too, and ends with this cluster (one that %load_ext began stays for the next).
        # --start forkserver begins a lean one for this world instead; --start spawn none.
        start = config.options_as(LocalOptions).start
        self._threads = config.world.threads or 1
        if start != "spawn":
            self._server = pool.warm(config.world.n, self._threads, lean=start == "forkserver")
        cluster, _ = build_cluster(
            config,
            profile_dir,
            fresh=fresh,
            ip=LOOPBACK,
            engines=WarmEngineSetLauncher,
            engine_args=["--IPEngine.enable_nanny=False"],
        )
        c = cluster.config
        c.LocalEngineSetLauncher.delay = 0.0
        c.LocalProcessLauncher.stop_seconds_until_kill = 2
        c.WarmEngineLauncher.start_method = start
        return cluster

    def stopped(self) -> None:
        if self._server is not None:
            pool.close(self._server)
            self._server = None
        pool.close_lean(self._threads)  # a forkserver this world used (begun by it, or where the warm fork refused)


def heart_misses(n: int) -> int:
    """Heartbeats an engine may miss in a row before the controller calls it dead: ipyparallel's 10 (about 1 s at
    nbdist's 100 ms) up to 20 ranks, then one more for every two ranks (3.3 s at 64). One controller answers every
    rank's heartbeat ten times a second, and a bigger world stalls it and its ranks for longer: 64 ranks over the two
    2-CPU test nodes once lost a living engine that way (CI, 2026-12-02: 'Engine 13 died', then its stale reply).
    A local rank's death is seen from its process at once, whatever this says."""
    return max(10, n // 2)


def registration_timeout(start_timeout: float) -> int:
    """Seconds the controller waits for a registered engine's first heartbeat before it forgets the engine: never
    less than the start's own timeout. ipyparallel's 30 s was too short for 64 ranks over the two 2-CPU test nodes,
    whose kernels all start at once: the engines it forgot lived on, idle and never registered, and the start waited
    for them until its timeout (CI, 2026-12-03; docs/faults.md row 119)."""
    return max(30, int(start_timeout))


def build_cluster(
    config: StartConfig,
    profile_dir: str,
    *,
    fresh: bool,
    ip: str,
    engines: type,
    engine_args: list[str],
    env: dict[str, str] | None = None,
    controller_env: dict[str, str] | None = None,
) -> tuple[Any, Any]:
    """The ipyparallel.Cluster a launcher starts, as every launcher needs it: nbdist's controller (binding ``ip``,
    CurveZMQ and signed messages when ``fresh``, its heartbeat, watching the kernel), ``config.world.n`` engines of the
    engine-set launcher ``engines`` running nbdist's engine command with ``engine_args``, and the environment of
    every process (threads, the kept world's lease; ``env`` adds to the engines' and the controller's,
    ``controller_env`` to the controller's). Returns the cluster, not started, and its engine-set launcher's
    config section, for the options the launcher sets itself."""
    import ipyparallel as ipp

    cluster = ipp.Cluster(
        profile_dir=profile_dir,
        n=config.world.n,
        delay=0,
        send_engines_connection_env=False,  # engines read the 0600 connection file, not an env var
        engine_timeout=int(config.world.timeout),
        controller_ip=ip,
        controller_args=[
            "--usethreads",
            f"--HeartMonitor.period={config.world.heartbeat_ms}",
            f"--HeartMonitor.max_heartmonitor_misses={heart_misses(config.world.n)}",
            f"--IPController.registration_timeout={registration_timeout(config.world.timeout)}",
        ],
        controller="Local",
        engines=engines,
        log=IPP_LOG,
        load_profile=False,
        shutdown_atexit=config.world.keep is None,  # a kept world outlives the kernel's exit (a restart)
    )
    if fresh:
        secure_controller(profile_dir)
    steps = os.path.join(os.path.dirname(profile_dir), "steps")  # each engine's step on the way in
    os.makedirs(steps, mode=0o700, exist_ok=True)
    environment = {
        **procs.process_env(config.world.threads or 1, config.world.keep),
        wire.STEPS_ENV: steps,
        **(env or {}),
    }
    c = cluster.config
    c.LocalControllerLauncher.controller_cmd = [sys.executable, "-m", "nbdist.engine.controller"]
    c.LocalControllerLauncher.environment = {
        **environment,
        "NBDIST_CLUSTER_DIR": os.path.dirname(profile_dir),  # the controller removes it when the kernel dies
        **(controller_env or {}),
    }
    section = c[engines.__name__]
    section.engine_cmd = list(ENGINE_CMD)
    section.engine_args = list(engine_args)
    section.environment = dict(environment)
    return cluster, section


def secure_controller(profile_dir: str) -> None:
    """Have the controller use CurveZMQ and keep signing messages: written to its profile's config
    file (in the cluster's 0700 directory; nothing secret on a command line).

    Signing alone does not protect the controller: a local user who cannot read the key can
    still connect to its loopback ports, and libzmq accepts ZMTP 1.0 frames without a
    handshake, which the controller forwards and its schedulers choke on (measured: the next
    cell never reached the engines; tests/shared_node/test_other_user.py). Under CURVE a peer
    that does not know the controller's public key (in the 0600 connection file) cannot finish
    the handshake, so nothing it sends is read. ipyparallel drops the HMAC key when CURVE is on
    unless the Session's key is configured: it is, so messages stay signed too."""
    path = os.path.join(profile_dir, "ipcontroller_config.py")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(f"c.IPController.enable_curve = True\nc.Session.key = b{secrets.token_hex(32)!r}\n")


def launcher_for(config: StartConfig) -> Launcher:
    """A new launcher of the kind ``config.launcher`` names (StartConfig checked the name)."""
    launcher: Launcher = launcher_class(config.launcher)()
    return launcher
