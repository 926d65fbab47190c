"""Each rank's state and place as a file, ``<world>/ranks.json`` (0600, in the world's 0700 directory),
rewritten after the board changes (board.py): the world panel (the server extension) reads it while
the kernel runs a cell and cannot be asked. Written whole and renamed into place, so a reader sees the
file before a change or after it, never half of it.

A writer thread of its own writes it, off the cell's path: a change wakes it, and the changes that come while it
writes (a cell's start sets every rank busy, one change each) are one more write, not one each. Before, the
kernel wrote the whole file once per rank per change, on the cell's path: 128 writes of 64 rows for a trivial
cell at 64 ranks. Writes are at least ``GAP`` seconds apart (the panel reads the file once a second): at 16 ranks
the replies of a trivial cell, one change each as they came, made the writer a fifth of the kernel's CPU."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from .board import Board, RankNow

FILE = "ranks.json"
GAP = 0.25  # seconds at least between two writes; flush() and close() do not wait for it


class Published:
    """A board listener (``board.subscribe(Published(...))``) that rewrites the file; ``ranks()`` gives
    each rank's RankInfo (host, pid, device) as the engine set has it now."""

    def __init__(self, workdir: str, board: Board, ranks: Callable[[], list[Any]]) -> None:
        self.path = os.path.join(workdir, FILE)
        self.board = board
        self.ranks = ranks
        self._lock = threading.Lock()  # the writer's, and write() called directly
        self._dirty = threading.Condition()
        self._pending = 0  # changes not yet written
        self._closed = False
        self._hurry = False  # flush() waits: write now, not after the gap
        self._idle = False  # the writer waits for a change (not in its gap)
        self._writer: threading.Thread | None = None

    def __call__(self, now: RankNow) -> None:
        """A change: the writer writes it soon (a burst of changes, once)."""
        with self._dirty:
            if self._closed:
                return
            self._pending += 1
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_on, name="nbdist-published", daemon=True)
                self._writer.start()
            if self._idle:  # in its gap the writer is not woken: a woken thread takes the GIL from the changing one
                self._dirty.notify_all()

    def _write_on(self) -> None:
        while True:
            with self._dirty:
                self._idle = True
                while not self._pending and not self._closed:
                    self._dirty.wait()
                self._idle = False
                if self._closed and not self._pending:
                    return
                self._pending = 0
            self.write()
            with self._dirty:
                self._dirty.notify_all()  # for flush()
                self._dirty.wait_for(lambda: self._closed or self._hurry, timeout=GAP)
                self._hurry = False

    def flush(self, timeout: float = 5.0) -> None:
        """Until every change so far is in the file."""
        deadline = time.monotonic() + timeout
        with self._dirty:
            self._hurry = bool(self._pending)
            self._dirty.notify_all()
            while self._pending and self._writer is not None and time.monotonic() < deadline:
                self._dirty.wait(timeout=0.05)
        with self._lock:
            pass  # a write under way has ended

    def close(self) -> None:
        """Write what is pending, then end the writer (the world stopped)."""
        with self._dirty:
            self._closed = True
            self._dirty.notify_all()
            writer = self._writer
        if writer is not None and writer is not threading.current_thread():
            writer.join(timeout=5)

    def write(self) -> None:
        states = self.board.get()
        rows = []
        for info in self.ranks():
            now = states.get(info.rank)
            rows.append(
                {
                    "rank": info.rank,
                    "state": str(now.state) if now else "idle",
                    "cell": now.cell if now else "",
                    "line": now.line if now else None,
                    "since": now.since if now else 0.0,
                    "host": info.host,
                    "pid": info.pid if info.local else 0,  # a pid means something only on this host
                    "device": f"cuda:{info.gpu}" if info.gpu is not None else "cpu",
                }
            )
        data = json.dumps({"ranks": rows, "at": time.time()})
        with self._lock:
            tmp = f"{self.path}.{threading.get_ident()}"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as fh:
                    fh.write(data)
                os.replace(tmp, self.path)
            except OSError:
                pass  # the world's directory is gone (stopped): nobody to show it to


def read(workdir: str) -> list[dict[str, Any]] | None:
    """The ranks as last written; None when there is no such file, or it cannot be read."""
    try:
        with open(os.path.join(workdir, FILE)) as fh:
            return list(json.load(fh)["ranks"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
