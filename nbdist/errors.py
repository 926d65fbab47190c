"""Exceptions raised by nbdist. Every message says what happened and what to do."""

from __future__ import annotations


class NbdistError(Exception):
    """Base class for every error nbdist raises on purpose."""


class ConfigError(NbdistError, ValueError):
    """A value given to nbdist is not usable; the message names it and the fix."""


class ClusterError(NbdistError, RuntimeError):
    """The cluster could not be started, reached or repaired."""


class RankError(NbdistError):
    """Code failed on one or more ranks.

    ``failures`` holds one entry per failed rank (lowest rank first), each with the
    rank, engine id, exception name, message, cell line and the remote traceback.
    IPython renders this error with ``_render_traceback_``: the first failing rank's
    traceback (with the cell's own source lines) comes first, then a summary.
    """

    def __init__(self, message: str, failures: list[dict] | None = None, notes: list[str] | None = None):
        super().__init__(message)
        self.failures = failures or []
        self.notes = notes or []

    @property
    def rank(self) -> int | None:
        return self.failures[0]["rank"] if self.failures else None

    @property
    def engine_id(self) -> int | None:
        return self.failures[0]["engine_id"] if self.failures else None

    def _render_traceback_(self) -> list[str]:
        lines: list[str] = []
        for failure in self.failures[:1]:
            if failure.get("status") in ("interrupted", "timeout"):
                continue  # where it waited is in the notes; its traceback is torch's internals
            lines.append(f"--- traceback from rank {failure['rank']} (engine {failure['engine_id']}) ---")
            lines.extend(failure.get("traceback") or [])
        lines.append(str(self))
        lines.extend(self.notes)
        return lines


class RunTimeout(RankError):
    """A cell ran past its ``timeout``; ranks were released and where each waited is reported."""
