"""``GET {base_url}nbdist/api/worlds``: the world of each of this server's kernels, for the world panel
(js/src/panel.ts): each rank's state (idle, busy at which cell line, in its debugger, failed, dead,
restarting), host, device and memory; grouped above GROUP_ABOVE ranks as ``%dist_status`` groups them;
and the slowest rank with what holds it (compute, communication, data wait), from the metrics its
running cell logged.

Read from files while the kernel is busy in a cell: the ranks from ``<world>/ranks.json``
(world/published.py), the metrics from the cell's transcript. Memory is each rank's resident set,
read here for the ranks on this host (the panel's server runs where the notebook's kernel runs); a busy
rank's cell line and a GPU rank's memory on its device come from the report its watcher writes when
asked (``from_reports``). GPU memory is what PyTorch's allocator reserves, as ``%dist_status`` shows it:
the rank says it itself because ``nvidia-smi`` sees no process ids inside most containers.
Same protections as routes.py: Jupyter's authentication, this server's kernels, this user's worlds.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import psutil
from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import ensure_async, url_path_join
from tornado import web

from .. import doctor, wire
from ..cells import transcript
from ..results import GROUP_ABOVE, STATE_COLOURS, grouped, state_phrase
from ..world import published
from .routes import owned, shown_store, world_of

HOLDS = {"compute": "compute", "comm": "communication", "data": "data wait"}


class WorldsHandler(APIHandler):
    auth_resource = "kernels"

    @web.authenticated
    @authorized
    async def get(self) -> None:
        sessions: list[dict[str, Any]] = await ensure_async(self.session_manager.list_sessions())
        notebooks = {s["kernel"]["id"]: s.get("path", "") for s in sessions if s.get("kernel")}
        found = [world(kid, notebooks.get(kid, "")) for kid in self.kernel_manager.list_kernel_ids()]
        self.finish(json.dumps({"worlds": [w for w in found if w]}))


def world(kernel_id: str, notebook: str) -> dict[str, Any] | None:
    workdir = world_of(kernel_id)
    if workdir is None or not owned(workdir):
        return None
    ranks = published.read(workdir)
    if ranks is None:
        return None
    engines = {int(row["rank"]): engine(int(row.get("pid") or 0)) for row in ranks}
    for row in ranks:
        proc = engines[int(row["rank"])]
        row["rss_MiB"] = round(proc.memory_info().rss / 2**20) if proc is not None else None
        row["gpu_MiB"] = row["gpu_total_MiB"] = None
    from_reports(workdir, ranks, engines)
    for row in ranks:  # the one vocabulary (results.py): the panel draws what it is given
        row["text"] = row.pop("waiting", None) or state_phrase(row["state"], row.get("line"))
        row["colour"] = STATE_COLOURS.get(row["state"], "")
    return {
        "kernel": kernel_id,
        "notebook": notebook,
        "ranks": ranks,
        "groups": grouped(ranks) if len(ranks) > GROUP_ABOVE else [],
        "slowest": slowest(workdir),
    }


def engine(pid: int) -> psutil.Process | None:
    """The process of a rank on this host, if ``pid`` is an nbdist engine (a reused pid is not)."""
    if pid <= 0:
        return None
    try:
        proc = psutil.Process(pid)
        return proc if "nbdist.engine" in " ".join(proc.cmdline()) else None
    except (psutil.Error, OSError):
        return None


ASK_EVERY_S = 1.0
_ASKED: dict[str, float] = {}


def from_reports(workdir: str, ranks: list[dict[str, Any]], engines: dict[int, psutil.Process | None]) -> None:
    """From the report each rank on this host wrote when last asked (SIGUSR1, as %dist_where asks;
    engine/runtime.py): a busy rank's cell line, a GPU rank's memory. Then ask again, at most every
    ASK_EVERY_S and only while a panel looks: busy ranks, and idle ones on a GPU (their memory changes
    between cells); an idle CPU rank is never woken. A rank on another host keeps the line the board had. A busy
    rank in a collective says what it waits for (``waiting``: 'waiting in barrier for rank 1')."""
    fresh_reports: dict[int, dict[str, Any]] = {}  # every rank's view now: not in the cell for those not busy
    for row in ranks:
        if row["state"] not in ("busy", "debugging"):
            fresh_reports[int(row["rank"])] = {"busy": False}
        if engines.get(int(row["rank"])) is None:
            continue
        try:
            with open(os.path.join(workdir, wire.REPORT.format(rank=row["rank"]))) as fh:
                report = json.load(fh)
        except (OSError, ValueError):
            continue
        busy = row["state"] in ("busy", "debugging")
        fresh = report.get("time", 0) >= row.get("since", 0)
        if busy and report.get("busy") and fresh and report.get("cell_line"):
            row["line"] = report["cell_line"]
        if busy and fresh:
            fresh_reports[int(row["rank"])] = report
        device = report.get("gpu") or {}
        if device.get("total_mib"):
            row["gpu_MiB"], row["gpu_total_MiB"] = device.get("memory_mib"), device["total_mib"]
    if len(fresh_reports) == len(ranks):  # every rank's view: who waits for whom is known
        waits = doctor.waiting(fresh_reports)
        for row in ranks:
            said = waits.get(int(row["rank"]))
            if said:
                row["waiting"] = f"{said} (cell line {row['line']})" if row.get("line") else said
    now = time.monotonic()
    if now - _ASKED.get(workdir, 0.0) < ASK_EVERY_S:
        return
    _ASKED[workdir] = now
    for row in ranks:
        proc = engines.get(int(row["rank"]))
        asked = row["state"] == "busy" or (row["state"] == "idle" and str(row.get("device", "")).startswith("cuda"))
        if asked and proc is not None:
            try:
                proc.send_signal(signal.SIGUSR1)  # by pid, and only an engine's: its watcher writes its report
            except (psutil.Error, OSError):
                pass


def slowest(workdir: str) -> dict[str, Any] | None:
    """The slowest rank in the world's last cell, by how much, and what holds it; None without metrics."""
    paths = transcript.cells(workdir)
    if not paths:
        return None
    return slowest_of(shown_store(paths[-1]))


def slowest_of(store: Any) -> dict[str, Any] | None:
    """What the panel says of a cell's metrics (a MetricStore): %dist_why's verdict where the steps were timed,
    else the slowest rank by step time and the largest part of its step."""
    head = store.headline()
    verdict = head.get("why")  # %dist_why timed the steps: its verdict names the rank and the cause
    if verdict is not None and verdict.figures.get("ranks"):
        rank = verdict.figures["ranks"][0]
        pct = 100.0 * verdict.figures.get("excess_s", 0.0) / max(verdict.figures.get("step_s", 1.0), 1e-9)
        return {"rank": rank, "pct": round(pct, 1), "holds": verdict.text.split(" on ")[0], "verdict": verdict.text}
    if verdict is not None and verdict.cause == "balanced":  # the panel's "ranks within 3% of each other"
        return {"rank": verdict.figures.get("rank", 0), "pct": 0.0, "holds": "nothing", "verdict": verdict.text}
    found = head.get("slowest")
    if not found:
        return None
    rank, pct = found
    split = store.split().get(rank, {})
    holds = max(split, key=lambda k: split[k]) if split else "compute"
    return {"rank": rank, "pct": round(pct, 1), "holds": HOLDS.get(holds, holds), "split_ms": split}


def handlers(base_url: str) -> list[tuple[str, type]]:
    return [(url_path_join(base_url, r"nbdist/api/worlds"), WorldsHandler)]
