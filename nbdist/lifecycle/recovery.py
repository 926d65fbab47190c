"""Automatic recovery (``--max-restarts N``): a rank died during a cell, and the cell still succeeds.

What it does, in order, each step on every rank together:

1. restart the dead ranks (same rank numbers, fresh engines) and rebuild the process
   group on every rank (``Membership.restart``): a group that lost a member cannot be mended;
   with ``--min-ranks``, when their engines cannot start, go on without them instead: the
   others numbered again, a smaller process group (``Membership.shrink``, ``_shrink``);
2. replay the cells marked ``%%distributed --setup`` (imports, model, optimizer, data), in
   the order they last ran, on the ranks they ran on: the survivors too, since their
   model and optimizer belong to the old process group; setup cells may hold collectives;
3. give the rebuilt objects the state from a living rank's memory (peer_recovery.py), or
   load the latest checkpoint of the last ``save_checkpoint`` (model, optimizer, the loader's
   position, each rank's RNG states);
4. run the interrupted cell again, and say in one line what happened and how long it took.

The budget counts down over the session; when it is spent, a death fails the cell as
before. Only deaths are recovered: an error raised by the cell, a timeout or Ctrl-C is
the user's to see, and a hang would hang again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..cells.history import Cell
from ..cells.output import Sink
from ..cells.run import execute
from ..config import RecoveryConfig, RunConfig
from ..engine.recovering import load_latest_on_rank
from ..errors import ClusterError
from ..results import RankStatus, RunResult
from ..world.engineset import EngineSet
from . import peer_recovery, rerun
from .membership import Membership, Resize


@dataclass(frozen=True, slots=True)
class Replay:
    """What a recovery is given, explicitly: the world's membership (which restarts and shrinks it), the setup
    cells to replay in order, and the run settings the replayed cells and the restore use."""

    membership: Membership
    setup: Sequence[Cell]
    grace: float
    watchdog: float | None
    timeout: float
    min_ranks: int | None = None  # --min-ranks: the fewest the world goes on with (None: it never shrinks)

    @property
    def engines(self) -> EngineSet:
        return self.membership.live()


@dataclass(slots=True)
class Recovery:
    """A cluster's recovery state: the budget left and the last checkpoint's whereabouts."""

    budget: int = 0
    used: int = 0
    checkpoint: dict[str, Any] | None = None  # {"path": ..., "names": {"model": ..., ...}}
    peer: bool = True  # rebuild from the living ranks' memory where that is exact (peer_recovery.py)
    renumbered: dict[int, int] | None = None  # the last recovery's old rank -> new rank, when the world shrank
    phases: dict[str, float] = field(default_factory=dict)  # the last recovery's parts, in seconds (benchmarks)
    span: tuple[float, float] = (0.0, 0.0)  # the last recovery's start and end, time.perf_counter() (benchmarks)

    @classmethod
    def of(cls, config: RecoveryConfig) -> Recovery:
        """A world's recovery state at its start: the budget and source its config names."""
        return cls(budget=config.max_restarts, peer=config.recover_from == "peer")

    @property
    def left(self) -> int:
        return self.budget - self.used

    def remember(self, checkpoint: dict[str, Any] | None, setup: str = "") -> None:
        """After a cell: the checkpoint it saved is the one a recovery loads. ``setup``: the code of a setup cell that
        succeeded; one that binds the last checkpoint's model or optimizer anew begins another run, so that
        checkpoint is of objects that are gone (a run killed before its first save would go on from another run's
        step): it is forgotten, and a recovery starts from what the replayed setup cells build."""
        if checkpoint:
            self.checkpoint = checkpoint
            return
        names = (self.checkpoint or {}).get("names") or {}
        held = {names.get("model"), names.get("optimizer")} - {None}
        if setup and held & rerun.binds(setup):
            self.checkpoint = None

    def wants(self, result: RunResult, killed: list[int]) -> list[int]:
        """The ranks to recover from this result: those that died by themselves, while budget is left."""
        if self.left <= 0:
            return []
        return sorted(r.rank for r in result.ranks if r.status == RankStatus.DEAD and r.rank not in killed)

    def recover(
        self, dead: list[int], replay: Replay, say: Callable[[str], None], ended: Sequence[int] = (), code: str = ""
    ) -> str:
        """Restart ``dead`` (or, with --min-ranks, go on without them when they cannot be replaced), rebuild the
        world, replay the setup cells, restore from a living rank or the checkpoint; return what was done as one
        line (``say`` gets it too). ``ended``: those of ``dead`` that nbdist ended because they did not stop after
        the release (cells/release.py), said apart; ``code``: the cell that runs again after. A rank that dies
        during the recovery itself is taken into a new round, with those the round before was rebuilding, while
        the budget lasts (a round counts as one restart). Raises ClusterError naming the step that failed, or the
        ranks the world is short of."""
        tic = time.perf_counter()
        died = ", ".join(str(r) for r in dead if r not in ended)
        why = f"rank(s) {died} died during the cell" if died else ""
        if ended:
            stuck = f"rank(s) {', '.join(map(str, ended))} did not stop after the release and were ended"
            why = f"{why} and {stuck}" if why else stuck
        during: list[int] = []  # ranks that died during the recovery itself
        while True:
            try:
                what = self._round(list(dead), replay, code)
                now = replay.engines.dead_ranks()
                if not now:
                    break
                dead = now  # died after the round: the others hold what it restored
            except _DiedDuring as died_during:
                dead = sorted(set(dead) | set(died_during.ranks))  # what the round was rebuilding has no state yet
                now = died_during.ranks
            during += [r for r in now if r not in during]
            if self.left <= 0:
                listed = ",".join(map(str, dead))
                raise ClusterError(
                    f"{why}; rank(s) {', '.join(map(str, during))} died during its recovery, and the automatic "
                    f"restarts are spent ({self.budget} of {self.budget}): the world is short of rank(s) "
                    f"{', '.join(map(str, replay.engines.dead_ranks()))}; %dist_restart --ranks {listed} brings them "
                    "back."
                )
        self.span = (tic, time.perf_counter())
        if during:
            why += f"; rank(s) {', '.join(map(str, during))} died during its recovery"
        line = (
            f"{why}; {', '.join(what)} in {time.perf_counter() - tic:.1f} s, "
            f"and ran the cell again (automatic restarts left: {self.left} of {self.budget})."
        )
        say(line)
        return line

    def _round(self, dead: list[int], replay: Replay, code: str) -> list[str]:
        """One try at the recovery (the class's recover); what was done, in a few words each. _DiedDuring as soon as
        another rank is found dead, between its steps or as the reason one failed."""
        self.used += 1
        self.renumbered = None
        tic = time.perf_counter()
        listed = ", ".join(map(str, dead))
        said, not_peer = peer_recovery.ask(replay.engines, dead, replay.timeout) if self.peer else (None, "")
        _look(replay, dead)
        self.phases = {"ask": time.perf_counter() - tic}
        before = len(replay.engines.ranks)
        try:
            replay.membership.restart(dead)
            what, renumbered = [f"restarted rank(s) {listed}", "rebuilt the process group"], None
        except Exception as exc:
            _look(replay, dead)
            renumbered = self.renumbered = _shrink(dead, replay, exc)
            what = [f"could not replace them ({_first_line(exc)})", _continuing(renumbered, before)]
            what += replay.engines.given_back
            if replay.engines.standby is not None:
                what.append(replay.engines.standby.said())
        self.phases["restart"] = time.perf_counter() - tic - sum(self.phases.values())
        chosen = None
        if said is not None:
            chosen, not_peer = peer_recovery.decide(said, [] if renumbered else dead, renumbered, code)
        try:
            replay_setup(replay, "automatic recovery")
        except ClusterError:
            _look(replay)
            raise
        self.phases["replay"] = time.perf_counter() - tic - sum(self.phases.values())
        if replay.setup:
            what.append(f"replayed {len(replay.setup)} setup cell(s)")
        elif not renumbered:
            what.append("no cell is marked %%distributed --setup, so restarted ranks start empty")
        step: int | None = None
        if chosen is not None:
            try:
                step = peer_recovery.give(replay.engines, chosen, replay.timeout)
                was = next((old for old, new in (renumbered or {}).items() if new == chosen.source), chosen.source)
                source = f"{chosen.source}'s" if was == chosen.source else f"{chosen.source}'s (was rank {was})"
                what.append(f"rebuilt step {step} from rank {source} memory (nothing recomputed)")
            except ClusterError as exc:
                _look(replay)
                chosen, not_peer = None, str(exc)
        try:
            restored = _load_latest(replay, self.checkpoint, renumbered) if chosen is None else None
        except ClusterError:
            _look(replay)
            raise
        if chosen is None and not_peer:
            what.append(f"not from a living rank: {not_peer}")
        if restored is not None:
            step = restored
            what.append(f"restored step {restored} from {self.checkpoint['path']}")  # type: ignore[index]
        elif chosen is None and replay.setup:
            what.append(
                "no checkpoint was saved since the setup cells ran, so the cell starts again from what they build"
            )
        self.phases["restore"] = time.perf_counter() - tic - sum(self.phases.values())
        if renumbered:
            replay.membership.resized(Resize(before, len(renumbered), step, list(dead), time.time()))
        return what


class _DiedDuring(Exception):
    """Ranks found dead during a recovery's round (another round takes them in)."""

    def __init__(self, ranks: list[int]) -> None:
        super().__init__(f"rank(s) {ranks} died during the recovery")
        self.ranks = ranks


def _look(replay: Replay, rebuilding: Sequence[int] = ()) -> None:
    """Between a recovery's steps: _DiedDuring when a rank other than those being rebuilt is dead (a step that
    failed looks too, since a death is the likeliest reason)."""
    now = [r for r in replay.engines.dead_ranks() if r not in rebuilding]
    if now:
        raise _DiedDuring(now)


def replay_setup(replay: Replay, who: str) -> None:
    """Run the setup cells again, in order, each on the ranks it last ran on; ClusterError naming the one that
    failed (``who``: what replays them, for the message)."""
    for i, cell in enumerate(replay.setup, 1):
        result = execute(
            replay.engines,
            cell.code,
            RunConfig(ranks=cell.ranks),
            grace=replay.grace,
            watchdog=replay.watchdog,
            on_done=lambda r, k: [],
            sink=Sink(),
        )
        assert isinstance(result, RunResult)  # a blocking run
        if not result.ok:
            # the rank whose own error or death it was, not the first of those the release interrupted for it
            cause = sorted(result.failed, key=lambda r: r.status in (RankStatus.INTERRUPTED, RankStatus.TIMEOUT))
            why = cause[0].failure().summary
            raise ClusterError(f"{who}: setup cell {i} of {len(replay.setup)} failed when replayed: {why}")


def _first_line(exc: BaseException) -> str:
    """The first sentence of why (a failed start says much more: where each engine got to, its log)."""
    return (str(exc).splitlines() or [type(exc).__name__])[0].split(". ")[0][:200]


def _shrink(dead: list[int], replay: Replay, exc: BaseException) -> dict[int, int]:
    """The dead ranks' replacement did not start (``exc``): with --min-ranks, go on with the living ranks when
    there are enough (their new numbers); else ClusterError naming what was lost and what to do."""
    listed, left = ", ".join(map(str, dead)), len(replay.engines.ranks) - len(dead)
    if replay.min_ranks is None:
        raise ClusterError(
            f"automatic recovery could not restart rank(s) {listed}: {exc}; run %dist_restart."
        ) from exc
    if left < replay.min_ranks:
        raise ClusterError(
            f"automatic recovery: rank(s) {listed} died and could not be replaced ({_first_line(exc)}); "
            f"{left} rank(s) are left, fewer than --min-ranks {replay.min_ranks}, so the world does not go on. "
            "Run %dist_restart once their hosts are back (or %dist_start again with fewer ranks)."
        ) from exc
    try:
        return replay.membership.shrink(dead)
    except Exception as again:
        raise ClusterError(
            f"automatic recovery could not go on without rank(s) {listed}: {_first_line(again)}; run %dist_restart."
        ) from again


def _continuing(renumbered: dict[int, int], before: int) -> str:
    moved = {old: new for old, new in renumbered.items() if old != new}
    said = f"continuing with {len(renumbered)} of {before} ranks"
    if moved:
        said += f" (rank(s) {', '.join(map(str, moved))} now {', '.join(map(str, moved.values()))})"
    return said + ", rebuilt the process group"


def _load_latest(replay: Replay, checkpoint: dict[str, Any] | None, renumbered: dict[int, int] | None) -> int | None:
    """Load the latest checkpoint on every rank at once (DCP loads collectively); its step or None. In a world
    that went on with fewer ranks, each rank loads the part it saved under its old number."""
    if not checkpoint:
        return None
    engines = replay.engines
    every = list(range(len(engines.ranks)))
    was = {new: old for old, new in (renumbered or {}).items()}
    calls: dict[int, Any] = {
        r: (load_latest_on_rank, (checkpoint["path"], checkpoint["names"], was.get(r)), {}) for r in every
    }
    loaded = engines.call_each(calls, timeout=replay.timeout)
    steps = loaded.ordered(f"automatic recovery: loading {checkpoint['path']}", every)
    return steps[0]


def repair(
    result: RunResult,
    killed: list[int],
    recovery: Recovery,
    auto_restart: bool,
    membership: Membership,
) -> list[int]:
    """After a release or a broken collective, make the world usable again (``membership`` restarts ranks or
    rebuilds the group) and say how in the notes; return the ranks left for automatic recovery (``CellPath.after``
    recovers them and runs the cell again)."""
    dead = sorted({r.rank for r in result.ranks if r.status == RankStatus.DEAD} | set(killed))
    listed = ", ".join(map(str, dead))
    tic = time.perf_counter()
    to_recover = recovery.wants(result, killed)
    if to_recover:  # Recovery.recover restarts them, replays the setup cells and runs the cell again; the ranks
        return sorted(set(to_recover) | set(killed))  # nbdist ended for not stopping are restarted with them
    hosts = {r.rank: r.host for r in result.ranks if r.host}
    named = f"rank(s) {', '.join(str(r) + (f' (on {hosts[r]})' if r in hosts else '') for r in dead)}"
    # only the dead: a plain %dist_restart replaces every rank, and the living would lose their variables
    bring_back = f"%dist_restart --ranks {','.join(map(str, dead))} brings them back (the other ranks keep their variables)"
    gone = membership.engines.launcher.why_gone() if dead and membership.engines is not None else ""
    bring_back = f"{gone}; {bring_back}" if gone else bring_back  # what held them all ended them (a Ray driver)
    if dead and recovery.budget and not killed:
        result.notes.append(
            f"{named} died and the automatic restarts are spent ({recovery.budget} of {recovery.budget}); {bring_back}."
        )
    elif dead and not (killed or auto_restart):
        result.notes.append(f"{named} died; {bring_back}.")
    elif dead:
        try:
            membership.restart(dead)
            result.notes.append(
                f"rank(s) {listed} did not stop and were restarted with the same rank(s) in "
                f"{time.perf_counter() - tic:.1f} s (their variables are gone); the process group was rebuilt."
            )
        except Exception as exc:
            result.notes.append(f"restarting rank(s) {dead} failed ({exc}); run %dist_restart.")
    elif result.released or any(r.broke_the_world() for r in result.ranks):
        try:
            membership.rebuild()
            result.notes.append(
                f"the process group was rebuilt in {time.perf_counter() - tic:.2f} s; variables on every rank are kept."
            )
        except Exception as exc:
            result.notes.append(f"rebuilding the process group failed ({exc}); run %dist_restart.")
    return []
