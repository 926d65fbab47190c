"""Exceptions raised by nbdist. Every message says what happened and what to do."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any


class NbdistError(Exception):
    """Base class for every error nbdist raises on purpose."""


class ConfigError(NbdistError, ValueError):
    """A value given to nbdist is not usable; the message names it and the fix."""


class ClusterError(NbdistError, RuntimeError):
    """The cluster could not be started, reached or repaired."""


TRACEBACK_ENV = "NBDIST_TRACEBACK"  # "full": an interrupted cell shows nbdist's own frames too


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (Stop, the panel's Interrupt) ended a distributed cell: what each rank was doing is said above it,
    so a notebook shows one line, not the frames of nbdist that waited (IPython asks ``_render_traceback_``);
    ``NBDIST_TRACEBACK=full`` shows them. Still a KeyboardInterrupt: Run All stops, and code that catches one
    catches this."""

    def __init__(self, said: str = "every rank stopped; what each was doing is said above") -> None:
        super().__init__(said)
        self.said = said

    def __getattr__(self, name: str) -> Any:
        if name == "_render_traceback_" and os.environ.get(TRACEBACK_ENV) != "full":
            return lambda: [f"KeyboardInterrupt: {self.said}"]
        raise AttributeError(name)


# Named as what it is to a front end: the kernel's reply says ename "KeyboardInterrupt", as for any Ctrl-C.
Interrupted.__name__ = Interrupted.__qualname__ = "KeyboardInterrupt"


@dataclass(frozen=True, slots=True)
class Failure:
    """One rank's failure in a cell, as RankError carries it."""

    rank: int
    engine_id: int
    status: str  # a RankStatus value: error, dead, timeout, interrupted
    ename: str
    evalue: str
    line: int | None  # the cell line it failed at, when known
    traceback: list[str] = field(default_factory=list)  # the remote traceback, ANSI colours removed
    summary: str = ""  # one line: "rank 1 raised ValueError in cell line 4: ..."

    def __getitem__(self, key: str) -> Any:
        """``failure["rank"]``: failures were dicts before 0.2; the keys still read."""
        return getattr(self, key)


class RankError(NbdistError):
    """Code failed on one or more ranks.

    ``failures`` holds one Failure per failed rank, the cause first (the rank that raised,
    then dead, timed-out and interrupted ranks), each with the rank, engine id, exception
    name, message, cell line and the remote traceback. IPython renders this error with
    ``_render_traceback_``: the first failing rank's traceback (with the cell's own source
    lines) comes first, then a summary.
    """

    def __init__(self, message: str, failures: list[Failure] | None = None, notes: list[str] | None = None):
        super().__init__(message)
        self.failures = failures or []
        self.notes = notes or []
        self.cell: int | None = None  # the notebook's count for the cell (its prompt), where a magic knows it

    @property
    def rank(self) -> int | None:
        return self.failures[0].rank if self.failures else None

    @property
    def engine_id(self) -> int | None:
        return self.failures[0].engine_id if self.failures else None

    def _render_traceback_(self) -> list[str]:
        lines: list[str] = []
        for failure in self.failures[:1]:
            if failure.status in ("interrupted", "timeout"):
                continue  # where it waited is in the notes; its traceback is torch's internals
            lines.append(f"--- traceback from rank {failure.rank} ---")
            lines.extend(_numbered(_without_last(failure.traceback, failure.ename), self.cell))
        lines.append(str(self))
        lines.extend(self.notes)
        return lines


_CELL_IN = re.compile(r"Cell In\[\d+\]")


def _numbered(traceback: list[str], cell: int | None) -> list[str]:
    """A rank's traceback with the notebook's own count for the cell (a rank counts its cells apart: ``In[9]``
    under the notebook's ``[15]``)."""
    if cell is None:
        return traceback
    return [_CELL_IN.sub(f"Cell In[{cell}]", line) for line in traceback]


def _without_last(traceback: list[str], ename: str) -> list[str]:
    """The traceback without its last line, ``NameError: ...``: the summary below says it again, with the rank."""
    kept = list(traceback)
    while kept and not kept[-1].strip():
        kept.pop()
    if kept and (kept[-1].startswith(f"{ename}:") or kept[-1].strip() == ename):
        kept.pop()
    return kept


class RunTimeout(RankError):
    """A cell ran past its ``timeout``; ranks were released and where each waited is reported."""
