"""The engines of one cluster: their processes, the rank <-> engine-id table, and what reaches them.

``EngineSet`` owns the ipyparallel cluster a launcher configured (controller, engines,
client). Engine ids change when engines are replaced; ranks do not, so everything
here is addressed by rank. Processes are ended by pid, only those this set started.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Any

from .. import compat
from ..config import StartConfig
from ..launch import procs
from ..launch.launchers import Launcher
from ..results import RankState
from . import registration
from .answers import Answers, Call, wait_releasing
from .board import Board, RankNow
from .published import Published
from .rankinfo import RankInfo
from .spare import Spare, wanted
from .standby import Standby, arrived

log = logging.getLogger("nbdist")


class EngineSet:
    """The controller and engines behind one Cluster, with ranks 0..n-1."""

    def __init__(
        self, config: StartConfig, launcher: Launcher, workdir: str, progress: Callable[[str], None] | None = None
    ) -> None:
        self.config = config
        self.launcher = launcher
        self.workdir = workdir  # private to this cluster (0700): profile, rank reports, preflight notes
        self.progress = progress or (lambda line: None)  # what a queued job is waiting for, now and then
        self.ranks: list[RankInfo] = []
        self.client: Any = None
        self._ipp: Any = None
        self._views: dict[tuple[int, ...], Any] = {}
        self.kept_pids: list[int] = []  # reattached to a kept world (kept.py): its controller and what it started
        self.kept_jobs: list[str] = []  # and the batch jobs it runs in
        self.given_back: list[str] = []  # what the last drop gave back to the batch system, in words
        self.standby: Standby | None = None  # a replacement still queued when the world went on without it
        self.spare = Spare(wanted(launcher.multi_host, config.recovery.max_restarts))  # an engine ahead of need
        self.board = Board()  # each rank's state (board.py): written where a change is seen, read by the views
        self.published = Published(workdir, self.board, lambda: list(self.ranks))  # and as a file, for the panel
        self.board.subscribe(self.published)

    # ------------------------------------------------------------------ processes
    def start(self) -> list[RankInfo]:
        """Start the controller and n engines; return ranks 0..n-1 in the order engines registered."""
        from IPython.core.profiledir import ProfileDir

        profile = ProfileDir.create_profile_dir(os.path.join(self.workdir, "profile"))
        self._ipp = self.launcher.cluster(self.config, profile.location)
        self._ipp.start_controller_sync()
        self._ipp.start_engines_sync(self.config.world.n)
        self._record_jobs()
        self.client = self._ipp.connect_client_sync()
        compat.drop_unreadable_messages(self.client)
        compat.fast_iso_dates()
        ids = registration.wait_for_engines(self, self.config.world.n, known=set(), old_launchers=set())
        self.ranks = [RankInfo(rank=i, engine_id=eid) for i, eid in enumerate(registration.in_launch_order(self, ids))]
        self.board.reset([r.rank for r in self.ranks])
        return self.ranks

    def replace(self, ranks: list[int]) -> list[RankInfo]:
        """Kill these ranks' engines and start new ones for the same ranks; return their new RankInfos.
        They are ``restarting`` on the board until their caller has them in the world again."""
        self.board.set(ranks, RankState.RESTARTING)
        self.kill(ranks)
        for rank, eid in zip(ranks, self._more(ranks), strict=True):
            self.ranks[rank] = RankInfo(rank=rank, engine_id=eid)
        return [self.ranks[r] for r in ranks]

    def add(self, count: int) -> list[RankInfo]:
        """Start ``count`` more engines as the next ranks (a world that grows); their RankInfos."""
        ranks = list(range(len(self.ranks), len(self.ranks) + count))
        come, standby, self.standby = arrived(self), self.standby, None  # its engines, or it is cancelled (standby.py)
        ids = registration.in_launch_order(self, come) if standby and standby.count == count and come else None
        if ids is None and standby is not None:
            self.give_up(standby.sets)
        self.ranks += [RankInfo(rank=r, engine_id=eid) for r, eid in zip(ranks, ids or self._more(ranks), strict=True)]
        self.board.set(ranks, RankState.RESTARTING)
        return self.ranks[-count:]

    def spare_up(self) -> None:
        """Start the spare engine when this world keeps one and has none (spare.py)."""
        if self._ipp is not None and self.client is not None:
            self.spare.up(self._ipp, self.client, self.launcher, self.ranks)

    def _more(self, ranks: list[int]) -> list[int]:
        """An engine for each of these ranks, the spare first when it has registered (spare.py), the others
        started now; their engine ids, in launch order. Nothing of engines that did not come is left running or
        queued."""
        eid, stale = self.spare.take(self._ipp, self.client, self.ranks)
        if stale is not None:
            self.give_up({stale})
        if eid is not None:
            return [eid] + (self._more(ranks[1:]) if len(ranks) > 1 else [])
        known = set(self.client.ids) | {r.engine_id for r in self.ranks}
        old_launchers = {id(el) for el in self.launchers()}
        before = set(self._ipp.engines)
        self.launcher.later(self._ipp)
        self._ipp.start_engines_sync(len(ranks))
        self._record_jobs()
        try:
            waited = registration.wait_for_engines(self, len(ranks), known, old_launchers, ranks)
        except registration.StillQueued:  # the world goes on without them; the job is kept (standby.py)
            sets = set(self._ipp.engines) - before
            self.standby = Standby(sets, known, len(ranks), self.launcher.job_ids([self._ipp.engines[k] for k in sets]))
            raise
        except BaseException:
            self.give_up(set(self._ipp.engines) - before)
            raise
        return registration.in_launch_order(self, waited)

    def give_up(self, engine_sets: set[str]) -> None:
        """Stop these engine sets (a replacement that did not start: its processes, its queued batch job)."""
        for key in engine_sets:
            launcher = self._ipp.engines.get(key)
            jobs = self.launcher.job_ids([launcher]) if launcher is not None else []
            try:
                self._ipp.stop_engines_sync(key)
            except Exception as exc:
                log.debug("stopping engine set %s failed: %s", key, exc)
            self.launcher.cancel(jobs)
        self._record_jobs()

    def drop(self, lost: list[int]) -> dict[int, int]:
        """Go on without these ranks (dead, their replacement could not start): the others are numbered
        0..n-1 again in their order. Returns each remaining rank's old number -> new number."""
        remaining = [r for r in self.ranks if r.rank not in lost]
        new = {r.rank: i for i, r in enumerate(remaining)}
        for i, r in enumerate(remaining):
            r.rank = i
        self.ranks = remaining
        self._views.clear()
        self.board.reset([r.rank for r in self.ranks])
        self.given_back = self.launcher.release(self.job_ids(), {r.host for r in remaining})  # nodes left behind
        return new

    def adopt(self, client: Any, ranks: list[RankInfo], cluster_id: str, pids: list[int], jobs: list[str]) -> None:
        """Take over a running world (a kept one, kept.py): its client, its ranks, the processes and batch jobs
        it runs in (``pids``, ``jobs``: stopped with it), and a launcher that starts engines for its controller
        (%dist_restart) without touching that controller or its keys."""
        self.client, self.ranks, self.kept_pids, self.kept_jobs = client, ranks, pids, jobs
        self.board.reset([r.rank for r in ranks])
        self._ipp = self.launcher.cluster(self.config, os.path.join(self.workdir, "profile"), fresh=False)
        self._ipp.cluster_id = cluster_id

    def launchers(self) -> list[Any]:
        """The ipyparallel launcher objects of the engines this set started (one per local engine; one per job)."""
        if self._ipp is None:
            return []
        out: list[Any] = []
        for engine_set in list(self._ipp.engines.values()):
            # A local engine set holds one launcher per engine; mpiexec, srun and sbatch sets are one each.
            children = getattr(engine_set, "launchers", None)
            out.extend(children.values() if children is not None else [engine_set])
        return out

    def _record_jobs(self) -> None:
        """Write the batch job ids this set submitted where the controller finds them (it cancels them
        if the kernel dies)."""
        jobs = self.job_ids()
        if jobs:
            path = os.path.join(self.workdir, "jobs")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write("\n".join(jobs) + "\n")

    def job_ids(self) -> list[str]:
        """The batch jobs (Slurm job ids) this set submitted."""
        return self.launcher.job_ids(self.launchers()) or list(self.kept_jobs)

    def kill(self, ranks: list[int]) -> None:
        """End the engines of these ranks (only processes this set started: here by pid, on other hosts through
        ipyparallel's nanny, which kills the engine it started); wait until they have ended. A local rank's pid is
        the one its engine gave when this set configured it, which ``pids()`` lists first: asking ``pids()`` (every
        process's children too, a walk over /proc for each) cost a recovery 30-40 ms at 8 ranks."""
        local = [r for r in ranks if self.ranks[r].local and self.ranks[r].pid]
        procs.kill([self.ranks[r].pid for r in local])  # waits until they have ended
        self._remote_signal([r for r in ranks if not self.ranks[r].local], signal.SIGKILL)
        # The others are gone when the controller says so (its heart monitor: 1-2 s); ours we saw end.
        deadline = time.monotonic() + 10
        gone = {self.ranks[r].engine_id for r in ranks if r not in local}
        while gone & set(self.client.ids) and time.monotonic() < deadline:
            time.sleep(0.02)

    def signal(self, ranks: list[int], sig: int = signal.SIGINT) -> None:
        """Send a signal to the engines of these ranks (by pid here; through the nanny on other hosts)."""
        for rank in ranks:
            pid = self.ranks[rank].pid
            if pid and self.ranks[rank].local:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        self._remote_signal([r for r in ranks if not self.ranks[r].local], sig)

    def _remote_signal(self, ranks: list[int], sig: int) -> None:
        live = set(self.client.ids) if self.client is not None else set()
        targets = [self.ranks[r].engine_id for r in ranks if self.ranks[r].engine_id in live]
        if targets:
            try:
                self.client.send_signal(int(sig), targets=targets, block=True)
            except Exception as exc:  # the engine (or its host) is gone
                log.debug("signal %s to engines %s failed: %s", sig, targets, exc)

    def pids(self) -> list[int]:
        """Process ids, on this host, of the controller and engines this set started, and their children."""
        pids = [r.pid for r in self.ranks if r.pid and r.local] + self.kept_pids
        if self._ipp is not None:
            pids.extend(el.pid for el in self.launchers() if getattr(el, "pid", None))
            controller = self._ipp.controller
            if controller is not None and getattr(controller, "pid", None):
                pids.append(controller.pid)
        return sorted(set(pids) | procs.descendants(pids))

    def stop(self) -> list[str]:
        """Stop every engine and the controller (through ipyparallel, then by pid); cancel the batch jobs
        this set submitted (by id). Returns those job ids."""
        pids = self.pids()
        jobs = self.job_ids()
        self.published.close()
        if self.client is not None:
            try:
                self.client.close(linger=0)
            except Exception:
                pass
            self.client = None
        if not self.launcher.multi_host:
            # Engines this process started here end at once: nothing in them needs a graceful stop (their
            # results were sent, their files go with the cluster's directory), and ipyparallel's SIGTERM
            # would also run preemption hooks (engine/preempt.py) on the way out. ~0.3 s per engine saved.
            ours = [r.pid for r in self.ranks if r.local] + self.spare.pids(self._ipp)
            procs.kill([pid for pid in ours if pid in pids])
        if self._ipp is not None:
            try:
                self._ipp.stop_cluster_sync()
            except Exception as exc:
                log.warning("ipyparallel stop failed (%s); ending processes by pid", exc)
            self._ipp = None
        self.launcher.cancel(jobs)
        self.launcher.stopped()
        procs.reap(pids)
        return jobs

    # ------------------------------------------------------------------ state
    def dead_ranks(self) -> list[int]:
        """Ranks whose engine process has died or left the controller."""
        if self.client is None:
            return [r.rank for r in self.ranks]
        live = set(self.client.ids)
        return [r.rank for r in self.ranks if r.engine_id not in live or (r.local and r.pid and not procs.alive(r.pid))]

    def states(self) -> dict[int, RankNow]:
        """Each rank's state now (the board), with the deaths nobody was watching for written to it first:
        a rank that died between cells, or while a --noblock cell ran uncollected."""
        board = self.board.get()
        for rank in self.dead_ranks():
            if board.get(rank) is None or board[rank].state not in (RankState.DEAD, RankState.RESTARTING):
                self.board.set([rank], RankState.DEAD)
        return self.board.get()

    # ------------------------------------------------------------------ reaching the engines
    def engine_ids(self, ranks: list[int]) -> list[int]:
        return [self.ranks[r].engine_id for r in ranks]

    def view(self, ranks: list[int], broadcast: bool = False) -> Any:
        """A DirectView (``broadcast``: a BroadcastView) on these ranks' engines, kept while their engine ids stay."""
        key = (*self.engine_ids(ranks), broadcast)
        view = self._views.get(key)
        if view is None or view.client is not self.client:
            ids = list(key[:-1])
            view = self._views[key] = self.client.broadcast_view(targets=ids) if broadcast else self.client[ids]
        return view

    def call(self, ranks: list[int], fn: Callable[..., Any], /, *args: Any, timeout: float, **kwargs: Any) -> Answers:
        """The one door to the ranks: ``fn(*args, **kwargs)`` on each of these ranks' engines at once, waited for
        at most ``timeout`` seconds in all (``call_each`` when each rank gets its own arguments)."""
        return self.call_each({r: (fn, args, kwargs) for r in ranks}, timeout=timeout)

    def call_each(self, calls: dict[int, Call], *, timeout: float, by_engine: bool = False, release: bool = False) -> Answers:
        """Each rank's own call (``fn, args, kwargs``), all sent at once; every rank's value, its error, or that it
        did not answer within ``timeout`` seconds (a stopped controller, a rank stuck in C code): never a longer
        wait. ``by_engine``: the keys are engine ids (before ranks are assigned); ``release``: a rank that dies
        meanwhile has the others interrupted (answers.wait_releasing)."""
        deadline = time.monotonic() + timeout
        futures: dict[int, Any] = {}
        answers = Answers(timeout=timeout)
        for key, (fn, args, kwargs) in calls.items():
            eid = key if by_engine else self.ranks[key].engine_id
            try:
                futures[key] = self.client[eid].apply_async(fn, *args, **kwargs)
            except Exception as exc:  # the engine is gone from the controller
                answers.errors[key] = exc
        if release:
            wait_releasing(futures, calls, deadline, self.dead_ranks, self.signal)
        for key, fut in futures.items():
            try:
                answers.values[key] = fut.get(timeout=max(0.0, deadline - time.monotonic()))
            except Exception as exc:
                if fut.ready():
                    answers.errors[key] = exc
                else:
                    answers.late.append(key)
        return answers
