"""Cluster: a ranked set of ipyparallel engines sharing one torch.distributed world.

Start, stop and restart go through ipyparallel's Cluster and launchers; nbdist adds
the rank <-> engine-id map (engine ids change when engines restart), a fast local
start (controller schedulers in threads, fast heartbeats, no fixed sleeps, torch
imported while the controller boots), and processes that end with the kernel.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

from .config import RunConfig, StartConfig, parse_ranks
from .errors import ClusterError, ConfigError, NbdistError

log = logging.getLogger("nbdist")
# ipyparallel logs every engine's whole output at WARNING when it stops an engine;
# nbdist reports failures itself, so only ipyparallel's errors get through.
_IPP_LOG = logging.getLogger("nbdist.ipyparallel")
_IPP_LOG.setLevel(logging.ERROR)

_CURRENT: Cluster | None = None  # the active cluster (strong: it owns processes)
_LIVE: set[Cluster] = set()

# launcher name -> ipyparallel (controller, engine set) launcher names: the seam for
# multi-node. Only "local" is wired up today.
LAUNCHERS = {"local": ("Local", "Local"), "slurm": ("Slurm", "Slurm"), "mpi": ("Local", "MPI")}


@dataclass(slots=True)
class RankInfo:
    """One rank: its torch rank, the ipyparallel engine serving it, and where it runs."""

    rank: int
    engine_id: int
    pid: int = 0
    host: str = ""
    local_rank: int = 0
    local_world_size: int = 1
    cuda_devices: int = 0
    cpus: list[int] | None = None  # the cores this rank is pinned to (None: not pinned)


def current() -> Cluster:
    """The cluster most recently started in this process."""
    cluster = _CURRENT
    if cluster is None or not cluster.running:
        raise ClusterError("no cluster is running; start one with nbdist.start(n=2) or %dist_start -n 2.")
    return cluster


def start(
    n: int = 2, backend: str | None = None, launcher: str = "local", timeout: float = 45.0, **options: Any
) -> Cluster:
    """Start n ranked engines with an initialised process group; return the Cluster."""
    config = StartConfig(n=n, backend=backend, launcher=launcher, timeout=timeout, **options)
    return Cluster(config).start()


class Cluster:
    """n engines, ranks 0..n-1, one process group. Use as a context manager to stop it."""

    def __init__(self, config: StartConfig | None = None, **options: Any) -> None:
        self.config = config or StartConfig(**options)
        self.ranks: list[RankInfo] = []
        self.client: Any = None
        self.backend = ""
        self.master_addr = "127.0.0.1"
        self.master_port = 0
        self.running = False
        self.last: Any = None  # the last run (a RunResult or PendingRun)
        self.startup: dict[str, float] = {}
        self._ipp: Any = None
        self._workdir = ""
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Cluster:
        global _CURRENT
        if self.running:
            return self
        cfg = self.config
        if cfg.launcher != "local":
            raise ConfigError(
                f"launcher {cfg.launcher!r} is not yet supported; use --launcher local "
                "(multi-node launchers go through ipyparallel's Slurm/MPI launchers in a later release)."
            )
        tic = time.perf_counter()
        self._workdir = tempfile.mkdtemp(prefix="nbdist-")
        os.chmod(self._workdir, 0o700)
        try:
            self._start_ipp()
            self.startup["processes"] = time.perf_counter() - tic
            engine_ids = self._wait_for_engines(cfg.n, set(), set())
            self.startup["engines"] = time.perf_counter() - tic
            self.ranks = [RankInfo(rank=i, engine_id=eid) for i, eid in enumerate(engine_ids)]
            self._configure_ranks(self.ranks)
            self._choose_backend()
            from .rendezvous import build_world

            self.startup["world"] = build_world(self)
        except BaseException:
            self.stop()
            raise
        self.startup["total"] = time.perf_counter() - tic
        self.running = True
        _CURRENT = self
        _LIVE.add(self)
        return self

    def _start_ipp(self) -> None:
        import ipyparallel as ipp
        from IPython.core.profiledir import ProfileDir

        cfg = self.config
        profile = ProfileDir.create_profile_dir(os.path.join(self._workdir, "profile"))
        from .pool import ENGINE_CMD, WarmEngineSetLauncher

        controller_name, engine_name = LAUNCHERS[cfg.launcher]
        engines: Any = WarmEngineSetLauncher if engine_name == "Local" else engine_name
        cluster = ipp.Cluster(
            profile_dir=profile.location,
            n=cfg.n,
            delay=0,
            send_engines_connection_env=False,
            engine_timeout=int(cfg.timeout),
            controller_ip="127.0.0.1",
            controller_args=["--usethreads", f"--HeartMonitor.period={cfg.heartbeat_ms}"],
            controller=controller_name,
            engines=engines,
            log=_IPP_LOG,
            load_profile=False,
        )
        env = {
            "NBDIST_PARENT_PID": str(os.getpid()),
            "OMP_NUM_THREADS": str(cfg.threads),
            "NUMBA_NUM_THREADS": str(cfg.threads),
            "PYTHONUNBUFFERED": "1",
        }
        c = cluster.config
        c.LocalControllerLauncher.controller_cmd = [sys.executable, "-m", "nbdist.engine.controller"]
        c.LocalEngineSetLauncher.engine_cmd = list(ENGINE_CMD)
        c.LocalEngineSetLauncher.engine_args = ["--IPEngine.enable_nanny=False"]
        c.LocalEngineSetLauncher.delay = 0.0
        c.LocalProcessLauncher.stop_seconds_until_kill = 2
        for klass in ("LocalControllerLauncher", "LocalEngineSetLauncher"):
            c[klass].environment = dict(env)
        self._ipp = cluster
        cluster.start_controller_sync()
        cluster.start_engines_sync(cfg.n)
        self.client = cluster.connect_client_sync()

    def _engine_launchers(self) -> list[Any]:
        if self._ipp is None:
            return []
        out: list[Any] = []
        for engine_set in list(self._ipp.engines.values()):
            out.extend(getattr(engine_set, "launchers", {}).values())
        return out

    def _wait_for_engines(self, n: int, known: set[int], old_launchers: set[int]) -> list[int]:
        """Wait until n new engines registered; name the missing ranks if they don't.

        ``known`` are engine ids that existed before, ``old_launchers`` the ids of
        launcher objects that existed before this start (their exits are not news).
        """
        deadline = time.monotonic() + self.config.timeout
        before = old_launchers
        while True:
            new = sorted(set(self.client.ids) - known)
            if len(new) >= n:
                return new[:n]
            exited = [el for el in self._engine_launchers() if id(el) not in before and _exited(el)]
            # An engine that exited will never register; report once the others have.
            if (exited and len(new) >= n - len(exited)) or time.monotonic() > deadline:
                missing = n - len(new)
                first_missing = len(self.ranks) if known else len(new)
                names = ", ".join(str(first_missing + i) for i in range(missing))
                why = (
                    f"{len(exited)} engine process(es) exited while starting"
                    if exited
                    else f"they did not register within {self.config.timeout:.0f} s"
                )
                tail = self._engine_log_tail(exited[0]) if exited else ""
                raise ClusterError(
                    f"{missing} of {n} engine(s) did not start, so rank(s) {names} have no engine: {why}."
                    + (f" Engine log: {tail}" if tail else "")
                    + " Check memory and the engine log, then try again (a larger --timeout helps on a busy machine)."
                )
            time.sleep(0.02)

    def _engine_log_tail(self, launcher: Any) -> str:
        path = getattr(launcher, "output_file", "")
        try:
            with open(path, errors="replace") as fh:
                return " | ".join(fh.read().strip().splitlines()[-3:])[-400:]
        except OSError:
            return ""

    def _configure_ranks(self, ranks: list[RankInfo]) -> None:
        from .engine import runtime
        from .rendezvous import master_address, plan_cpus, plan_local_ranks

        infos = self.client[[r.engine_id for r in ranks]].apply_sync(runtime.local_info)
        allowed = {}
        for r, info in zip(ranks, infos, strict=True):
            r.pid, r.host, r.cuda_devices = info["pid"], info["host"], info["cuda_devices"]
            allowed[r.rank] = info["cpus"]
        for r, (local_rank, local_size) in zip(self.ranks, plan_local_ranks([r.host for r in self.ranks]), strict=True):
            r.local_rank, r.local_world_size = local_rank, local_size
        for r in ranks:
            r.cpus = plan_cpus(allowed[r.rank], r.local_rank, r.local_world_size) if self.config.pin else None
        self.master_addr = master_address(self.config.launcher, self.ranks[0].host)
        futures = [
            self.client[r.engine_id].apply_async(
                runtime.configure,
                rank=r.rank,
                world_size=len(self.ranks),
                local_rank=r.local_rank,
                local_world_size=r.local_world_size,
                master_addr=self.master_addr,
                threads=self.config.threads,
                report_dir=self._workdir,
                cpus=r.cpus,
            )
            for r in ranks
        ]
        for fut in futures:
            fut.get(timeout=self.config.timeout)

    def _choose_backend(self) -> None:
        from .rendezvous import choose_backend

        self.backend = choose_backend(
            self.config.backend, [r.cuda_devices for r in self.ranks], [r.local_rank for r in self.ranks]
        )

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def restart(self, ranks: Any = None) -> float:
        """Replace the engines of the given ranks (default: all) and rebuild the world.

        Ranks keep their numbers; the new engines get new engine ids. Ranks that are
        not restarted keep their Python state. Returns seconds taken.
        """
        self._require_started()
        tic = time.perf_counter()
        targets = parse_ranks(ranks, self.world_size)
        with self._lock:
            self._kill_ranks(targets)
            known = set(self.client.ids) | {r.engine_id for r in self.ranks}
            old_launchers = {id(el) for el in self._engine_launchers()}
            self._ipp.start_engines_sync(len(targets))
            new_ids = self._wait_for_engines(len(targets), known, old_launchers)
            replaced = []
            for rank, eid in zip(targets, new_ids, strict=True):
                self.ranks[rank] = RankInfo(rank=rank, engine_id=eid)
                replaced.append(self.ranks[rank])
            self._configure_ranks(replaced)
            self._choose_backend()
            from .rendezvous import rebuild_world

            rebuild_world(self)
        self.running = True
        return time.perf_counter() - tic

    def _kill_ranks(self, ranks: list[int]) -> None:
        """End the engines of these ranks by pid (only processes we started)."""
        import psutil

        ours = {el.pid for el in self._engine_launchers() if getattr(el, "pid", None)}
        procs = []
        for rank in ranks:
            info = self.ranks[rank]
            if info.pid and info.pid in ours:
                try:
                    proc = psutil.Process(info.pid)
                    proc.kill()
                    procs.append(proc)
                except psutil.NoSuchProcess:
                    pass
        psutil.wait_procs(procs, timeout=5)
        deadline = time.monotonic() + 5
        gone = {self.ranks[r].engine_id for r in ranks}
        while gone & set(self.client.ids) and time.monotonic() < deadline:
            time.sleep(0.02)

    def stop(self) -> None:
        """Stop every engine and the controller this cluster started (by pid), remove its files."""
        global _CURRENT
        self.running = False
        pids = self.pids()
        if self.client is not None:
            try:
                self.client.close(linger=0)
            except Exception:
                pass
            self.client = None
        if self._ipp is not None:
            try:
                self._ipp.stop_cluster_sync()
            except Exception as exc:
                log.warning("ipyparallel stop failed (%s); ending processes by pid", exc)
            self._ipp = None
        _reap(pids)
        if self._workdir:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = ""
        if _CURRENT is self:
            _CURRENT = None
        _LIVE.discard(self)

    def pids(self) -> list[int]:
        """Process ids of the controller and engines this cluster started."""
        pids = [r.pid for r in self.ranks if r.pid]
        if self._ipp is not None:
            for el in self._engine_launchers():
                if getattr(el, "pid", None):
                    pids.append(el.pid)
            controller = self._ipp.controller
            if controller is not None and getattr(controller, "pid", None):
                pids.append(controller.pid)
        return sorted(set(pids) | _descendants(pids))

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<nbdist.Cluster {state}: {self.world_size} rank(s), backend={self.backend or '-'}>"

    def _require_started(self) -> None:
        if self.client is None or not self.ranks:
            raise ClusterError("this cluster is stopped; start one with nbdist.start(n=2) or %dist_start -n 2.")

    # ------------------------------------------------------------------ state

    def dead_ranks(self) -> list[int]:
        """Ranks whose engine process has died or left the controller."""
        if self.client is None:
            return [r.rank for r in self.ranks]
        live_ids = set(self.client.ids)
        return [r.rank for r in self.ranks if r.engine_id not in live_ids or (r.pid and not _pid_alive(r.pid))]

    def status(self) -> list[dict[str, Any]]:
        """One row per rank: rank, engine id, host, pid, device, backend, state."""
        self._require_started()
        dead = set(self.dead_ranks())
        queue: dict[int, Any] = {}
        try:
            queue = self.client.queue_status(targets=[r.engine_id for r in self.ranks if r.rank not in dead])
        except Exception:
            pass
        rows = []
        for r in self.ranks:
            if r.rank in dead:
                state = "dead"
            else:
                q = queue.get(r.engine_id, {}) if isinstance(queue, dict) else {}
                state = "busy" if (q.get("queue", 0) or q.get("tasks", 0)) else "idle"
            device = f"cuda:{r.local_rank}" if self.backend == "nccl" else "cpu"
            rows.append(
                {
                    "rank": r.rank,
                    "engine_id": r.engine_id,
                    "host": r.host,
                    "pid": r.pid,
                    "device": device,
                    "cpus": _cpu_list(r.cpus),
                    "backend": self.backend,
                    "state": state,
                }
            )
        return rows

    def engine_ids(self, ranks: list[int]) -> list[int]:
        return [self.ranks[r].engine_id for r in ranks]

    def view(self, ranks: list[int]) -> Any:
        """A DirectView on these ranks' engines, reused while the engine ids stay the same."""
        ids = tuple(self.engine_ids(ranks))
        cache = self.__dict__.setdefault("_views", {})
        view = cache.get(ids)
        if view is None or view.client is not self.client:
            view = cache[ids] = self.client[list(ids)]
        return view

    def signal_ranks(self, ranks: list[int], sig: int = signal.SIGINT) -> None:
        """Send a signal to the engines of these ranks (by pid: local launcher)."""
        for rank in ranks:
            pid = self.ranks[rank].pid
            if pid:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass

    # ------------------------------------------------------------------ work

    def run(
        self,
        code: str,
        ranks: Any = None,
        timeout: float | None = None,
        block: bool = True,
        quiet: bool = False,
        sink: Any = None,
    ) -> Any:
        """Run code on the given ranks; return a RunResult (or a PendingRun if block=False).

        Output is streamed to ``sink`` (default: printed, each line tagged ``[rank N]``).
        A failure on any rank releases ranks left waiting in a collective and is
        reported in the result; call ``result.raise_for_error()`` to turn it into a
        RankError (the magics do).
        """
        from .run import execute

        self._require_started()
        cfg = RunConfig(ranks=parse_ranks(ranks, self.world_size), timeout=timeout, block=block, quiet=quiet)
        return execute(self, code, cfg, sink=sink)

    def push(self, mapping: dict[str, Any], ranks: Any = None) -> None:
        """Send variables to the ranks' namespaces."""
        from .run import push

        self._require_started()
        push(self, mapping, parse_ranks(ranks, self.world_size))

    def pull(self, name: str, ranks: Any = None) -> list[Any]:
        """Fetch a variable from each rank; a list ordered by rank."""
        from .run import pull

        self._require_started()
        return pull(self, name, parse_ranks(ranks, self.world_size))

    def rebuild_world(self) -> float:
        from .rendezvous import rebuild_world

        self._require_started()
        return rebuild_world(self)


def _cpu_list(cpus: list[int] | None) -> str:
    """'0', '0-3' or 'all' for the status table."""
    if not cpus:
        return "all"
    if cpus == list(range(cpus[0], cpus[-1] + 1)) and len(cpus) > 1:
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(map(str, cpus))


def _descendants(pids: list[int]) -> set[int]:
    """Processes started by these processes (the controller forks its heart monitor)."""
    import psutil

    out: set[int] = set()
    for pid in pids:
        try:
            out.update(c.pid for c in psutil.Process(pid).children(recursive=True))
        except psutil.Error:
            pass
    return out


def _pid_alive(pid: int) -> bool:
    """Is this process running (not gone, not a zombie)? Reads /proc directly: this is on every cell's path."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (not Linux): ask psutil
        import psutil

        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] not in (b"Z", b"X")


def _exited(launcher: Any) -> bool:
    """Has this launcher's process ended? (Asks the process; launcher.state lags behind.)"""
    popen = getattr(launcher, "_popen_process", None)
    if popen is not None:
        return popen.poll() is not None
    return getattr(launcher, "state", "") == "after"


def _reap(pids: list[int], timeout: float = 3.0) -> None:
    """Make sure the given processes (ours, by id) are gone: TERM, then KILL."""
    import psutil

    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    if not procs:
        return
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=timeout)


def stop_all() -> None:
    """Stop every cluster started in this process."""
    for cluster in list(_LIVE):
        try:
            cluster.stop()
        except NbdistError:
            pass
