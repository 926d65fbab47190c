"""What the world looks like now, as ``%dist_status`` and ``%dist_where`` show it: one row per rank, and
where each rank is (the doctor's view over the ranks' own reports)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import format_cpus
from ..doctor import ranks_text, render
from ..engine import gpu
from ..results import RankState
from . import reports
from .board import RankNow
from .engineset import EngineSet


@dataclass(frozen=True, slots=True)
class WorldShape:
    """The world as a job script needs it: backend, ranks, hosts and threads per rank."""

    backend: str
    world_size: int
    nodes: int
    threads: int


def shape(engines: EngineSet, backend: str, threads: int) -> WorldShape:
    return WorldShape(backend, len(engines.ranks), max(1, len({r.host for r in engines.ranks})), threads)


def states(engines: EngineSet, lines: bool = False) -> dict[int, RankNow]:
    """Each rank's state (the board, world/board.py); ``lines``: busy ranks are asked where they are first, so
    each one's cell line is fresh (0.5 s at most)."""
    now = engines.states()
    busy = [r for r, n in now.items() if n.in_cell]
    if lines and busy:
        reports.where(engines, busy)  # their reports put their lines on the board
        now = engines.board.get()
    return now


def status(engines: EngineSet, backend: str) -> list[dict[str, Any]]:
    """One row per rank: rank, engine id, host, pid, device, GPU (name, memory held), cores, backend, state,
    and for a busy rank its cell (first line) and line."""
    now = states(engines, lines=True)
    gpus = _gpu_info(engines, {r: n.state for r, n in now.items()}) if backend == "nccl" else {}
    return [
        {
            "rank": r.rank,
            "engine_id": r.engine_id,
            "host": r.host,
            "node_rank": r.node_rank,
            "local_rank": r.local_rank,
            "pid": r.pid,
            "device": f"cuda:{r.gpu}" if backend == "nccl" else "cpu",
            "gpu": gpus.get(r.rank, ""),
            "cpus": format_cpus(r.cpus),
            "backend": backend,
            "state": str(now[r.rank].state),
            "cell": now[r.rank].cell if now[r.rank].in_cell else "",
            "line": now[r.rank].line if now[r.rank].in_cell else None,
        }
        for r in engines.ranks
    ]


def _gpu_info(engines: EngineSet, states: dict[int, RankState]) -> dict[int, str]:
    """'NVIDIA H100 80GB HBM3, 1234/81559 MiB' per idle rank; 'busy' for a rank still running a cell."""
    idle = [r.rank for r in engines.ranks if states[r.rank] == RankState.IDLE]
    asked = engines.call(idle, gpu.info, timeout=2)
    out = {r.rank: "busy" for r in engines.ranks if states[r.rank] == RankState.BUSY}
    for rank in idle:
        if rank not in asked.values:
            out[rank] = "busy"
            continue
        info = asked.values[rank]
        out[rank] = f"{info['name']}, {info['memory_mib']}/{info['total_mib']} MiB" if info else ""
    return out


def where(engines: EngineSet, wait: float = 1.0, group: bool = False) -> list[str]:
    """Where each rank is now: its cell lines, its last collective, the odd one marked (doctor.py);
    ``group``: ranks at the same place are one entry."""
    now = engines.states()
    gone = {r: n.state for r, n in now.items() if n.state in (RankState.DEAD, RankState.RESTARTING)}
    live = [r.rank for r in engines.ranks if r.rank not in gone]
    said = reports.where(engines, live, wait=wait)
    hosts = {r.rank: r.host for r in engines.ranks} if group else None
    lines = render(said, {r.rank: r.where() for r in engines.ranks if r.rank not in gone}, hosts=hosts)
    for state in (RankState.DEAD, RankState.RESTARTING):
        ranks = sorted(r for r, s in gone.items() if s == state)
        if ranks:
            lines.append(f"{ranks_text(ranks)}: {state}" + (" (run %dist_restart)" if state == RankState.DEAD else ""))
    return lines
