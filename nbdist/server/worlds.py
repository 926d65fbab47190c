"""``GET {base_url}nbdist/api/worlds``: the world of each of this server's kernels, for the world panel
(js/src/panel.ts): each rank's state (idle, busy at which cell line, in its debugger, failed, dead,
restarting), host, device and memory; grouped above GROUP_ABOVE ranks as ``%dist_status`` groups them;
and the slowest rank with what holds it (compute, communication, data wait), from the metrics its
running cell logged.

Read from files while the kernel is busy in a cell: the ranks from ``<world>/ranks.json``
(world/published.py), the metrics from the cell's transcript. Memory is each rank's resident set,
read here for the ranks on this host (the panel's server runs where the notebook's kernel runs).
Same protections as routes.py: Jupyter's authentication, this server's kernels, this user's worlds.
"""

from __future__ import annotations

import json
from typing import Any

import psutil
from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import ensure_async, url_path_join
from tornado import web

from ..cells import transcript
from ..doctor import ranks_text
from ..world import published
from .routes import owned, shown_store, world_of

GROUP_ABOVE = 8  # ranks; above, one line per kind of rank (as %dist_status)
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
    for row in ranks:
        row["rss_MiB"] = rss_mib(int(row.get("pid") or 0))
    return {
        "kernel": kernel_id,
        "notebook": notebook,
        "ranks": ranks,
        "groups": groups(ranks) if len(ranks) > GROUP_ABOVE else [],
        "slowest": slowest(workdir),
    }


def rss_mib(pid: int) -> int | None:
    """A rank's resident memory in MiB, if ``pid`` is an nbdist engine on this host."""
    if pid <= 0:
        return None
    try:
        proc = psutil.Process(pid)
        if "nbdist.engine" not in " ".join(proc.cmdline()):
            return None  # the pid was reused: not a rank
        return round(proc.memory_info().rss / 2**20)
    except (psutil.Error, OSError):
        return None


def state_text(row: dict[str, Any]) -> str:
    """'busy at cell line 7', 'idle', 'debugging at cell line 3'."""
    line = row.get("line")
    return f"{row['state']} at cell line {line}" if line and row["state"] in ("busy", "debugging") else row["state"]


def groups(ranks: list[dict[str, Any]]) -> list[str]:
    """One line per kind of rank: 'ranks 0-13,15: busy at cell line 7 on node1 (cpu)'."""
    kinds: dict[tuple[str, str, str], list[int]] = {}
    for row in ranks:
        kinds.setdefault((state_text(row), row.get("host", ""), row.get("device", "")), []).append(row["rank"])
    return [
        f"{ranks_text(members)}: {state}" + (f" on {host}" if host else "") + f" ({device})"
        for (state, host, device), members in kinds.items()
    ]


def slowest(workdir: str) -> dict[str, Any] | None:
    """The slowest rank in the world's last cell, by how much, and what holds it; None without metrics."""
    paths = transcript.cells(workdir)
    if not paths:
        return None
    store = shown_store(paths[-1])
    found = store.headline().get("slowest")
    if not found:
        return None
    rank, pct = found
    split = store.split().get(rank, {})
    holds = max(split, key=lambda k: split[k]) if split else "compute"
    return {"rank": rank, "pct": round(pct, 1), "holds": HOLDS.get(holds, holds), "split_ms": split}


def handlers(base_url: str) -> list[tuple[str, type]]:
    return [(url_path_join(base_url, r"nbdist/api/worlds"), WorldsHandler)]
