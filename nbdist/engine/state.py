"""The state each engine process keeps as a rank: one typed object, plain values, easy to inspect."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(slots=True)
class RankSide:
    """What one rank's process knows of itself. Set by runtime.configure, the world's join and leave
    (engine/group.py), the cell hooks and the watcher thread; read across engine/ and parallel/."""

    rank: int | None = None
    world_size: int | None = None
    backend: str | None = None  # the world's, while this rank is in it
    store: Any = None  # the rendezvous TCPStore (rank 0 hosts it), kept while its address stays the world's
    store_at: tuple[str, int, bool] | None = None  # the store's address and port, and whether this rank serves it
    pg_fds: dict[int, Any] = field(default_factory=dict)  # the groups' TCP sockets: fd -> its two ends (shut by the watcher)
    control: dict[str, Any] = field(default_factory=dict)  # control.control_group(purpose): nbdist's own gloo groups
    control_of: Any = None  # the default group they belong to (a rebuilt world makes new ones)
    forming: tuple[str, float] | None = None  # the world nbdist formed: its keys' prefix in the store, its groups' timeout
    aborted: bool = False
    broke: tuple[int, int, float] | None = None  # the watcher's last break: connections shut, of how many, when
    broke_cpu: float | None = None  # the main thread's CPU seconds right after that break (cells/release.py, stuck)
    busy_since: float | None = None  # monotonic time the running cell began; None between cells
    cell: int = 0  # cells run so far
    main_ident: int | None = None  # the main thread, whose stack %dist_where reads
    report_dir: str | None = None  # where the watcher writes this rank's reports (the world's 0700 directory)
    watcher: Any = None  # the watcher thread
    debugging: bool = False  # a live pdb (breakpoint() in a cell) holds this rank, waiting for the notebook
    kernel: Any = None  # this engine's kernel, once engine/debug.py took its control channel
    exited: dict[str, Any] | None = None  # the cell's code raised SystemExit: what engine/exits.py says of it
    child_of: tuple[int | None, int] | None = None  # in a process forked from a rank: the rank and its pid
    abort_after: float = 0.3  # seconds an interrupted cell may take to stop before its process group is broken
    all_cpus: list[int] | None = None  # every core this engine may use (runtime.pin)

    def placed(self) -> tuple[int, int]:
        """This rank's rank and the world's size; RuntimeError before runtime.configure gave them."""
        if self.rank is None or self.world_size is None:
            raise RuntimeError("this engine has no rank yet: nbdist gives it one when the world starts")
        return self.rank, self.world_size

    def update(self, **values: Any) -> None:
        """Set several at once (names checked: a misspelt one is an AttributeError)."""
        for name, value in values.items():
            if not hasattr(self, name):
                raise AttributeError(f"RankSide has no {name!r}")
            setattr(self, name, value)

    def values(self) -> dict[str, Any]:
        """Every field and its value now (a shallow copy, for a test to put back)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


STATE = RankSide()

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

    return STATE.rank, os.getpid()
