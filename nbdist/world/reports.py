"""Where ranks are now, as each rank's watcher says it: its stack summary, written when asked (SIGUSR1)."""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

from .. import wire
from .engineset import EngineSet


def where(engines: EngineSet, ranks: list[int], wait: float = 0.5) -> dict[int, dict[str, Any]]:
    """Where these ranks are now: SIGUSR1 makes each one's watcher write its stack summary."""
    paths = {r: os.path.join(engines.workdir, wire.REPORT.format(rank=r)) for r in ranks}
    for path in paths.values():
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    engines.signal(ranks, signal.SIGUSR1)
    reports: dict[int, dict[str, Any]] = {}
    end = time.monotonic() + wait
    while time.monotonic() < end and len(reports) < len(paths):
        for rank, path in paths.items():
            if rank not in reports and os.path.exists(path):
                try:
                    with open(path) as fh:
                        reports[rank] = json.load(fh)
                except (OSError, ValueError):
                    pass
        time.sleep(0.01)
    engines.board.reported({r: (bool(rep.get("debugging")), rep.get("cell_line")) for r, rep in reports.items() if rep.get("busy")})
    return reports


def break_now(engines: EngineSet) -> None:
    """The release about to be sent breaks the process group at once (engine/runtime.py reads the time it was
    written: a file older than BREAK_S is a stale one and ignored)."""
    try:
        wire.write_private(os.path.join(engines.workdir, wire.BREAK_NOW), repr(time.time()))
    except OSError:
        pass  # the ranks wait their moment as for any release
