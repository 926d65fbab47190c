"""Cluster: a ranked set of engines sharing one torch.distributed world. The one door to nbdist.

``nbdist.start(n)`` is equivalent to three steps, each a module with one job:

1. ``EngineSet.start()`` (world/engineset.py): the launcher (launch/) starts the controller
   and n engines; ranks 0..n-1 are assigned to the engines that registered;
2. ``configure_ranks`` (rendezvous.py): each engine gets its rank env, threads and cores;
3. ``build_world`` (rendezvous.py): the process group is formed and proved; a ``World``.

``Cluster.run`` hands a cell to ``run.execute`` with this cluster's repair policy as the
callback: after a release the process group is rebuilt, dead ranks are named (or
restarted, when asked). ``cluster.last`` is the last run. ``--keep``: the world outlives the
kernel and ``attach()`` reconnects a new one to it (world/kept.py).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from . import grow as growing
from .cellpath import CellPath
from .cells import pointers
from .cells.history import History
from .cells.output import Sink
from .cells.run import PendingRun
from .config import RankSpec, RunConfig, StartConfig, parse_ranks
from .errors import ClusterError
from .launch import defaults
from .launch.registry import launcher_for
from .recovery import Recovery
from .results import RankState, RunResult
from .world import kept, variables, views
from .world.engineset import EngineSet, RankInfo
from .world.rendezvous import World, form_world, leave_world, reform_world

_CURRENT: Cluster | None = None  # the active cluster (strong: it owns processes)


def current() -> Cluster:
    """The cluster most recently started in this process."""
    cluster = _CURRENT
    if cluster is None or not cluster.running:
        raise ClusterError("no cluster is running; start one with nbdist.start(n=2) or %dist_start -n 2.")
    return cluster


def attach(name: str | None = None) -> Cluster:
    """Reconnect this kernel to a world kept by ``start(keep=...)`` (this user's, this host's, newest or named),
    proved alive: every rank answers with its rank and pid. Variables, models and process group are as left."""
    record = kept.find(name)
    return Cluster(StartConfig(**record.config)).adopt(record)


def start(
    n: int | None = None,
    backend: str | None = None,
    launcher: str | None = None,
    timeout: float = 45.0,
    progress: Callable[[str], None] | None = None,
    **options: Any,
) -> Cluster:
    """Start n ranked engines with an initialised process group; return the Cluster.

    Without ``n`` and ``launcher``: inside a Slurm allocation, one rank per allocated GPU
    (or task) through ``srun --overlap``; elsewhere one rank per visible GPU, or 2 local
    ranks (``defaults.choose``). ``Cluster.chosen`` then says what was chosen and why.
    ``progress`` gets a line now and then while a batch job waits in the queue (default: printed).
    """
    choice = defaults.choose(n, launcher)
    if choice.ranks_per_node and not options.get("ranks_per_node"):
        options["ranks_per_node"] = choice.ranks_per_node
    config = StartConfig(n=choice.n, backend=backend, launcher=choice.launcher, timeout=timeout, **options)
    cluster = Cluster(config, progress=progress)
    cluster.choice = choice
    return cluster.start()


class Cluster(views.WorldView):
    """n engines, ranks 0..n-1, one process group. Use as a context manager to stop it."""

    def __init__(
        self, config: StartConfig | None = None, progress: Callable[[str], None] | None = None, **options: Any
    ) -> None:
        self.config = config or StartConfig(**options)
        self.progress = progress or _print_line
        self.choice: defaults.Choice | None = None  # what nbdist chose when the user left n out
        self.cancelled: list[str] = []  # batch jobs the last stop cancelled
        self.engines: EngineSet | None = None
        self.world: World | None = None
        self.running = False
        self.last: RunResult | PendingRun | None = None  # the last run
        self.startup: dict[str, float] = {}  # seconds to each phase of start()
        self.restarts = 0  # restarts of any rank, automatic or not (torchrun's TORCHELASTIC_RESTART_COUNT)
        self.recovery = Recovery(budget=self.config.max_restarts, peer=self.config.recover_from == "peer")  # --max-restarts, setup cells, last checkpoint
        self.history = History()  # the cells that ran, for %dist_export
        self._workdir = ""
        self._lock = threading.RLock()
        self.keeper: kept.Keeper | None = None  # --keep: the record %dist_attach reads, the lease kept fresh
        self.cells = CellPath(  # a cell's way through the ranks, with recovery
            self._engines,
            self.config,
            self.recovery,
            self.history,
            self._say,
            self.restart,
            self.rebuild_world,
            self.resize,
            self._grow_between_cells,
        )

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Cluster:
        """Start the engines and form the world (see the module's docstring); stop everything on failure."""
        global _CURRENT
        if self.running:
            return self
        tic = time.perf_counter()
        launcher = launcher_for(self.config)
        self._workdir = tempfile.mkdtemp(prefix="nbdist-", dir=launcher.workdir_base())
        os.chmod(self._workdir, 0o700)
        try:
            self.engines = EngineSet(self.config, launcher, self._workdir, progress=self.progress)
            ranks = self.engines.start()
            self.startup["engines"] = time.perf_counter() - tic
            self._form_world(ranks)
            self.startup["world"] = self.world.seconds if self.world else 0.0
        except KeyboardInterrupt:
            self.stop()
            if self.cancelled:
                self.progress(f"interrupted: cancelled Slurm job(s) {', '.join(self.cancelled)}")
            raise
        except BaseException:
            self.stop()
            raise
        self.startup["total"] = time.perf_counter() - tic
        self.running = True
        _CURRENT = self
        self._kept()
        pointers.point(self._workdir)  # this kernel's world, for the world panel and pages opened later
        return self

    def adopt(self, record: kept.Record) -> Cluster:
        """Become the cluster of a kept world (``attach``): reconnect, prove it alive, keep its lease fresh."""
        global _CURRENT
        self.engines = kept.reconnect(record, self.config, launcher_for(self.config))
        self._workdir, self.world, self.restarts = record.workdir, World(**record.world), record.restarts
        pointers.point(self._workdir)  # its cells' transcripts come back with it, for this kernel's pages
        self.engines.published.write()  # and its ranks show in the panel
        self.keeper = kept.Keeper.of(record)
        self._kept()
        self.running = True
        _CURRENT = self
        return self

    def _kept(self) -> None:
        """--keep: write (again, after a restart) what %dist_attach needs, and keep the lease fresh."""
        self.keeper = kept.keep(self.keeper, self.config, self._workdir, self.world, self.engines, self.restarts)

    def _form_world(self, configure: list[RankInfo]) -> None:
        """Configure these ranks' engines, choose the backend and build the world on every rank."""
        self.world = form_world(self._engines(), configure, self.config, self.restarts)
        self._engines().published.write()  # hosts and pids are known now: the panel shows them from here

    def restart(self, ranks: RankSpec = None) -> float:
        """Replace the engines of the given ranks (default: all) and rebuild the world; seconds taken. Ranks keep
        their numbers (new engine ids); ranks not restarted keep their Python state."""
        engines = self._engines()
        tic = time.perf_counter()
        targets = parse_ranks(ranks, self.world_size)
        try:
            with self._lock:
                replaced = engines.replace(targets)
                self.restarts += 1
                leave_world(engines)
                self._form_world(replaced)
        finally:  # in the world again, or (when the restart failed) dead or waiting for the next restart
            dead = set(engines.dead_ranks())
            engines.board.set([r for r in targets if r not in dead], RankState.IDLE)
            engines.board.set([r for r in targets if r in dead], RankState.DEAD)
        self.running = True
        self._kept()
        return time.perf_counter() - tic

    def resize(self, lost: list[int], add: int = 0) -> dict[int, int]:
        """Go on without the dead ranks ``lost`` (their replacement could not start; the others numbered 0..n-1
        again), or with ``add`` more ranks (``grow``): every rank told its rank and world size, a new process group.
        Returns each remaining rank's old number -> its new one."""
        engines = self._engines()
        with self._lock:
            before = len(engines.ranks)
            new = engines.drop(lost) if lost else {r: r for r in range(before)}
            self.history.renumber(new)  # the setup cells replay on the ranks that remain
            if add:
                engines.add(add)  # ClusterError (nothing changed) when they do not start
                self.history.widen(before, len(engines.ranks))  # and those that ran on every rank, on the new too
            self.restarts += 1
            leave_world(engines)
            self._form_world(engines.ranks)
            engines.board.reset([r.rank for r in engines.ranks])
        self.running = True
        self._kept()
        return new

    def grow(self, count: int) -> str:
        """Add ``count`` ranks: between cells, or where a --noblock cell's loop stops for them, and the cell goes on
        with them (grow.py, cellpath.py); the line that says what was done."""
        if isinstance(self.last, PendingRun) and not self.last.done():
            growing.while_running(count, self.last, self._engines(), self.cells, self._say)  # last.wait() goes on
            return self.cells.grown
        return self._grow_between_cells(count)

    def _grow_between_cells(self, count: int) -> str:
        return growing.grow(count, self._engines(), self.config, self.resize, self.cells.replay(), self.recovery, self._say)

    def rebuild_world(self) -> float:
        """Tear the process group down on every rank and build a new one; return seconds taken."""
        engines = self._engines()
        if self.world is None:
            raise ClusterError("this cluster has no world yet; run %dist_restart to form it.")
        self.world = reform_world(engines, self.world, self.config, self.restarts)
        return self.world.seconds

    def stop(self) -> None:
        """Stop every engine and the controller this cluster started (by pid), remove its files."""
        global _CURRENT
        self.running = False
        if self.keeper is not None:
            self.keeper.forget()
            self.keeper = None
        if self.engines is not None:
            self.cancelled = self.engines.stop()
        if self._workdir:
            pointers.unpoint(self._workdir)
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = ""
        if _CURRENT is self:
            _CURRENT = None

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<nbdist.Cluster {state}: {self.world_size} rank(s), backend={self.backend or '-'}>"

    # ------------------------------------------------------------------ work

    def run(
        self,
        code: str,
        ranks: RankSpec = None,
        timeout: float | None = None,
        block: bool = True,
        quiet: bool = False,
        sink: Sink | None = None,
        setup: bool = False,
        each: bool = False,
    ) -> RunResult | PendingRun:
        """Run code on the given ranks; return a RunResult (or a PendingRun if block=False). Output goes to ``sink``
        (default: printed, tagged with its rank and folded across ranks; ``each``: every rank's lines as they are).
        A failure on any rank releases ranks left waiting in a collective and is reported in the result
        (``result.raise_for_error()`` raises RankError, as the magics do). ``setup``: a cell that builds state; with
        ``max_restarts`` it is replayed after an automatic restart (recovery.py)."""
        engines = self._engines()
        parse_ranks(ranks, self.world_size)  # bad ranks are said before anything is done
        dead = engines.dead_ranks()
        if dead and self.recovery.left > 0:  # died between cells (a preempted rank left, say)
            self.recovery.recover(dead, self.cells.replay(), self.progress)
        cfg = RunConfig(ranks=parse_ranks(ranks, self.world_size), timeout=timeout, block=block, quiet=quiet, each=each)
        self.last = self.cells.execute(code, cfg, sink, setup)
        return self.last

    def _say(self, line: str) -> None:
        """A line for the person (``progress``, looked up each time: it may be replaced after the start)."""
        self.progress(line)

    def push(self, mapping: dict[str, Any], ranks: RankSpec = None) -> None:
        """Send variables to the ranks' namespaces."""
        variables.push(self._engines(), mapping, parse_ranks(ranks, self.world_size))
        self.history.pushed.update(mapping)

    def pull(self, name: str, ranks: RankSpec = None) -> list[Any]:
        """Fetch a variable from each rank; a list ordered by rank."""
        return variables.pull(self._engines(), name, parse_ranks(ranks, self.world_size))


def _print_line(line: str) -> None:
    print(line, flush=True)
