"""``--launcher ray``: each rank's engine in a process that Ray places on its nodes (a KubeRay cluster, a Ray
cluster on Slurm, or one started by hand), so a notebook on Kubernetes gets what a notebook on Slurm has.

Two sides, one file:

- in the kernel, ``RayLauncher`` (a ``ManyHostsLauncher``): the controller binds the interface that routes to
  the Ray address, and the engine set is one local process, this module run as a program (``RayEngines``, an
  mpiexec-like engine-set launcher): the kernel never imports Ray;
- that process is a Ray driver (``ray.init(address)``: ``ray://head:10001`` from outside the cluster through Ray
  Client, as a Zero to JupyterHub pod reaches KubeRay; the local node, or ``RAY_ADDRESS``, from inside). It
  checks that the cluster has the CPUs and GPUs for every rank at all (else it says what is missing, at once),
  places all the ranks or none with a placement group (``PACK``: ranks of a node together), orders them node by
  node, and starts one actor per rank on the node its bundle got; each actor runs nbdist's engine as its child
  (``NBDIST_LAUNCH_RANK`` orders the ranks). The group is removed once the actors hold their CPUs and GPUs, so
  a rank replaced later (``%dist_restart``, recovery) is placed as a new engine set of its own.

While the process lives the engines live; when it ends (``%dist_stop``, the kernel's death: it watches the
kernel) it stops every engine, kills every actor it made and removes its placement group, and Ray ends the
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
from typing import Any
from urllib.parse import urlparse

from .. import wire
from ..config import LauncherSpec, StartConfig
from .across import ManyHostsLauncher

RAY_RANGE = ((2, 40), (3, 0))  # the Ray versions this launcher is tested with: from 2.40 up to, not with, 3.0
RANK_VAR = "NBDIST_LAUNCH_RANK"
PREFLIGHT = "preflight-ray.txt"  # in the cluster's directory: registration stops at once with its line
WAITING = "ray-waiting.txt"  # what the placement waits for, while it waits (RayLauncher.queue reads it)
PASSED = ("NBDIST_", "IPP_", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS")


def ray_address(config: StartConfig) -> str:
    """``--address``, else ``RAY_ADDRESS``, else '' (the Ray node this kernel runs on)."""
    return config.address or os.environ.get("RAY_ADDRESS", "")


class RayLauncher(ManyHostsLauncher):
    """Engines as Ray actors (see the module's docstring)."""

    spec = LauncherSpec(
        "ray",
        "Ray actors on a Ray cluster (KubeRay, or ray start): --address ray://HEAD:10001 from outside it",
        options=("address", "gpus_per_rank"),
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
        cpus = config.threads or 1
        c.mpi_cmd = [sys.executable, "-m", "nbdist.launch.ray", "--address", ray_address(config), "--cpus", str(cpus)]
        c.mpi_cmd += ["--gpus", str(config.gpus_per_rank or 0), "--wait", str(config.timeout)]
        c.mpi_args = []

    def queue(self, engine_launchers: list[Any]) -> tuple[str, list[Any]]:
        try:
            with open(os.path.join(self.workdir, WAITING)) as fh:
                return fh.read().strip(), []
        except OSError:
            return "", []

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


def missing(need: dict[str, float], total: dict[str, float]) -> str:
    """What the cluster lacks for ``need`` at all (its whole size, not what is free now), in words; ''."""
    short = [f"{need[k]:g} {k} (it has {total.get(k, 0):g})" for k in need if need[k] and total.get(k, 0) < need[k]]
    return ", ".join(short)


class _Engine:
    """A Ray actor holding one rank's engine, its child."""

    def start(self, cmd: list[str], env: dict[str, str]) -> tuple[str, int]:
        import socket
        import subprocess

        self.proc = subprocess.Popen(cmd, env={**os.environ, **env}, preexec_fn=_die_with_parent)
        return socket.gethostname(), self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _die_with_parent() -> None:
    """In the engine, before it runs: end with the actor that started it (prctl PR_SET_PDEATHSIG), and take
    signals as a process of its own would: a Ray worker ignores SIGINT, and an ignored signal stays ignored
    across exec, so the engine would never see an interrupt (Python installs its SIGINT handler only where the
    signal is at its default)."""
    import ctypes

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


def _say_preflight(line: str) -> None:
    cluster_dir = os.environ.get("NBDIST_CLUSTER_DIR", "")
    if cluster_dir:
        path = os.path.join(cluster_dir, PREFLIGHT)
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as fh:
            fh.write(line + "\n")
    print(f"nbdist: {line}", flush=True)


def _waiting(line: str) -> None:
    cluster_dir = os.environ.get("NBDIST_CLUSTER_DIR", "")
    if cluster_dir:
        path = os.path.join(cluster_dir, WAITING)
        if line:
            with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as fh:
                fh.write(line)
        else:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m nbdist.launch.ray")
    parser.add_argument("--address", default="")
    parser.add_argument("--cpus", type=float, default=1)
    parser.add_argument("--gpus", type=float, default=0)
    parser.add_argument("--wait", type=float, default=45)
    parser.add_argument("-n", type=int, required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    low, high = RAY_RANGE
    try:
        import ray
    except ImportError as exc:
        _say_preflight(
            f"--launcher ray needs Ray in the kernel's Python, {sys.executable} ({exc}): pip install "
            f"'ray[client]>={low[0]}.{low[1]},<{high[0]}.{high[1]}' there, or start with another --launcher."
        )
        return 2
    why = check_version(str(getattr(ray, "__version__", "?")))
    if why:
        _say_preflight(why)
        return 2
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    try:
        _connect(ray, args.address or "auto")
    except Exception as exc:
        where = args.address or "the Ray node of this host (RAY_ADDRESS unset)"
        _say_preflight(
            f"cannot reach the Ray cluster at {where}: {str(exc).splitlines()[0][:200]}. Name its head with --address "
            "ray://HEAD:10001 (Ray Client), or start the notebook on a Ray node."
        )
        return 2
    need = {"CPU": args.cpus * args.n, "GPU": args.gpus * args.n}
    short = missing(need, ray.cluster_resources())
    if short:
        _say_preflight(
            f"the Ray cluster cannot hold {args.n} rank(s) of {args.cpus:g} CPU"
            + (f" and {args.gpus:g} GPU" if args.gpus else "")
            + f" each: it lacks {short}. Start fewer ranks (-n), add Ray nodes, or ask less per rank (--threads)."
        )
        return 2
    bundle = {"CPU": args.cpus, **({"GPU": args.gpus} if args.gpus else {})}
    group = placement_group([bundle] * args.n, strategy="PACK")
    actors: list[Any] = []
    done = False

    def clean_up(*_: Any) -> None:
        nonlocal done
        if done:
            return
        done = True
        for actor in actors:
            try:
                ray.get(actor.stop.remote(), timeout=5)
            except Exception:  # gone already (let go above), or its node is
                pass
            try:
                ray.kill(actor)
            except Exception:
                pass
        try:
            remove_placement_group(group)
        except Exception:
            pass
        _waiting("")

    def on_sigterm(*_: Any) -> None:
        clean_up()
        os._exit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    kept, placed = bool(os.environ.get(wire.KEEP_ENV)), threading.Event()

    def kernel_gone() -> None:  # end what this process holds; a kept world (--keep) that has its ranks outlives
        if not (kept and placed.is_set()):  # its kernel, and its engines end it once idle past --keep
            on_sigterm()

    _watch_kernel(kernel_gone)
    while _not_ready(ray, group):  # the kernel's wait says this, and Ctrl-C there ends it (and so this process)
        free = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
        _waiting(f"Ray has not placed the {args.n} rank(s) yet ({bundle} each; free now: {free})")
    _waiting("")
    placed.set()
    nodes = placement_group_table(group)["bundles_to_node_id"]
    ip = {n["NodeID"]: tuple(int(p) for p in n["NodeManagerAddress"].split(".") if p.isdigit()) for n in ray.nodes()}
    order = sorted(range(args.n), key=lambda i: (ip.get(nodes[i], ()), i))  # a node's ranks together, nodes by address
    remove_placement_group(group)  # the actors below hold the same CPUs and GPUs on the same nodes
    engine = ray.remote(_Engine)
    env = {k: v for k, v in os.environ.items() if k.startswith(PASSED) and k != "NBDIST_PARENT_PID"}
    for i in order:
        actor = engine.options(
            num_cpus=args.cpus,
            num_gpus=args.gpus,
            scheduling_strategy=NodeAffinitySchedulingStrategy(nodes[i], soft=False),
        ).remote()
        actors.append(actor)
    started = ray.get([a.start.remote(args.command, {**env, RANK_VAR: str(r)}) for r, a in enumerate(actors)])
    for rank, (host, pid) in enumerate(started):
        print(f"nbdist: launch rank {rank} on {host}, pid {pid}", flush=True)
    live, worst = dict(enumerate(actors)), 0
    try:
        while live:  # an engine that ended gives its CPUs and GPUs back at once: its replacement may need them
            codes = ray.get([a.poll.remote() for a in live.values()])
            for (rank, actor), code in zip(list(live.items()), codes, strict=True):
                if code is not None:
                    print(f"nbdist: launch rank {rank}'s engine ended ({code}); its actor is let go", flush=True)
                    ray.kill(actor)
                    del live[rank]
                    worst = max(worst, abs(code))
            time.sleep(0.5)
        return worst
    finally:
        clean_up()


def _watch_kernel(gone: Any) -> None:
    """Call ``gone()`` from a thread once the process that started this one (the kernel) has ended: we are
    re-parented (engine/parentwatch.py does the same for the controller and the engines)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        gone()

    threading.Thread(target=watch, name="nbdist-ray-kernel", daemon=True).start()


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
            ray.init(address=address, log_to_driver=True, logging_level=logging.WARNING)
            return
        except ConnectionError as exc:
            if attempt == tries - 1 or "Initialization failure" not in str(exc):
                raise  # not there at all (Ray Client tried for about 35 s): no use trying again
            time.sleep(2.0)


def _not_ready(ray: Any, group: Any) -> bool:
    ready, _ = ray.wait([group.ready()], timeout=0.5)
    return not ready


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
