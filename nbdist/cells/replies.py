"""What one engine's reply to a cell says, read from ipyparallel's AsyncResult and its metadata: the error
it reported, the exit its code made (engine/exits.py), how long it took, and the displays it showed."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from .. import wire


def shown(outputs: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """A rank's displays without its debugger's messages (those went to the relay)."""
    return [c for c in outputs or [] if wire.PDB not in (c.get("data") or {})]


def error_of(child: Any) -> BaseException | None:
    """The error one engine reported for this cell (ipyparallel stores it as the result)."""
    if not child.done():
        return None
    exc = child.exception()
    if exc is not None:
        return exc
    res = child.result()
    if isinstance(res, BaseException):
        return res
    err = child.output.metadata.get("error")
    return err if isinstance(err, BaseException) else None


def exit_of(child: Any) -> dict[str, Any] | None:
    """What a rank's exit() in this cell said (engine/exits.py): status, cell line, code; None if none."""
    return (child.output.metadata.get("data") or {}).get(wire.EXITED)


def seconds_between(start: Any, end: Any) -> float | None:
    try:
        if isinstance(start, str):
            start = datetime.fromisoformat(start)
        if isinstance(end, str):
            end = datetime.fromisoformat(end)
        return float((end - start).total_seconds())
    except (TypeError, ValueError):
        return None
