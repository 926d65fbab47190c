"""Keys and message types nbdist sends between ranks and notebook over ipyparallel's channels: one place
for both sides, the rank that publishes (engine/metrics.py, parallel/checkpoint.py, engine/debug.py, engine/exits.py) and
the notebook that reads (cells/watch.py, cells/pdbrelay.py). A leaf: it imports nothing of nbdist's."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

METRICS = "nbdist.metrics."  # + a sequence number: rows logged with nbdist.log
EXITED = "nbdist.exited"  # the cell's code called exit() on a rank: its status and cell line
CHECKPOINT = "nbdist.checkpoint"  # the cell's last save_checkpoint: its path and the names it saved
PDB = "application/vnd.nbdist.pdb+json"  # a display: a rank's live debugger printed this (and prompts, or left)
PDB_REQUEST = "nbdist_pdb_request"  # control channel, notebook -> rank: a line typed for its debugger
PDB_REPLY = "nbdist_pdb_reply"  # its answer: {"status": "ok"} or {"status": "refused", "why": ...}
KEEP_ENV = "NBDIST_KEEP_S"  # in a kept world's processes: seconds of idleness it outlives the kernel by
LEASE = "lease"  # in a kept world's directory: its modification time is the world's last sign of life
STEPS_ENV = "NBDIST_STEPS_DIR"  # where each engine says its step on the way in (engine/steps.py)
WAITING = "waiting-{pid}"  # in a kept world's directory: this process saw its kernel go and waits out the lease
BREAK_NOW = "break-now"  # in the world's directory: the time of a release that breaks the group at once (a death)
REPORT = "rank{rank}.json"  # in the world's directory: where a rank is, written when it gets SIGUSR1 (engine/runtime.py)
PEER_ENV = "NBDIST_PEER_RECOVERY"  # "1" on a rank of a world that recovers from a live peer (parallel/peer.py)


def write_private(path: str, text: str) -> None:
    """Write one of the files above (or a preflight line, a kept world's record) that another process polls for:
    0600, through a temporary name and a rename, so that a reader that looks for ``path`` (by name, or by a glob
    on its suffix) sees it whole or not at all, never created and still empty."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- recovery from a live peer
# What a living rank answers when asked to hold its state (parallel/peer_give.hold, on the rank) and what the
# notebook decides from the answers (lifecycle/peer_recovery.decide). Typed, so that a misspelt field is an error
# mypy finds, not a KeyError on a rank in the middle of a recovery; versioned, so that a rank of another nbdist
# is said, not misread.

HOLDING_VERSION = 2  # 2: several models and optimizers, every loader


@dataclass(frozen=True, slots=True)
class Names:
    """The variables of a rank's namespace that hold its training state, by their names there."""

    models: tuple[str | None, ...] = ()  # each optimizer's module (each once)
    optimizers: tuple[str | None, ...] = ()
    loader: str | None = None  # the loader the loop runs over (its step is the loop's)
    extra: str = ""  # the extra= dict of the last save_checkpoint
    state: dict[str, str] = field(default_factory=dict)  # the state= objects of the last save_checkpoint: key -> name

    def complete(self) -> bool:
        return bool(self.models and self.optimizers and self.loader and all(self.models) and all(self.optimizers))


@dataclass(frozen=True, slots=True)
class Holding:
    """A living rank's answer to 'hold your state': what it can give, or why it can give nothing."""

    rank: int
    why: str = ""  # why it can give nothing ('' when it can)
    done: int = 0  # optimizer steps it completed
    steps: dict[int, int] = field(default_factory=dict)  # its own parts: steps completed -> the loop step after them
    passes: dict[int, int] = field(default_factory=dict)  # and -> the passes over the loop's loader the cell finished
    checksum: str = ""  # of what every rank holds alike (parameters, optimizer), bit for bit
    keeps: dict[int, tuple[int, bool]] = field(default_factory=dict)  # parts kept for others: steps -> (whose, exact)
    names: Names = field(default_factory=Names)
    version: int = HOLDING_VERSION
