"""The engines of one cluster: their processes, the rank <-> engine-id table, and what reaches them.

``EngineSet`` owns the ipyparallel cluster a launcher configured (controller, engines,
client). Engine ids change when engines are replaced; ranks do not, so everything
here is addressed by rank. Processes are ended by pid, only those this set started.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import time
from dataclasses import dataclass
from typing import Any

from . import procs
from .config import StartConfig
from .errors import ClusterError
from .launchers import Launcher
from .results import RankState, remote_error

log = logging.getLogger("nbdist")


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


class EngineSet:
    """The controller and engines behind one Cluster, with ranks 0..n-1."""

    def __init__(self, config: StartConfig, launcher: Launcher, workdir: str) -> None:
        self.config = config
        self.launcher = launcher
        self.workdir = workdir  # private to this cluster (0700): profile, rank reports
        self.ranks: list[RankInfo] = []
        self.client: Any = None
        self._ipp: Any = None
        self._views: dict[tuple[int, ...], Any] = {}

    # ------------------------------------------------------------------ processes

    def start(self) -> list[RankInfo]:
        """Start the controller and n engines; return ranks 0..n-1 in the order engines registered."""
        from IPython.core.profiledir import ProfileDir

        profile = ProfileDir.create_profile_dir(os.path.join(self.workdir, "profile"))
        self._ipp = self.launcher.cluster(self.config, profile.location)
        self._ipp.start_controller_sync()
        self._ipp.start_engines_sync(self.config.n)
        self.client = self._ipp.connect_client_sync()
        ids = self._wait_for_engines(self.config.n, known=set(), old_launchers=set())
        self.ranks = [RankInfo(rank=i, engine_id=eid) for i, eid in enumerate(ids)]
        return self.ranks

    def replace(self, ranks: list[int]) -> list[RankInfo]:
        """Kill these ranks' engines and start new ones for the same ranks; return their new RankInfos."""
        self.kill(ranks)
        known = set(self.client.ids) | {r.engine_id for r in self.ranks}
        old_launchers = {id(el) for el in self._launchers()}
        self._ipp.start_engines_sync(len(ranks))
        new_ids = self._wait_for_engines(len(ranks), known, old_launchers)
        for rank, eid in zip(ranks, new_ids, strict=True):
            self.ranks[rank] = RankInfo(rank=rank, engine_id=eid)
        return [self.ranks[r] for r in ranks]

    def _launchers(self) -> list[Any]:
        if self._ipp is None:
            return []
        out: list[Any] = []
        for engine_set in list(self._ipp.engines.values()):
            out.extend(getattr(engine_set, "launchers", {}).values())
        return out

    def _wait_for_engines(self, n: int, known: set[int], old_launchers: set[int]) -> list[int]:
        """Wait until n new engines registered; name the missing ranks if they don't (docs/faults.md, row 7).

        ``known`` are engine ids that existed before, ``old_launchers`` the ids of
        launcher objects that existed before this start (their exits are not news).
        """
        deadline = time.monotonic() + self.config.timeout
        while True:
            new = sorted(set(self.client.ids) - known)
            if len(new) >= n:
                return new[:n]
            exited = [el for el in self._launchers() if id(el) not in old_launchers and procs.exited(el)]
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
                tail = _log_tail(getattr(exited[0], "output_file", "")) if exited else ""
                raise ClusterError(
                    f"{missing} of {n} engine(s) did not start, so rank(s) {names} have no engine: {why}."
                    + (f" Engine log: {tail}" if tail else "")
                    + " Check memory and the engine log, then try again (a larger --timeout helps on a busy machine)."
                )
            time.sleep(0.02)

    def kill(self, ranks: list[int]) -> None:
        """End the engines of these ranks by pid (only processes this set started); wait until they left."""
        ours = {el.pid for el in self._launchers() if getattr(el, "pid", None)}
        procs.kill([self.ranks[r].pid for r in ranks if self.ranks[r].pid in ours])
        deadline = time.monotonic() + 5
        gone = {self.ranks[r].engine_id for r in ranks}
        while gone & set(self.client.ids) and time.monotonic() < deadline:
            time.sleep(0.02)

    def signal(self, ranks: list[int], sig: int = signal.SIGINT) -> None:
        """Send a signal to the engines of these ranks (by pid: the engines run on this host)."""
        for rank in ranks:
            pid = self.ranks[rank].pid
            if pid:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass

    def pids(self) -> list[int]:
        """Process ids of the controller and engines this set started, and their children."""
        pids = [r.pid for r in self.ranks if r.pid]
        if self._ipp is not None:
            pids.extend(el.pid for el in self._launchers() if getattr(el, "pid", None))
            controller = self._ipp.controller
            if controller is not None and getattr(controller, "pid", None):
                pids.append(controller.pid)
        return sorted(set(pids) | procs.descendants(pids))

    def stop(self) -> None:
        """Stop every engine and the controller (through ipyparallel, then by pid)."""
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
        procs.reap(pids)

    # ------------------------------------------------------------------ state

    def dead_ranks(self) -> list[int]:
        """Ranks whose engine process has died or left the controller."""
        if self.client is None:
            return [r.rank for r in self.ranks]
        live = set(self.client.ids)
        return [r.rank for r in self.ranks if r.engine_id not in live or (r.pid and not procs.alive(r.pid))]

    def states(self) -> dict[int, RankState]:
        """Each rank's state now: dead, busy (running or queued work) or idle."""
        dead = set(self.dead_ranks())
        queue: Any = {}
        try:
            queue = self.client.queue_status(targets=[r.engine_id for r in self.ranks if r.rank not in dead])
        except Exception:
            pass
        out = {}
        for r in self.ranks:
            q = queue.get(r.engine_id, {}) if isinstance(queue, dict) else {}
            busy = q.get("queue", 0) or q.get("tasks", 0)
            out[r.rank] = RankState.DEAD if r.rank in dead else (RankState.BUSY if busy else RankState.IDLE)
        return out

    def where(self, ranks: list[int], wait: float = 0.5) -> dict[int, dict[str, Any]]:
        """Where these ranks are now: SIGUSR1 makes each one's watcher write its stack summary."""
        paths = {r: os.path.join(self.workdir, f"rank{r}.json") for r in ranks}
        for path in paths.values():
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self.signal(ranks, signal.SIGUSR1)
        reports: dict[int, dict[str, Any]] = {}
        end = time.monotonic() + wait
        while time.monotonic() < end and len(reports) < len(paths):
            for rank, path in paths.items():
                if rank not in reports and os.path.exists(path):
                    try:
                        with open(path) as fh:
                            reports[rank] = json.load(fh)
                    except (OSError, ValueError):
                        pass
            time.sleep(0.01)
        return reports

    # ------------------------------------------------------------------ reaching the engines

    def engine_ids(self, ranks: list[int]) -> list[int]:
        return [self.ranks[r].engine_id for r in ranks]

    def view(self, ranks: list[int]) -> Any:
        """A DirectView on these ranks' engines, reused while the engine ids stay the same."""
        ids = tuple(self.engine_ids(ranks))
        view = self._views.get(ids)
        if view is None or view.client is not self.client:
            view = self._views[ids] = self.client[list(ids)]
        return view

    def apply(self, rank: int, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        """Call fn on one rank's engine; an AsyncResult."""
        return self.client[self.ranks[rank].engine_id].apply_async(fn, *args, **kwargs)

    def push(self, mapping: dict[str, Any], ranks: list[int]) -> None:
        """Send variables to these ranks' namespaces (docs/faults.md, row 8: unpicklable values named)."""
        for name, value in mapping.items():
            _check_picklable(name, value)
        self.client[self.engine_ids(ranks)].push(mapping, block=True)

    def pull(self, name: str, ranks: list[int]) -> list[Any]:
        """A variable's value on each of these ranks, in rank order."""
        out = []
        for rank in ranks:
            eid = self.ranks[rank].engine_id
            try:
                out.append(self.client[eid].pull(name, block=True))
            except Exception as exc:
                raise self._pull_error(name, rank, eid, exc) from None
        return out

    def _pull_error(self, name: str, rank: int, eid: int, exc: BaseException) -> ClusterError:
        err = remote_error(exc)
        if err["ename"] == "NameError":
            return ClusterError(
                f"rank {rank} (engine {eid}) has no variable {name!r}; define it in a %%distributed cell first."
            )
        try:
            from ipyparallel import interactive

            kind = self.client[eid].apply_sync(interactive(_type_name), name)
        except Exception:
            kind = "unknown"
        hint = " Move it to the CPU first (.cpu())." if "cuda" in kind.lower() else ""
        return ClusterError(
            f"cannot fetch {name!r} (type {kind}) from rank {rank} (engine {eid}): {err['ename']}: "
            f"{err['evalue']}. Convert it to a picklable value (a number, list, numpy array or CPU tensor)"
            f" on the ranks first.{hint}"
        )


def _log_tail(path: str) -> str:
    try:
        with open(path, errors="replace") as fh:
            return " | ".join(fh.read().strip().splitlines()[-3:])[-400:]
    except OSError:
        return ""


def _check_picklable(name: str, value: Any) -> None:
    try:
        import cloudpickle as pickler  # what ipyparallel uses for functions and closures
    except ImportError:  # pragma: no cover
        pickler = pickle  # type: ignore[no-redef]
    try:
        pickler.dumps(value)
    except Exception as exc:
        raise ClusterError(
            f"cannot send {name!r} (type {type(value).__module__}.{type(value).__qualname__}) to the ranks: "
            f"{type(exc).__name__}: {exc}. Send a simpler value (numbers, lists, dicts, numpy arrays, "
            "CPU tensors: use .cpu()), or build it inside a %%distributed cell."
        ) from exc


def _type_name(name: str) -> str:
    """On an engine: the type (and device) of a variable in its namespace."""
    value = globals()[name]
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    device = getattr(value, "device", None)
    return f"{kind} on {device}" if device is not None else kind
