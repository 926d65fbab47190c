"""What each engine's reply to a cell says, read from ipyparallel's AsyncResult and its metadata: the error
it reported, the exit its code made (engine/exits.py), how long it took, the displays it showed; ``collect``
gathers them into the cell's RunResult."""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

from .. import wire
from ..results import RankResult, RankState, RankStatus, Release, RunResult, classify, remote_error
from ..world.engineset import EngineSet


def shown(outputs: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """A rank's displays without its debugger's messages (those went to the relay)."""
    return [c for c in outputs or [] if wire.PDB not in (c.get("data") or {})]


def error_of(child: Any) -> BaseException | None:
    """The error one engine reported for this cell (ipyparallel stores it as the result)."""
    if not child.done():
        return None
    md = child.output.metadata
    if md.get("status") == "ok":  # the reply said ok (its result is then ipyparallel's ExecuteReply): what iopub said
        err = md.get("error")  # two reads of the future fewer, for each of three looks at every rank's reply
        return err if isinstance(err, BaseException) else None
    exc = child.exception()
    if exc is not None:
        return exc
    res = child.result()
    if isinstance(res, BaseException):
        return res
    err = md.get("error")
    return err if isinstance(err, BaseException) else None


def exit_of(child: Any) -> dict[str, Any] | None:
    """What a rank's exit() in this cell said (engine/exits.py): status, cell line, code; None if none."""
    return (child.output.metadata.get("data") or {}).get(wire.EXITED)


def state_of(child: Any) -> RankState:
    """The state a rank's reply leaves it in until the cell is over: exited, failed, dead (its engine died:
    ipyparallel's EngineError), or idle."""
    if exit_of(child) is not None:
        return RankState.EXITED
    err = error_of(child)
    if err is None or getattr(err, "ename", "") == "Resizing":  # stopped for a grow (engine/preempt.py): no failure
        return RankState.IDLE
    return RankState.DEAD if getattr(err, "ename", "") == "EngineError" else RankState.FAILED


def seconds_between(start: Any, end: Any) -> float | None:
    try:
        if isinstance(start, str):
            start = datetime.fromisoformat(start)
        if isinstance(end, str):
            end = datetime.fromisoformat(end)
        return float((end - start).total_seconds())
    except (TypeError, ValueError):
        return None


def collect(
    children: list[Any],
    engines: EngineSet,
    ranks: list[int],
    *,
    dead: dict[int, int],
    killed: list[int],
    released: Release | None,
    reports: dict[int, dict[str, Any]],
    metrics: dict[int, list[dict[str, Any]]],
    started: float,
) -> RunResult:
    """Each rank's reply as a RankResult, in one RunResult: ``dead`` the children whose process ended before they
    replied (by pid), ``killed`` the ranks nbdist ended, ``reports`` where released ranks were."""
    checkpoint: dict[str, Any] | None = None
    out = []
    for i, child in enumerate(children):
        rank = ranks[i]
        md = child.output.metadata
        info = engines.ranks[rank]
        rr = RankResult(rank=rank, engine_id=info.engine_id, host="" if info.local else info.host)
        rr.stdout, rr.stderr = md.get("stdout") or "", md.get("stderr") or ""
        rr.outputs = shown(md.get("outputs"))
        rr.result = md.get("execute_result")
        rr.wall_s = seconds_between(md.get("started"), md.get("completed"))
        checkpoint = (md.get("data") or {}).get(wire.CHECKPOINT, checkpoint)
        rr.exited = exit_of(child)
        exc = error_of(child)
        if i in dead and not child.done():
            rr.status = RankStatus.DEAD
            rr.error = {
                "ename": "EngineError",
                "evalue": f"its process (pid {dead[i]}) ended",
                "traceback": [],
            }
        elif rank in killed or not child.done():
            rr.status = RankStatus.DEAD
            seen = reports.get(rank) or {}
            place = (seen.get("stack") or [""])[-1].rsplit("/", 1)[-1]
            at = f" (last seen in {seen.get('function')}, {place})" if place else " (silent when asked where it was)"
            rr.error = {"ename": "Killed", "evalue": f"did not stop after an interrupt{at}; nbdist ended it"}
            rr.error["traceback"] = []
        elif exc is not None:
            rr.error = remote_error(exc)
            rr.status = classify(rr.error, released)
            report = reports.get(rank, {})
            if report.get("cell_line") and not rr.error.get("line"):
                rr.error["line"] = report["cell_line"]
        else:
            rr.status = RankStatus.OK
        out.append(rr)
    result = RunResult(
        ranks=out,
        wall_s=time.perf_counter() - started,
        released=released,
        reports=reports if released else {},
        metrics=metrics,
        checkpoint=checkpoint,
    )
    result.explain()
    return result
