"""Run a cell on ranks: send it, follow it to the end, apply the release policy, hand back a RunResult.

``execute`` sends the cell through ipyparallel (as ``DirectView.execute`` and ``%%px`` do, each rank's reply
heard from its request's making on: compat.execute_heard) and ``Watch.follow`` (watch.py) watches it from the
calling thread:

* each rank's messages are heard in the order sent (heard.py: the iopub callback records
  them and wakes the loop), so nothing is lost or printed twice, and handed to a
  ``Sink`` (see output.py);
* ``ReleasePolicy`` (release.py) decides when ranks still running are released
  (a failure elsewhere, a timeout, the watchdog, Ctrl-C) and when those that do not
  stop are killed; an engine's watcher breaks its process group if it is stuck in a
  collective (see engine/runtime.py);
* when the cell is over, ``on_done(result, killed)`` is called: the Cluster's repair
  policy, which rebuilds the process group or restarts dead ranks, and returns the ranks
  left for automatic recovery; ``then(result, those ranks)`` makes the final result.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

from .. import compat
from ..config import RunConfig
from ..errors import ClusterError, NbdistError
from ..results import RunResult
from ..world import nodes
from ..world.engineset import EngineSet
from . import transcript
from .history import title
from .output import Sink, TaggedPrinter
from .watch import OnDone, Watch

# From this many ranks a cell goes out as one request that the controller's broadcast schedulers hand to each engine,
# instead of one request per engine from the notebook (benchmarks/stub_ranks.py measures both).
BROADCAST_FROM = 10**9
# From this many ranks a cell on the whole world goes out as one request a node, to its leader, which hands it to the
# node's other ranks and sends their replies back together (world/nodes.py; benchmarks/node_tree.py). Off while it
# is proven.
TREE_FROM = 10**9

# (result, ranks to recover) -> the result (Cluster's recovery), or the run that goes on in the cell's place
Then = Callable[[RunResult, list[int]], "RunResult | PendingRun"]


class PendingRun:
    """A cell started with block=False; ``wait()`` returns its RunResult."""

    def __init__(self, watch: Watch, then: Then | None = None) -> None:
        self._watch = watch
        self._then = then
        self._result: RunResult | None = None
        self._next: PendingRun | None = None  # the cell started again in this one's place (a grown world)
        self.carried: list[str] = []  # what was done before this run started, for its result's ``recovered``

    @property
    def ranks(self) -> list[int]:
        return self._watch.ranks

    def done(self) -> bool:
        if self._next is not None:
            return self._next.done()
        return self._result is not None or self._watch.ar.ready()

    def advance(self, timeout: float | None = None, show: bool = True) -> RunResult | PendingRun:
        """Follow this run to its end and apply what follows it: its RunResult, or the run that goes on in its
        place (the cell started again on a world that grew where its loop stopped for it)."""
        if self._result is None and self._next is None:
            result, recover = self._watch.follow(timeout=timeout, stream=show)
            out = self._then(result, recover) if self._then else result
            if isinstance(out, PendingRun):
                out.carried[:0] = self.carried
                self._next = out
            else:
                out.recovered[:0] = self.carried
                self._result = out
        return self._next if self._next is not None else self._result  # type: ignore[return-value]

    def ends(self, kept: transcript.Transcript) -> None:
        """The cell's transcript ends with this run's outcome."""
        self._then = _ending(kept, self._then)

    def wait(self, timeout: float | None = None, show: bool = True) -> RunResult:
        """Follow the cell to its end (releasing ranks after ``timeout`` seconds from its start). ``show``: its
        output as it comes and, if it failed, what failed (the lines its RankError would say; ``result()`` raises it).
        Shown or not, its metric rows are in the result and a tracked run has them."""
        out = self.advance(timeout, show)
        if not isinstance(out, RunResult):
            return out.wait(timeout, show)
        if show and not out.ok:
            try:
                out.raise_for_error()
            except NbdistError as err:
                print(err, file=sys.stderr)
        return out

    def result(self, timeout: float | None = None) -> RunResult:
        return self.wait(timeout).raise_for_error()

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"<nbdist.PendingRun on ranks {self._watch.ranks}: {state}; collect with .wait()>"


def execute(
    engines: EngineSet,
    code: str,
    cfg: RunConfig,
    *,
    grace: float,
    watchdog: float | None,
    on_done: OnDone,
    sink: Sink | None = None,
    then: Then | None = None,
    death_grace: float | None = None,
    tick: Callable[[], None] | None = None,
    listener: Any = None,
    dead: list[int] | None = None,
) -> RunResult | PendingRun:
    """Run ``code`` on ``cfg.ranks``. Blocking: follow it and return the RunResult; else a PendingRun.

    ``grace``, ``watchdog`` and ``death_grace`` are the release policy's (see release.py); ``on_done`` is
    called with every finished result, before it is returned; ``then`` last, with the ranks
    ``on_done`` returned, and what it returns is the result. ``tick``: called about once a second while
    the cell runs (watch.py). ``listener``: what else hears the metric rows of the default sink (a tracked run).
    ``dead``: the ranks the caller found dead just before (None: they are looked for here).
    """
    dead = [r for r in (engines.dead_ranks() if dead is None else dead) if r in cfg.ranks]
    if dead:
        where = engines.ranks[dead[0]].where()
        spec = ",".join(map(str, dead))
        raise ClusterError(
            f"rank {dead[0]}{f' ({where})' if where else ''} is dead; run %dist_restart --ranks {spec} (or "
            f"cluster.restart([{', '.join(map(str, dead))}])) to bring it back; the other ranks keep their variables."
        )
    kept = None
    if sink is None:
        kept = transcript.start(engines.workdir)  # what the cell shows, for a page opened later
        sink = TaggedPrinter(
            quiet_ranks=set(cfg.ranks[1:]) if cfg.quiet else set(), ranks=cfg.ranks, fold=not cfg.each, transcript=kept,
            expect=cfg.expect, listener=listener,
        )
    if kept is not None:
        then = _ending(kept, then)
    broadcast = len(cfg.ranks) >= BROADCAST_FROM
    view = engines.view(cfg.ranks, broadcast=broadcast)
    send: Callable[[Any, str, Callable[[int, Any], None]], Any]
    send = compat.execute_heard_broadcast if broadcast else compat.execute_heard
    whole = sorted(cfg.ranks) == list(range(len(engines.ranks)))
    if not broadcast and whole and len(cfg.ranks) >= TREE_FROM and nodes.usable(engines):
        try:
            send = functools.partial(compat.execute_heard_tree, nodes=nodes.joined(engines, cfg.ranks))
        except ClusterError as exc:  # the tree could not be joined: the cell goes the direct way, said once
            print(f"nbdist: {exc}; this cell goes to each rank on its own.", file=sys.stderr)
    watch = Watch(
        engines,
        cfg.ranks,
        lambda hear: send(view, code, hear),
        sink,
        grace=grace,
        watchdog=watchdog,
        on_done=on_done,
        cell=title(code),
        death_grace=death_grace,
        tick=tick,
    )
    if not cfg.block:
        return PendingRun(watch, then)
    result, recover = watch.follow(timeout=cfg.timeout, stream=True)
    final = then(result, recover) if then else result
    return final.wait() if isinstance(final, PendingRun) else final


def _ending(kept: transcript.Transcript, then: Then | None) -> Then:
    """``then``, after which the transcript ends with the cell's outcome (its error, as the magic raises it)."""

    def ended(result: RunResult, recover: list[int]) -> RunResult | PendingRun:
        final: RunResult | PendingRun = result
        try:
            final = then(result, recover) if then else result
        finally:
            if isinstance(final, PendingRun):  # the cell goes on in that run: the transcript ends with it
                final.ends(kept)
            else:
                kept.end(final)
        return final

    return ended
