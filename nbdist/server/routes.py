"""``GET {base_url}nbdist/api/kernels/<kernel id>/cells``: the distributed cells that kernel ran on its
world, as a page shows them, for the page that was not open when they ran (the lab extension in
js/ asks it while the cell runs, and once when a notebook opens).

Each cell: its id in the notebook, execution count, whether it still runs, a ``version`` that changes
whenever it showed more, and its ``outputs`` as nbformat outputs: the lines and displays it showed,
and the dashboard (as the static figure a finished cell leaves, drawn from the metric rows so far).

Safe by default: Jupyter's own authentication and its 'kernels' permission; only kernels of this
server; only worlds whose directory this user owns and nobody else can read (0700). The transcripts
are read from disk (cells/transcript.py), never from the busy kernel.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any

from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web

from ..cells import pointers, transcript
from ..cells.output import states_line
from ..results import STATE_COLOURS
from ..stragglers import slow

KEEP = 20  # the cells a page is given, newest last
MAX_IDS = 200  # the page's cells looked for in other kernels' worlds, at most


class CellsHandler(APIHandler):
    auth_resource = "kernels"

    @web.authenticated
    @authorized
    def get(self, kernel_id: str) -> None:
        """``?ids=a,b``: the page's cells with nothing shown; those this kernel's world did not run are looked for
        in the worlds of this server's other kernels (the notebook was renamed or moved while its cell ran)."""
        if kernel_id not in self.kernel_manager:
            raise web.HTTPError(404, f"no kernel {kernel_id} on this server")
        workdir = world_of(kernel_id)
        if workdir is not None and not owned(workdir):
            raise web.HTTPError(403, f"{workdir} is not this user's world (its directory must be yours, mode 0700)")
        paths = transcript.cells(workdir)[-KEEP:] if workdir is not None else []
        cells = [c for c in map(shown, paths) if c]
        ids = {i for i in self.get_argument("ids", "").split(",")[:MAX_IDS] if i} - {c["id"] for c in cells}
        if ids:
            others = [k for k in self.kernel_manager.list_kernel_ids() if k != kernel_id]
            cells += elsewhere(ids, others, kernel_id, workdir)
        self.finish(json.dumps({"cells": cells}))
        if workdir is not None:
            forget([p for p in SHOWN if p in paths or not p.startswith(transcript.directory(workdir))])


def elsewhere(ids: set[str], kernels: list[str], mine: str, workdir: str | None) -> list[dict[str, Any]]:
    """The newest run of each of the cells ``ids`` in the worlds of ``kernels`` (this user's own), each with a
    first line saying which kernel ran it: a notebook renamed or moved while its cell ran is opened with a new
    kernel, and the one that ran the cell keeps its world."""
    found: dict[str, dict[str, Any]] = {}
    for kernel in kernels:
        world = world_of(kernel)
        if world is None or world == workdir or not owned(world):
            continue
        for path in transcript.cells(world)[-KEEP:]:
            head = transcript.header(path)
            if head is None or head[0] not in ids:
                continue
            cell = shown(path)
            if cell is None:
                continue
            said = (
                f"nbdist: kernel {kernel[:8]} ran this cell, not this page's kernel ({mine[:8]}): the notebook was "
                "renamed or moved since, or opened with another kernel; that kernel holds the world it ran on\n"
            )
            note = {"output_type": "stream", "name": "stderr", "text": said}
            found[head[0]] = {**cell, "outputs": [note, *cell["outputs"]]}
    return list(found.values())


def world_of(kernel_id: str) -> str | None:
    """The world directory this kernel's last distributed cell ran on, as the kernel left it."""
    try:
        with open(pointers.pointer_path(kernel_id)) as fh:
            return str(json.load(fh)["workdir"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def owned(path: str) -> bool:
    """Owned by this process's user and closed to everyone else."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) & 0o077 == 0


class Shown:
    """One transcript as the page is given it, kept up to date by reading only what was appended: its
    dashboard's store is fed row by row, and the outputs are rebuilt only when the transcript grew."""

    def __init__(self, path: str) -> None:
        from ..widgets.dashboard import Dashboard

        self.board = Dashboard(palette=STATE_COLOURS, judge=slow)
        self.reader = transcript.Reader(path, on_metrics=self.board.store.add)
        self.out: dict[str, Any] | None = None

    def look(self) -> dict[str, Any] | None:
        if not self.reader.update() and self.out is not None:
            return self.out
        self.out = None  # grown: the outputs are drawn again
        if self.reader.header is None:
            return None
        cell = self.reader.cell
        self.out = {
            "id": cell.id,
            "count": cell.count,
            "code": cell.code,
            "running": cell.running,
            "version": cell.size,
            "outputs": [self.dashboard(cell) if o == transcript.DASHBOARD else o for o in cell.outputs],
        }
        return self.out

    def dashboard(self, cell: transcript.Cell) -> dict[str, Any]:
        """The dashboard of what was logged so far, as the static figure the cell leaves when it ends."""
        from ..widgets.dashboard import final_bundle, headline_text

        states = states_line(cell.states)
        fig = self.board.figure(states)
        return {
            "output_type": "display_data",
            "data": final_bundle(fig, headline_text(self.board.store), states),
            "metadata": {},
        }


SHOWN: dict[str, Shown] = {}  # by transcript path; a world's last KEEP of them


def shown(path: str) -> dict[str, Any] | None:
    """One transcript as the page shows it."""
    if path not in SHOWN:
        SHOWN[path] = Shown(path)
    return SHOWN[path].look()


def shown_store(path: str) -> Any:
    """The metric store of a transcript, read up to now (nothing drawn): the world panel's numbers."""
    if path not in SHOWN:
        SHOWN[path] = Shown(path)
    SHOWN[path].reader.update()
    return SHOWN[path].board.store


def forget(keep: list[str]) -> None:
    """Let go of the transcripts no page will be given again (older than a world's last KEEP, or gone)."""
    for path in [p for p in SHOWN if p not in keep]:
        del SHOWN[path]


def handlers(base_url: str) -> list[tuple[str, type]]:
    return [(url_path_join(base_url, r"nbdist/api/kernels/([^/]+)/cells"), CellsHandler)]
