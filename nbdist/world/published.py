"""Each rank's state and place as a file, ``<world>/ranks.json`` (0600, in the world's 0700 directory),
rewritten at each change of the board (board.py): the world panel (the server extension) reads it while
the kernel runs a cell and cannot be asked. Written whole and renamed into place, so a reader sees the
file before a change or after it, never half of it."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from .board import Board, RankNow

FILE = "ranks.json"


class Published:
    """A board listener (``board.subscribe(Published(...))``) that rewrites the file; ``ranks()`` gives
    each rank's RankInfo (host, pid, device) as the engine set has it now."""

    def __init__(self, workdir: str, board: Board, ranks: Callable[[], list[Any]]) -> None:
        self.path = os.path.join(workdir, FILE)
        self.board = board
        self.ranks = ranks
        self._lock = threading.Lock()  # the client's IO thread and the kernel's both see changes

    def __call__(self, now: RankNow) -> None:
        self.write()

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
