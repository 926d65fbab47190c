"""``--launcher ray``: each rank's engine in a process that Ray places on its nodes (a KubeRay cluster, a Ray
cluster on Slurm, or one started by hand), so a notebook on Kubernetes gets what a notebook on Slurm has.

Two sides (this file; the driver's world and its serving are rayworld.py and rayserve.py):

- in the kernel, ``RayLauncher`` (a ``ManyHostsLauncher``): the controller binds the interface that routes to
  the Ray address, and the engine set is one local process, this module run as a program (``RayEngines``, an
  mpiexec-like engine-set launcher): the kernel never imports Ray;
- that process is a Ray driver (``ray.init(address)``: ``ray://head:10001`` from outside the cluster through Ray
  Client, as a Zero to JupyterHub pod reaches KubeRay; the local node, or ``RAY_ADDRESS``, from inside). It
  checks that the cluster has the CPUs and GPUs for every rank at all (else it says what is missing, at once),
  and places and starts the ranks (rayworld.py: all or none, a node's ranks together, one actor per rank; the
  first engines start cold, later ones are forks of their node's warm process, made once the world formed).
  ``NBDIST_LAUNCH_RANK`` orders the ranks; the engines' output is relayed to this process's own.
- a later engine set of the same world (``%dist_restart``, recovery, ``%dist_grow``) is this program too, but it
  asks the world's first driver to start its ranks (rayserve.py) instead of connecting to Ray itself.

While the process lives the engines live; when it ends (``%dist_stop``, the kernel's death: it watches the
kernel) it stops every engine, kills every actor it made and removes its placement groups, and Ray ends the
actors of a driver that is gone in any case. Signals reach the engines through ipyparallel's nanny, as on Slurm.
The engines read the cluster's 0600 connection file from its private directory, which the Ray nodes must see (a
home directory on shared storage, or ``$NBDIST_WORKDIR``), as with Slurm.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from .. import wire
from ..config import LauncherSpec, StartConfig, option
from ..errors import ConfigError
from . import rayserve, rayworld
from .across import HostsOptions, ManyHostsLauncher

RAY_RANGE = ((2, 40), (3, 0))  # the Ray versions this launcher is tested with: from 2.40 up to, not with, 3.0
RANK_VAR = rayworld.RANK_VAR
missing = rayworld.missing
PREFLIGHT = "preflight-ray.txt"  # in the cluster's directory: registration stops at once with its line
ENDED = "ray-ended.txt"  # in the cluster's directory: why the world's driver ended the ranks it held
WAITING = "ray-waiting.txt"  # what the placement waits for, while it waits (RayLauncher.queue reads it)
PASSED = ("NBDIST_", "IPP_", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS")


@dataclass(kw_only=True)
class RayOptions(HostsOptions):
    """Which Ray cluster, and how many GPUs each rank's actor takes."""

    address: str | None = option(
        help="the Ray cluster, e.g. ray://HEAD:10001 (default: RAY_ADDRESS, else this node)", metavar="ADDR"
    )
    gpus_per_rank: float | None = option(help="GPUs Ray gives each rank", metavar="G")

    def check(self, n: int) -> None:
        super().check(n)
        if self.gpus_per_rank is not None and not 0 <= self.gpus_per_rank <= 8:
            raise ConfigError(f"--gpus-per-rank ({self.gpus_per_rank}) must be from 0 to 8, e.g. 1 (or 0.5 to share).")


def ray_address(config: StartConfig) -> str:
    """``--address``, else ``RAY_ADDRESS``, else '' (the Ray node this kernel runs on)."""
    return config.options_as(RayOptions).address or os.environ.get("RAY_ADDRESS", "")


class RayLauncher(ManyHostsLauncher):
    """Engines as Ray actors (see the module's docstring)."""

    spec = LauncherSpec(
        "ray",
        "Ray actors on a Ray cluster (KubeRay, or ray start): --address ray://HEAD:10001 from outside it",
        options=RayOptions,
    )
    rank_vars = (RANK_VAR,)

    def __init__(self) -> None:
        super().__init__()
        self.workdir = ""

    def cluster(self, config: StartConfig, profile_dir: str, fresh: bool = True) -> Any:
        self.workdir = os.path.dirname(profile_dir)
        return super().cluster(config, profile_dir, fresh)

    def engine_set(self) -> type:
        return _engines()

    def node_addresses(self, config: StartConfig) -> list[str]:
        host = urlparse(ray_address(config) if "://" in ray_address(config) else f"x://{ray_address(config)}").hostname
        return [host] if host else [_local_node_address()]

    def configure_engines(self, c: Any, config: StartConfig) -> None:
        cpus = config.world.threads or 1
        c.mpi_cmd = [sys.executable, "-m", "nbdist.launch.ray", "--address", ray_address(config), "--cpus", str(cpus)]
        c.mpi_cmd += [
            "--gpus",
            str(config.options_as(RayOptions).gpus_per_rank or 0),
            "--wait",
            str(config.world.timeout),
        ]
        c.mpi_args = []

    def queue(self, engine_launchers: list[Any]) -> tuple[str, list[Any]]:
        try:
            with open(os.path.join(self.workdir, WAITING)) as fh:
                return fh.read().strip(), []
        except OSError:
            return "", []

    def formed(self) -> None:
        rayserve.ahead(self.workdir)  # the nodes' warm processes, for ranks replaced or added later

    def why_gone(self) -> str:
        try:
            with open(os.path.join(self.workdir, ENDED)) as fh:
                return fh.read().strip()
        except OSError:
            return ""

    def unreachable_hint(self) -> str:
        if os.path.exists(os.path.join(self.workdir, PREFLIGHT)):
            return ""  # Ray's own answer: the line says what is missing and what to do
        return super().unreachable_hint()


def _local_node_address() -> str:
    """The address of the Ray node this kernel runs on (Ray writes its GCS address there), or loopback."""
    try:
        with open(os.path.join(os.environ.get("RAY_TMPDIR", "/tmp"), "ray", "ray_current_cluster")) as fh:
            return fh.read().strip().rsplit(":", 1)[0] or "127.0.0.1"
    except OSError:
        return "127.0.0.1"


@functools.cache
def _engines() -> type:
    """The engine-set launcher: this module as an mpiexec that takes ``-n N`` and the engine's command."""
    from ipyparallel.cluster.launcher import MPIEngineSetLauncher

    class RayEngines(MPIEngineSetLauncher):  # type: ignore[misc]
        """One local process (a Ray driver) that holds n engines on the Ray cluster."""

        @property
        def program(self) -> list[str]:
            return list(self.engine_cmd)  # not MPIEngineSetLauncher's --mpi: the rank comes from RANK_VAR

    return RayEngines


# ----------------------------------------------------------------------------- the driver process


def check_version(version: str) -> str:
    """'' when this Ray version is in RAY_RANGE, else the line that says so."""
    have = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    low, high = RAY_RANGE
    if low <= have < high:
        return ""
    return (
        f"Ray {version} is outside the versions --launcher ray is tested with ({low[0]}.{low[1]} up to, not with, "
        f"{high[0]}.{high[1]}); pip install 'ray[client]>={low[0]}.{low[1]},<{high[0]}.{high[1]}'."
    )


def say_preflight(line: str) -> None:
    cluster_dir = os.environ.get("NBDIST_CLUSTER_DIR", "")
    if cluster_dir:
        wire.write_private(os.path.join(cluster_dir, PREFLIGHT), line + "\n")  # read as soon as it exists
    print(f"nbdist: {line}", flush=True)


def _waiting(line: str) -> None:
    cluster_dir = os.environ.get("NBDIST_CLUSTER_DIR", "")
    if cluster_dir:
        path = os.path.join(cluster_dir, WAITING)
        if line:
            with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as fh:
                fh.write(line)
        else:
            _remove(path)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m nbdist.launch.ray")
    parser.add_argument("--address", default="")
    parser.add_argument("--cpus", type=float, default=1)
    parser.add_argument("--gpus", type=float, default=0)
    parser.add_argument("--wait", type=float, default=45)
    parser.add_argument("-n", type=int, required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    cluster_dir = os.environ.get("NBDIST_CLUSTER_DIR", "")
    env = {k: v for k, v in os.environ.items() if k.startswith(PASSED) and k != "NBDIST_PARENT_PID"}
    # a later engine set of a world (%dist_restart, recovery, grow) is started by the world's driver, in the bundles
    # it holds (warm unless NBDIST_WARM=0): a driver of its own would wait for the CPUs the world keeps for it
    served = rayserve.ask(cluster_dir, args.n, args.command, env, say=_say, waiting=_waiting, preflight=say_preflight)
    if served is not None:  # the world's driver started them, and they have ended
        return served
    low, high = RAY_RANGE
    try:
        import ray
    except ImportError as exc:
        say_preflight(
            f"--launcher ray needs Ray in the kernel's Python, {sys.executable} ({exc}): pip install "
            f"'ray[client]>={low[0]}.{low[1]},<{high[0]}.{high[1]}' there, or start with another --launcher."
        )
        return 2
    why = check_version(str(getattr(ray, "__version__", "?")))
    if why:
        say_preflight(why)
        return 2
    where = args.address or "the Ray node of this host (RAY_ADDRESS unset)"
    # The kernel's wait says so, and its --timeout does not run meanwhile: Ray Client may take a minute (a server
    # for this client that died starting is found only after 30 s, then _connect tries again); bounded here.
    _say(f"nbdist: connecting to the Ray cluster at {args.address or 'auto'}")
    _waiting(f"connecting to the Ray cluster at {where}")
    watchdog = threading.Timer(CONNECT_LIMIT_S, _connect_timed_out, (where,))
    watchdog.daemon = True
    watchdog.start()
    try:
        _connect(ray, args.address or "auto")
    except Exception as exc:
        say_preflight(f"cannot reach the Ray cluster at {where}: {connect_failure(exc)}")
        return 2
    finally:
        watchdog.cancel()
        _waiting("")
    world = rayworld.World(ray, args.cpus, args.gpus, env)
    _say(f"nbdist: connected; placing {args.n} rank(s)")
    short = world.cannot_hold(args.n)
    if short:
        say_preflight(short)
        return 2
    server: rayserve.Server | None = None

    def on_sigterm(*_: Any) -> None:
        if server is not None:
            server.close()
        world.clean_up()
        _waiting("")
        os._exit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    kept, placed = bool(os.environ.get(wire.KEEP_ENV)), threading.Event()

    def kernel_gone() -> None:  # end what this process holds; a kept world (--keep) that has its ranks outlives
        if not (kept and placed.is_set()):  # its kernel, and its engines end it once idle past --keep
            on_sigterm()

    _watch_kernel(kernel_gone)
    try:
        # the kernel's wait says what the placement waits for, and Ctrl-C there ends it (and so this process)
        try:
            first = world.start(args.n, args.command, say=_say, waiting=_waiting, placed=placed.set)
        except rayworld.NodeLeft as exc:
            say_preflight(str(exc))
            return 2
        if cluster_dir:
            _remove(os.path.join(cluster_dir, ENDED))  # a world started again after its driver failed
            server = rayserve.Server(cluster_dir, world)  # the world's later engine sets start here
        try:
            return rayserve.keep_polling(world, first, server, _say)
        except Exception as exc:  # the ranks end with this process: the notebook's note of their deaths says why
            why = rayserve.first_line(exc)
            say_ended(f"the Ray driver that held the world's ranks failed and ended them ({why})")
            raise
    finally:
        if server is not None:
            server.close()
        world.clean_up()
        _waiting("")


def say_ended(line: str) -> None:
    """Why this driver ended a world that had formed, where the notebook reads it (``RayLauncher.why_gone``)."""
    cluster_dir = os.environ.get("NBDIST_CLUSTER_DIR", "")
    if cluster_dir:
        wire.write_private(os.path.join(cluster_dir, ENDED), line + "\n")
    print(f"nbdist: {line}", flush=True)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _say(line: str) -> None:
    print(line, flush=True)


def _watch_kernel(gone: Any) -> None:
    """Call ``gone()`` from a thread once the process that started this one (the kernel) has ended: we are
    re-parented (engine/parentwatch.py does the same for the controller and the engines)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        gone()

    threading.Thread(target=watch, name="nbdist-ray-kernel", daemon=True).start()


CONNECT_LIMIT_S = 150.0  # Ray Client's own bound on three tries is about 110 s


def _connect_timed_out(where: str) -> None:
    say_preflight(
        f"the Ray cluster at {where} did not answer within {CONNECT_LIMIT_S:.0f} s: its head's Ray Client server "
        "logs say why (ray_client_server*.err in /tmp/ray/session_latest/logs on the head); start again once it "
        "answers."
    )
    os._exit(2)


def connect_failure(exc: BaseException) -> str:
    """What a failed ``ray.init`` says, and what to do. Ray Client's server that answered but could not serve this
    client ('Initialization failure from server:') sends its traceback: its last line says what failed on the head."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
    if INIT_FAILED in lines[0]:
        said = lines[-1][:300] if len(lines) > 1 else "no reason given"
        known = (
            " A server that dies as it starts is Ray's known fault under load (ray-project/ray#63202): start the "
            "head with GRPC_ENABLE_FORK_SUPPORT=0 in its environment."
            if SERVER_DIED in said
            else ""
        )
        return (
            f"its Ray Client server answered but could not serve this client ({said}): the head's "
            "ray_client_server*.err (in /tmp/ray/session_latest/logs unless it set --temp-dir) say why; start again "
            f"once it serves.{known}"
        )
    return (
        f"{lines[0][:200]}. Name its head with --address ray://HEAD:10001 (Ray Client), or start the notebook on a "
        "Ray node."
    )


INIT_FAILED = "Initialization failure"  # how Ray Client says its server answered but refused this client
SERVER_DIED = "Starting Ray client server failed"  # its reason when the server it started for the client died


def _connect(ray: Any, address: str, tries: int = 3) -> None:
    """ray.init, tried again a moment later: Ray Client's server may refuse a new client while it still ends the
    session of the one before ('Initialization failure from server'). A Ray Client address is first tried with a
    plain TCP connection, so one where nothing answers is said in seconds (Ray Client itself tries for ~35 s)."""
    from . import net

    if address.startswith("ray://"):
        where = urlparse(address)
        reason = net.connect_error(where.hostname or "", where.port or 10001, timeout=5)
        if reason:
            why = net.likely_fix(
                reason,
                unreachable="no host answers at that address: is it the head's?",
                refused="the host is there but nothing listens on that port: the head's Ray Client port is 10001 "
                "by default",
                other="a firewall or a network policy drops the traffic, or the head is not up yet",
            )
            raise ConnectionError(f"{reason} ({why})")
    for attempt in range(tries):
        try:
            # the engines' output comes through files, not Ray (rayworld.Logs): its relay cost seconds here
            ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
            return
        except ConnectionError as exc:
            if attempt == tries - 1 or INIT_FAILED not in str(exc):
                raise  # not there at all (Ray Client tried for about 35 s): no use trying again
            time.sleep(2.0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
