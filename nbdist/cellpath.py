"""A cell's way through a cluster's ranks, with what follows it (``CellPath``).

It runs the cell (cells/run.py). When ranks died and the budget lasts, it restarts them, replays the setup
cells, restores, and runs the cell again (recovery.py). When the world was asked to grow while the cell ran
(``Cluster.grow`` beside a ``--noblock`` cell), the cell's loop stops for it at a step boundary every rank agrees
on (engine/preempt.py's ``Resizing``); the world grows from the state of that boundary (grow.py) and the cell
runs again on the larger world, going on from there. A cell whose loop has no such boundary (no
``loader.steps()``) grows the world when it ends.
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Callable
from dataclasses import dataclass

from . import grow as growing
from .cells.history import History
from .cells.output import Sink
from .cells.run import PendingRun, execute
from .config import RunConfig, StartConfig
from .errors import ClusterError, ConfigError
from .recovery import Recovery, Replay, repair
from .results import RunResult
from .world.engineset import EngineSet
from .world.standby import arrived


@dataclass(slots=True)
class CellPath:
    """A cell's way through a cluster's ranks with its repair policy (see the module's docstring). The callables
    are the Cluster's: its engines (raising when it is stopped), ``restart``, ``rebuild_world``, ``resize`` and
    ``grow`` (between cells)."""

    engines: Callable[[], EngineSet]
    config: StartConfig
    recovery: Recovery
    history: History
    say: Callable[[str], None]
    restart: Callable[[list[int]], float]
    rebuild: Callable[[], float]
    shrink: Callable[[list[int]], dict[int, int]] | None = None
    grow: Callable[[int], str] | None = None
    growing: int = 0  # ranks asked for while the cell runs: added where its loop stops for them
    grown: str = ""  # the line of the last grow made where a cell stopped for it

    def execute(self, code: str, cfg: RunConfig, sink: Sink | None, setup: bool) -> RunResult | PendingRun:
        cfg = self._joined_between_cells(cfg)

        def then(result: RunResult, recover: list[int]) -> RunResult | PendingRun:
            return self.after(result, recover, code, cfg, sink, setup)

        return execute(
            self.engines(),
            code,
            cfg,
            grace=self.config.grace,
            watchdog=self.config.watchdog,
            on_done=self.repair,
            sink=sink,
            then=then,
            death_grace=0.0 if self.recovery.left > 0 else None,  # the cell runs again: nothing to wait for
            tick=self.tick,
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
        if standby is None or self.grow is None or not arrived(engines):
            return cfg
        try:
            self.grow(standby.count)
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
        self.recovery.checkpoint = result.checkpoint or self.recovery.checkpoint
        if result.ok:  # setup cells among them are what recovery replays
            self.history.add(code, cfg.ranks, setup)
        if self.growing and not dead:
            return self._grown(result, code, cfg, sink, setup)
        line = ""
        try:
            line = self.recovery.recover(dead, self.replay(), self.say) if dead else ""
        except ClusterError as exc:
            result.notes.append(str(exc))
        if not line:
            return result
        new = self.recovery.renumbered  # the world went on with fewer ranks: the cell runs on those left
        ranks = cfg.ranks if new is None else [new[r] for r in cfg.ranks if r in new]
        if new is not None and sink is not None:
            sink.resized(new, self.recovery.sizes[-1].step)
        again = self.execute(
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
            self.grown = self.grow(count) if self.grow is not None else ""
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
            sink.resized({r: r for r in range(after)}, self.recovery.sizes[-1].step, joined=list(range(before, after)))
        again = self.execute(code, dataclasses.replace(cfg, ranks=ranks), sink, setup)
        lines = [*result.recovered, self.grown]
        if isinstance(again, PendingRun):
            again.carried[:0] = lines
        else:
            again.recovered[:0] = lines
        return again

    def replay(self) -> Replay:
        return Replay(
            restart=self.restart,
            engines=self.engines(),
            setup=self.history.setup_cells(),
            grace=self.config.grace,
            watchdog=self.config.watchdog,
            timeout=self.config.timeout,
            shrink=self.shrink,
            min_ranks=self.config.min_ranks,
        )

    def repair(self, result: RunResult, killed: list[int]) -> list[int]:
        """After a release or a broken collective, make the world usable again (``repair``)."""
        return repair(result, killed, self.recovery, self.config.auto_restart, self.restart, self.rebuild)


def _no_standby(engines: EngineSet) -> None:
    """Cancel the queued replacement (world/standby.py), if there is one: the world did not grow with it."""
    if engines.standby is not None:
        engines.give_up(engines.standby.sets)
        engines.standby = None
