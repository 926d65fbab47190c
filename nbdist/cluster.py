"""Cluster: a ranked set of engines sharing one torch.distributed world. The one door to nbdist.

A thin face over ``lifecycle/``: its ``Membership`` owns who is in the world and every change to it (start, restart,
shrink, grow, rebuild, keep, stop); its ``CellPath`` runs cells with the repair and recovery policy, calling down
into that membership. ``attach()`` reconnects a kernel to a world kept by ``--keep``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from .cells.history import History
from .cells.output import Sink
from .cells.run import PendingRun
from .config import RankSpec, RunConfig, StartConfig, parse_ranks
from .errors import ClusterError
from .launch import defaults
from .lifecycle.cellpath import CellPath
from .lifecycle.membership import Membership
from .lifecycle.recovery import Recovery
from .results import RunResult
from .tracking import tracker as tracking
from .world import kept, variables, views
from .world.board import Listener, RankNow
from .world.engineset import EngineSet, RankInfo
from .world.rendezvous import World

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
    return Cluster(StartConfig.of(**record.config)).adopt(record)


def start(
    n: int | None = None,
    backend: str | None = None,
    launcher: str | None = None,
    timeout: float = 45.0,
    progress: Callable[[str], None] | None = None,
    **options: Any,
) -> Cluster:
    """Start n ranked engines with an initialised process group; return the Cluster. Without ``n`` and
    ``launcher``: in a Slurm allocation, one rank per allocated GPU (or task) through ``srun --overlap``; elsewhere
    one rank per visible GPU, or 2 local ranks (``defaults.choose``; ``Cluster.chosen`` says why). ``progress``
    gets a line now and then while a batch job waits in the queue (default: printed)."""
    config, choice = defaults.planned(n, backend, launcher, timeout, **options)
    cluster = Cluster(config, progress=progress)
    cluster.choice = choice
    return cluster.start()


planned = defaults.planned  # the StartConfig start() would make: %dist_start compares it with the running world's


class Cluster:
    """n engines, ranks 0..n-1, one process group. Use as a context manager to stop it."""

    def __init__(
        self, config: StartConfig | None = None, progress: Callable[[str], None] | None = None, **options: Any
    ) -> None:
        self.config = config or StartConfig.of(**options)
        self.choice: defaults.Choice | None = None  # what nbdist chose when the user left n out
        self.last: RunResult | PendingRun | None = None  # the last run
        self.history = History()  # the cells that ran, for %dist_export and recovery's replay
        self.membership = Membership(self.config, self.history, progress or _print_line)  # who is in it, each change
        self.recovery = Recovery.of(self.config.recovery)
        self.cells = CellPath(self.membership, self.recovery)  # a cell's way through the ranks, with recovery
        self.expect: dict[int, dict[str, Any]] | None = None  # what %%dist_fit --watch forecast: the dashboard's lines

    # ------------------------------------------------------------------ lifecycle (lifecycle/membership.py)

    def start(self) -> Cluster:
        """Start the engines and form the world (see the module's docstring); stop everything on failure."""
        global _CURRENT
        if not self.running:
            self.membership.start()
            _CURRENT = self
        return self

    def adopt(self, record: kept.Record) -> Cluster:
        """Become the cluster of a kept world (``attach``): reconnect, prove it alive, keep its lease fresh."""
        global _CURRENT
        self.membership.adopt(record)
        self.cells.listener = tracking.resume(record.workdir, say=self.membership.say)  # its run goes on, if any
        _CURRENT = self
        return self

    def restart(self, ranks: RankSpec = None) -> float:
        """Replace the engines of these ranks (default: all), same numbers, and rebuild the world; seconds taken."""
        self.membership.live()
        return self.membership.restart(parse_ranks(ranks, self.world_size))

    def grow(self, count: int) -> str:
        """Add ``count`` ranks: between cells, or where a --noblock cell's loop stops for them, and the cell goes on
        with them (lifecycle/grow.py, lifecycle/cellpath.py); the line that says what was done."""
        if isinstance(self.last, PendingRun) and not self.last.done():
            self.cells.grow_while_running(count, self.last)  # last.wait() goes on
            return self.cells.grown
        return self.cells.grow_between_cells(count)

    def rebuild_world(self) -> float:  # a new process group on every rank; seconds taken
        return self.membership.rebuild()

    def stop(self) -> None:
        """Stop every engine and the controller this cluster started (by pid), remove its files."""
        global _CURRENT
        tracker, self.cells.listener = self.cells.listener, None
        if tracker is not None:  # the world's run ends with it, what is queued written first
            tracker.close()
        self.membership.stop()
        if _CURRENT is self:
            _CURRENT = None

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<nbdist.Cluster {'running' if self.running else 'stopped'}: {self.world_size} rank(s), backend={self.backend or '-'}>"

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
        """Run code on the given ranks; a RunResult (a PendingRun if block=False). Output goes to ``sink`` (default:
        printed, tagged and folded across ranks; ``each``: every rank's lines as they are). A failure on a rank releases
        the others and is in the result (``raise_for_error()`` raises RankError). ``setup``: a cell that builds state,
        replayed by recovery (lifecycle/recovery.py)."""
        self.membership.live()
        cfg = RunConfig(
            ranks=parse_ranks(ranks, self.world_size), timeout=timeout, block=block, quiet=quiet, each=each,
            expect=self.expect,
        )
        self.last = self.cells.execute(code, cfg, sink, setup, spec=ranks)
        return self.last

    def push(self, mapping: dict[str, Any], ranks: RankSpec = None) -> None:
        """Send variables to the ranks' namespaces."""
        variables.push(self.membership.live(), mapping, parse_ranks(ranks, self.world_size))
        self.history.pushed.update(mapping)

    def pull(self, name: str, ranks: RankSpec = None) -> list[Any]:
        """Fetch a variable from each rank; a list ordered by rank."""
        return variables.pull(self.membership.live(), name, parse_ranks(ranks, self.world_size))

    # ------------------------------------------------------------------ what the world looks like (world/views.py)

    @property
    def running(self) -> bool:
        return self.membership.running

    @property
    def engines(self) -> EngineSet | None:
        return self.membership.engines

    @property
    def world(self) -> World | None:
        return self.membership.world

    @property
    def ranks(self) -> list[RankInfo]:
        return self.engines.ranks if self.engines is not None else []

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def keeper(self) -> kept.Keeper | None:  # --keep: the kept world's record and lease
        return self.membership.keeper

    @property
    def startup(self) -> dict[str, float]:  # seconds to each phase of the start: engines, world, total
        return self.membership.startup

    @property
    def chosen(self) -> str:
        """What nbdist chose when the user left -n out, and why, in one line ('' when the user chose)."""
        return self.choice.line(self.backend) if self.choice else ""

    @property
    def backend(self) -> str:
        return self.world.backend if self.world else ""

    @property
    def master_addr(self) -> str:
        return self.world.master_addr if self.world else ""

    @property
    def master_port(self) -> int:
        return self.world.master_port if self.world else 0

    @property
    def shape(self) -> views.WorldShape:
        """Backend, ranks, hosts and threads per rank: what a job script for this world needs."""
        return views.shape(self.membership.live(), self.backend, self.config.world.threads or 1)

    def pids(self) -> list[int]:
        """Process ids of the controller and engines this cluster started."""
        return self.engines.pids() if self.engines is not None else []

    def dead_ranks(self) -> list[int]:
        """Ranks whose engine process has died or left the controller."""
        return self.membership.live().dead_ranks()

    def states(self, lines: bool = False) -> dict[int, RankNow]:
        """Each rank's state now (results.RankState); ``lines``: ask busy ranks their line first (0.5 s at most)."""
        return views.states(self.membership.live(), lines)

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(RankNow)`` at each change of a rank's state (on the thread that saw it); the unsubscribe."""
        return self.membership.live().board.subscribe(listener)

    def status(self) -> list[dict[str, Any]]:
        """One row per rank: rank, engine id, host, pid, device, GPU (name, memory held), cores, backend, state."""
        return views.status(self.membership.live(), self.backend)

    def where(self, wait: float = 1.0, group: bool = False) -> list[str]:
        """Where each rank is now (doctor.py); ``group``: ranks at the same place are one entry."""
        return views.where(self.membership.live(), wait, group)

    # ------------------------------------------------------------------ beyond nbdist: ipyparallel itself

    @property
    def client(self) -> Any:
        """The ipyparallel Client, for what nbdist does not wrap (not read-only: what it changes, nbdist never hears)."""
        return self.engines.client if self.engines is not None else None

    def view(self, ranks: list[int]) -> Any:
        """An ipyparallel DirectView on these ranks' engines (the same caution as ``client``)."""
        return self.membership.live().view(ranks)


_print_line = functools.partial(print, flush=True)
