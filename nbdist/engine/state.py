"""The one dict of state each engine process keeps (plain values, easy to inspect)."""

from __future__ import annotations

from typing import Any

# One dict of state per engine process; plain values so it is easy to inspect.
STATE: dict[str, Any] = {
    "rank": None,
    "world_size": None,
    "backend": None,
    "store": None,
    "pg_fds": [],
    "control": {},  # control.control_group(purpose): nbdist's own gloo groups, made on first use
    "control_of": None,  # the default group they belong to (a rebuilt world makes new ones)
    "aborted": False,
    "busy_since": None,
    "cell": 0,
    "main_ident": None,
    "report_dir": None,
    "watcher": None,
    "debugging": False,  # a live pdb (breakpoint() in a cell) holds this rank, waiting for the notebook
    "kernel": None,  # this engine's kernel, once engine/debug.py took its control channel
    "exited": None,  # the cell's code raised SystemExit: what engine/exits.py says of it at the cell's end
    "child_of": None,  # in a process forked from a rank (a cell's own child): the rank and its pid
    "abort_after": 0.3,  # seconds an interrupted cell may take to stop before its process group is broken
}

# Run when each cell ends, before it counts as done (runtime's post-cell hook): work a cell started in
# the background that must not outlive it unseen (parallel/checkpoint.py: asynchronous saves complete,
# or say why they failed). Kept here, below runtime and parallel, which both reach it.
CELL_END: list[Any] = []


def at_cell_end(fn: Any) -> None:
    """Call ``fn()`` at the end of every cell from now on (once, however often it is registered)."""
    if fn not in CELL_END:
        CELL_END.append(fn)


def whoami() -> tuple[int | None, int]:
    """This engine's rank and pid, asked now (a kept world proves itself alive with them)."""
    import os

    return STATE["rank"], os.getpid()
