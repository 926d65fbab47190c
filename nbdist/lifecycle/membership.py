"""Who is in the world, and every change to it: the one owner of a world's membership.

``Membership`` starts the engines and forms the world, adopts a kept one (``%dist_attach``), restarts ranks,
shrinks the world (``--min-ranks``) or adds ranks to it, rebuilds the process group, keeps the ``--keep``
record fresh after each change, and stops it all. Each change takes the lock, so a change made by recovery and
one asked for by the person never interleave. It is given what it changes (the config, the cells' history,
which it renumbers when ranks are renumbered) and where to say things; it calls nothing above it: the cell path,
recovery and grow (this folder) are handed a Membership and call down into it.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..cells import pointers
from ..cells.history import History
from ..config import StartConfig, parse_ranks
from ..errors import ClusterError
from ..launch.launchers import launcher_for
from ..results import RankState
from ..world import kept
from ..world.engineset import EngineSet, RankInfo
from ..world.rendezvous import World, form_world, reform_world, rejoin


@dataclass(frozen=True, slots=True)
class Resize:
    """The world went on with ``ranks`` ranks (were ``before``; ``lost``: those it lost, none when it grew) from
    loop step ``step`` (None: no step known)."""

    before: int
    ranks: int
    step: int | None
    lost: list[int]
    at: float  # time.time()


class Membership:
    """A world's engines, its process group and every change to who is in it (see the module's docstring)."""

    def __init__(self, config: StartConfig, history: History, say: Callable[[str], None]) -> None:
        self.config = config
        self.history = history  # the cells that ran: renumbered with the ranks
        self.say = say
        self.engines: EngineSet | None = None
        self.world: World | None = None
        self.running = False
        self.restarts = 0  # restarts of any rank, automatic or not (torchrun's TORCHELASTIC_RESTART_COUNT)
        self.sizes: list[Resize] = []  # each time the world went on with fewer ranks, or grew
        self.keeper: kept.Keeper | None = None  # --keep: the record %dist_attach reads, the lease kept fresh
        self.cancelled: list[str] = []  # batch jobs the last stop cancelled
        self.startup: dict[str, float] = {}  # seconds to each phase of start()
        self.workdir = ""
        self._lock = threading.RLock()

    def live(self) -> EngineSet:
        """The engines of a running world; ClusterError naming the way out when it is stopped."""
        if self.engines is None or self.engines.client is None or not self.engines.ranks:
            raise ClusterError("this cluster is stopped; start one with nbdist.start(n=2) or %dist_start -n 2.")
        return self.engines

    # ------------------------------------------------------------------ a world begins and ends

    def start(self) -> None:
        """Start the engines and form the world; stop everything on failure (Ctrl-C included)."""
        tic = time.perf_counter()
        launcher = launcher_for(self.config)
        self.workdir = tempfile.mkdtemp(prefix="nbdist-", dir=launcher.workdir_base())
        os.chmod(self.workdir, 0o700)
        try:
            self.engines = EngineSet(self.config, launcher, self.workdir, progress=self.say)
            ranks = self.engines.start()
            self.startup["engines"] = time.perf_counter() - tic
            self._form(ranks)
            self.startup["world"] = self.world.seconds if self.world else 0.0
            self.engines.spare_up()  # a dead rank's replacement, registered ahead of need (world/spare.py)
            launcher.formed()  # and what the launcher starts later engines from (Ray: its nodes' warm processes)
        except KeyboardInterrupt:
            self.stop()
            if self.cancelled:
                self.say(f"interrupted: cancelled Slurm job(s) {', '.join(self.cancelled)}")
            raise
        except BaseException:
            self.stop()
            raise
        self.startup["total"] = time.perf_counter() - tic
        self.running = True
        self.keep()
        if self.keeper is None:
            # The kernel's own exit (a page's shutdown, a notebook run to its end) ends this world as %dist_stop
            # does: its engines, controller and jobs by id, and its directory. ipyparallel's own hook at exit ends
            # only the processes, and the controller, ended by a signal, cannot clean up behind the kernel.
            atexit.register(self.stop_at_exit, os.getpid())
        pointers.point(self.workdir)  # this kernel's world, for the world panel and pages opened later

    def adopt(self, record: kept.Record) -> None:
        """Become the owner of a kept world (``attach``): reconnect, prove it alive, keep its lease fresh."""
        self.engines = kept.reconnect(record, self.config, launcher_for(self.config))
        self.workdir, self.world, self.restarts = record.workdir, World(**record.world), record.restarts
        pointers.point(self.workdir)  # its cells' transcripts come back with it, for this kernel's pages
        self.engines.published.write()  # and its ranks show in the panel
        self.keeper = kept.Keeper.of(record)
        self.keep()
        self.running = True

    def keep(self) -> None:
        """--keep: write (again, after any change) what %dist_attach needs, and keep the lease fresh."""
        self.keeper = kept.keep(self.keeper, self.config, self.workdir, self.world, self.engines, self.restarts)

    def stop(self) -> None:
        """Stop every engine and the controller this world started (by pid), remove its files."""
        self.running = False
        atexit.unregister(self.stop_at_exit)
        if self.keeper is not None:
            self.keeper.forget()
            self.keeper = None
        if self.engines is not None:
            self.cancelled = self.engines.stop()
        if self.workdir:
            pointers.unpoint(self.workdir)
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = ""

    def stop_at_exit(self, pid: int) -> None:
        """``stop``, in the process that started the world only: a child forked from the kernel (``os.fork`` in a
        cell) inherits the exit hooks, and its exit must not end its parent's world."""
        if os.getpid() == pid:
            self.stop()

    # ------------------------------------------------------------------ changes to who is in it

    def restart(self, ranks: list[int] | None = None) -> float:
        """Replace the engines of the given ranks (default: all) and rebuild the world; seconds taken. Ranks keep
        their numbers (new engine ids); ranks not restarted keep their Python state."""
        engines = self.live()
        tic = time.perf_counter()
        targets = parse_ranks(ranks, len(engines.ranks))
        try:
            with self._lock:
                replaced = engines.replace(targets)
                self.restarts += 1
                self._form(replaced, rejoin)
        finally:  # in the world again, or (when the restart failed) dead or waiting for the next restart
            dead = set(engines.dead_ranks())
            engines.board.set([r for r in targets if r not in dead], RankState.IDLE)
            engines.board.set([r for r in targets if r in dead], RankState.DEAD)
        self.running = True
        self.keep()
        return time.perf_counter() - tic

    def shrink(self, lost: list[int]) -> dict[int, int]:
        """Go on without the dead ranks ``lost`` (their replacement could not start), the others numbered 0..n-1
        again; each remaining rank's old number -> its new one."""
        return self._resize(lost, 0)

    def add(self, count: int) -> None:
        """Start ``count`` more ranks (numbered after the others) and form a larger world; ClusterError (nothing
        changed) when they do not start."""
        self._resize([], count)

    def _resize(self, lost: list[int], add: int) -> dict[int, int]:
        """Every rank told its rank and world size, a new process group; the history's cells renumbered."""
        engines = self.live()
        with self._lock:
            before = len(engines.ranks)
            new = engines.drop(lost) if lost else {r: r for r in range(before)}
            self.history.renumber(new)  # the setup cells replay on the ranks that remain
            if add:
                engines.add(add)
                self.history.widen(before, len(engines.ranks))  # and those that ran on every rank, on the new too
            self.restarts += 1
            self._form(engines.ranks, rejoin)
            engines.board.reset([r.rank for r in engines.ranks])
        self.running = True
        self.keep()
        return new

    def rebuild(self) -> float:
        """Tear the process group down on every rank and build a new one; seconds taken."""
        engines = self.live()
        if self.world is None:
            raise ClusterError("this cluster has no world yet; run %dist_restart to form it.")
        with self._lock:
            self.world = reform_world(engines, self.world, self.config, self.restarts)
        return self.world.seconds

    def resized(self, change: Resize) -> None:
        """Note a change of the world's size (recovery and grow know the loop step it went on from)."""
        self.sizes.append(change)

    def sizes_line(self) -> str:
        """The world's sizes, as %dist_status says them: 'world size: 4 ranks, then 3 from step 7 (rank 1 lost
        at 10:42:03)'; '' while it never changed."""
        if not self.sizes:
            return ""
        said = [f"world size: {self.sizes[0].before} ranks"]
        for s in self.sizes:
            when = time.strftime("%H:%M:%S", time.localtime(s.at))
            step = f" from step {s.step}" if s.step is not None else ""
            why = f"rank(s) {', '.join(map(str, s.lost))} lost" if s.lost else f"{s.ranks - s.before} rank(s) added"
            said.append(f"then {s.ranks}{step} ({why} at {when})")
        return ", ".join(said)

    def _form(self, configure: list[RankInfo], how: Callable[..., World] = form_world) -> None:
        """Configure these ranks' engines, choose the backend and build the world on every rank (``how``: form_world
        for a first world, rejoin to leave the one before first)."""
        engines = self.live()
        self.world = how(engines, configure, self.config, self.restarts)
        engines.published.write()  # hosts and pids are known now: the panel shows them from here
