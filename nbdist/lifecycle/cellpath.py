"""A cell's way through a cluster's ranks, with what follows it (``CellPath``).

It runs the cell (cells/run.py). When ranks died and the budget lasts, it restarts them, replays the setup
cells, restores, and runs the cell again (recovery.py). When the world was asked to grow while the cell ran
(``Cluster.grow`` beside a ``--noblock`` cell), the cell's loop stops for it at a step boundary every rank agrees
on (engine/preempt.py's ``Resizing``); the world grows from the state of that boundary (grow.py) and the cell
runs again on the larger world, going on from there. A cell whose loop has no such boundary (no
``loader.steps()``) grows the world when it ends.

Every change to who is in the world goes down to the ``Membership`` it is given (membership.py). Nothing below
imports this module; the cell layer calls back only the two continuations it is handed with a cell (``repair``
and ``after``), since a ``--noblock`` cell is followed by whoever waits for it.
"""

from __future__ import annotations

import dataclasses
import signal
from dataclasses import dataclass
from typing import Any

from ..cells.output import Sink
from ..cells.run import PendingRun, execute
from ..config import RankSpec, RunConfig, parse_ranks
from ..errors import ClusterError, ConfigError
from ..results import RunResult
from ..world.engineset import EngineSet
from ..world.standby import arrived
from . import grow as growing
from .membership import Membership
from .recovery import Recovery, Replay, repair


@dataclass(slots=True)
class CellPath:
    """A cell's way through a world's ranks with its repair policy (see the module's docstring): the world's
    ``membership`` (its engines, config and history, and every change to who is in it) and its ``recovery`` budget."""

    membership: Membership
    recovery: Recovery
    growing: int = 0  # ranks asked for while the cell runs: added where its loop stops for them
    grown: str = ""  # the line of the last grow made where a cell stopped for it
    listener: Any = None  # what else hears each cell, its metric rows and its resizes (a tracked run: tracking/)

    def engines(self) -> EngineSet:
        return self.membership.live()

    def say(self, line: str) -> None:
        self.membership.say(line)

    def execute(
        self, code: str, cfg: RunConfig, sink: Sink | None, setup: bool, spec: RankSpec = None
    ) -> RunResult | PendingRun:
        """Run ``code`` on ``cfg.ranks`` (``spec`` as the person gave them): ranks that died between cells are
        recovered first while the budget lasts (a preempted rank that left, say; ``spec`` is then read against the
        world as recovered), and a queued replacement that came joins first."""
        dead: list[int] | None = self.engines().dead_ranks()
        if dead and self.recovery.left > 0:
            self.recovery.recover(dead, self.replay(), self.say)
            cfg = dataclasses.replace(cfg, ranks=parse_ranks(spec, len(self.engines().ranks)))
            dead = None  # the world as recovered: looked at again
        self.engines().spare_up()  # one taken by a recovery is started again here, between cells (world/spare.py)
        if self.listener is not None:  # a person's cell (a recovery's or a grow's run of it goes on with its steps)
            self.listener.cell(code, len(self.engines().ranks))
        return self._execute(code, cfg, sink, setup, dead)

    def _execute(
        self, code: str, cfg: RunConfig, sink: Sink | None, setup: bool, dead: list[int] | None = None
    ) -> RunResult | PendingRun:
        """``dead``: the ranks found dead just before (None: look), the one look a cell's start takes at 64 ranks."""
        before = len(self.engines().ranks)
        cfg = self._joined_between_cells(cfg)
        if len(self.engines().ranks) != before:
            dead = None  # the world grew: looked at again

        def then(result: RunResult, recover: list[int]) -> RunResult | PendingRun:
            return self.after(result, recover, code, cfg, sink, setup)

        return execute(
            self.engines(),
            code,
            cfg,
            grace=self.membership.config.recovery.grace,
            watchdog=self.membership.config.recovery.watchdog,
            on_done=self.repair,
            sink=sink,
            then=then,
            death_grace=0.0 if self.recovery.left > 0 else None,  # the cell runs again: nothing to wait for
            tick=self.tick,
            listener=self.listener,
            dead=dead,
        )

    def tick(self) -> None:
        """While a cell runs: once a queued replacement's engines have come (world/standby.py), ask the loop to
        stop for them at its next step boundary."""
        engines = self.engines()
        if self.growing or engines.standby is None or not arrived(engines):
            return
        self.growing = engines.standby.count
        engines.signal(list(range(len(engines.ranks))), signal.SIGUSR2)  # engine/preempt.py: asking_to_resize

    def _joined_between_cells(self, cfg: RunConfig) -> RunConfig:
        """A queued replacement's engines came while no cell ran: grow the world with them before this cell (a
        cell for every rank then runs on the grown world). A grow that cannot be made says why, once."""
        engines = self.engines()
        standby, before = engines.standby, len(engines.ranks)
        if standby is None or not arrived(engines):
            return cfg
        try:
            self.grow_between_cells(standby.count)
        except (ClusterError, ConfigError) as exc:
            _no_standby(engines)
            self.say(f"{standby.named()} started, but the world could not grow: {exc}")
            return cfg
        return dataclasses.replace(cfg, ranks=list(range(len(engines.ranks)))) if cfg.ranks == list(range(before)) else cfg

    def after(
        self, result: RunResult, dead: list[int], code: str, cfg: RunConfig, sink: Sink | None, setup: bool
    ) -> RunResult | PendingRun:
        """Remember the cell and the last checkpoint; recover ``dead`` (from ``repair``) while the budget lasts;
        grow the world asked for while the cell ran."""
        self.recovery.remember(result.checkpoint, code if setup and result.ok else "")
        if result.ok:  # setup cells among them are what recovery replays
            self.membership.history.add(code, cfg.ranks, setup)
        if self.growing and not dead:
            return self._grown(result, code, cfg, sink, setup)
        line = ""
        try:
            ended = [r.rank for r in result.ranks if r.rank in dead and (r.error or {}).get("ename") == "Killed"]
            line = self.recovery.recover(dead, self.replay(), self.say, ended, code) if dead else ""
        except ClusterError as exc:
            result.notes.append(str(exc))
        if not line:
            return result
        new = self.recovery.renumbered  # the world went on with fewer ranks: the cell runs on those left
        ranks = cfg.ranks if new is None else [new[r] for r in cfg.ranks if r in new]
        if new is not None and sink is not None:
            sink.resized(new, self.membership.sizes[-1].step)
        if new is not None and self.listener is not None:
            self.listener.resized(new, self.membership.sizes[-1].step)
        again = self._execute(
            code, RunConfig(ranks=ranks, timeout=cfg.timeout, quiet=cfg.quiet, each=cfg.each), sink, setup
        )
        assert isinstance(again, RunResult)
        again.recovered[:0] = [*result.recovered, line]
        return again

    def _grown(self, result: RunResult, code: str, cfg: RunConfig, sink: Sink | None, setup: bool) -> RunResult | PendingRun:
        """The cell ended while the world was asked to grow: stopped for it at a step boundary (grow, then run the
        cell again from there), or over (grow between cells), or failed (no grow: the person asks again)."""
        count, self.growing, engines = self.growing, 0, self.engines()
        before, stopped = len(engines.ranks), growing.stopped_for_it(result)
        if not (result.ok or stopped):
            growing.forget(engines)
            result.notes.append(
                f"the world did not grow: the cell failed before its loop stopped for it; run %dist_grow {count} again."
            )
            return result
        try:
            self.grown = self.grow_between_cells(count)
        except (ClusterError, ConfigError) as exc:
            growing.forget(engines)
            _no_standby(engines)  # a queued replacement that came would only be asked for again, and fail again
            self.grown = str(exc)
            if not stopped:
                result.notes.append(self.grown)
                return result
            self.say(self.grown + " The cell goes on with the ranks it had.")
        if not stopped:
            result.recovered.append(self.grown)
            return result
        after = len(self.engines().ranks)
        ranks = list(range(after)) if cfg.ranks == list(range(before)) else cfg.ranks
        if after > before and sink is not None:
            sink.resized({r: r for r in range(after)}, self.membership.sizes[-1].step, joined=list(range(before, after)))
        if after > before and self.listener is not None:
            joined = list(range(before, after))
            self.listener.resized({r: r for r in range(before)}, self.membership.sizes[-1].step, joined)
        again = self._execute(code, dataclasses.replace(cfg, ranks=ranks), sink, setup)
        lines = [*result.recovered, self.grown]
        if isinstance(again, PendingRun):
            again.carried[:0] = lines
        else:
            again.recovered[:0] = lines
        return again

    def grow_between_cells(self, count: int) -> str:
        """Add ``count`` ranks now (no cell runs): grow.py; the line that says what was done."""
        return growing.grow(count, self.replay())

    def grow_while_running(self, count: int, run: PendingRun) -> RunResult | PendingRun:
        """Grow beside a running ``--noblock`` cell: ask its loop to stop at the next step boundary every rank agrees
        on, follow it there (its output shown here), grow the world (``_grown``) and start the cell again. Returns
        what goes on: the cell, started again on the larger world, or its result (``run.wait()`` follows either to
        the cell's end)."""
        growing.check_count(count)
        engines = self.engines()
        self.growing = count
        engines.signal(run.ranks, signal.SIGUSR2)  # engine/preempt.py: asking_to_resize
        self.say(
            f"asked the running cell to stop at its next step boundary (loader.steps()) to add {count} rank(s); "
            "a cell without one grows the world when it ends."
        )
        try:
            return run.advance()
        except BaseException:
            self.growing = 0
            growing.forget(engines)
            raise

    def replay(self) -> Replay:
        config = self.membership.config
        return Replay(
            membership=self.membership,
            setup=self.membership.history.setup_cells(),
            grace=config.recovery.grace,
            watchdog=config.recovery.watchdog,
            timeout=config.world.timeout,
            min_ranks=config.recovery.min_ranks,
        )

    def repair(self, result: RunResult, killed: list[int]) -> list[int]:
        """After a release or a broken collective, make the world usable again (``repair``)."""
        return repair(result, killed, self.recovery, self.membership.config.recovery.auto_restart, self.membership)


def _no_standby(engines: EngineSet) -> None:
    """Cancel the queued replacement (world/standby.py), if there is one: the world did not grow with it."""
    if engines.standby is not None:
        engines.give_up(engines.standby.sets)
        engines.standby = None
