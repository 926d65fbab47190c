"""What the world looks like now, as ``%dist_status`` and ``%dist_where`` show it: one row per rank, and
where each rank is (the doctor's view over the ranks' own reports); ``WorldView``, the read-only face a
Cluster shows of its world."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..config import StartConfig, format_cpus
from ..doctor import ranks_text, render
from ..engine import gpu
from ..errors import ClusterError
from ..launch.defaults import Choice
from ..results import RankState
from . import reports
from .board import Listener, RankNow
from .engineset import EngineSet, RankInfo
from .rendezvous import World


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


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """The status rows as one line per kind of rank: 'ranks 0-13,15: idle on node1, node2 (cpu, gloo)'."""
    groups: dict[tuple[str, str, str, str], list[dict[str, Any]]] = {}
    for row in rows:
        kind = (row["state"], row["device"].split(":")[0], row["backend"], row["gpu"].split(",")[0])
        groups.setdefault(kind, []).append(row)
    lines = []
    for (state, device, backend, card), members in groups.items():
        hosts = sorted({m["host"] for m in members if m["host"]})
        on = f" on {', '.join(hosts)}" if hosts else ""
        what = ", ".join(x for x in (device, card if card and card != "busy" else "", backend) if x)
        lines.append(f"{ranks_text([m['rank'] for m in members])}: {state}{on} ({what})")
    return lines


class WorldView:
    """What a cluster shows of its world, read-only: its ranks, backend and store, its processes, and the
    views above. The holder (cluster.py's Cluster) sets ``engines``, ``world``, ``config`` and ``choice``."""

    engines: EngineSet | None
    world: World | None
    config: StartConfig
    choice: Choice | None

    def _engines(self) -> EngineSet:
        if self.engines is None or self.engines.client is None or not self.engines.ranks:
            raise ClusterError("this cluster is stopped; start one with nbdist.start(n=2) or %dist_start -n 2.")
        return self.engines

    @property
    def ranks(self) -> list[RankInfo]:
        return self.engines.ranks if self.engines is not None else []

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def client(self) -> Any:
        """The ipyparallel Client (for what nbdist does not wrap)."""
        return self.engines.client if self.engines is not None else None

    @property
    def chosen(self) -> str:
        """What nbdist chose when the user left -n out, and why, in one line ('' when the user chose)."""
        return self.choice.line(self.backend) if self.choice else ""

    @property
    def backend(self) -> str:
        return self.world.backend if self.world else ""

    @property
    def master_addr(self) -> str:
        return self.world.master_addr if self.world else ""

    @property
    def master_port(self) -> int:
        return self.world.master_port if self.world else 0

    def pids(self) -> list[int]:
        """Process ids of the controller and engines this cluster started."""
        return self.engines.pids() if self.engines is not None else []

    def dead_ranks(self) -> list[int]:
        """Ranks whose engine process has died or left the controller."""
        return self._engines().dead_ranks()

    def states(self, lines: bool = False) -> dict[int, RankNow]:
        """Each rank's state now, by rank: idle, busy (its cell, its line), debugging, failed or exited (in a
        cell still running), restarting, dead. ``lines``: ask busy ranks their line first (0.5 s at most)."""
        return states(self._engines(), lines)

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(RankNow)`` at each change of a rank's state (on the thread that saw it: keep it
        short); returns a function that unsubscribes it."""
        return self._engines().board.subscribe(listener)

    def status(self) -> list[dict[str, Any]]:
        """One row per rank: rank, engine id, host, pid, device, GPU (name, memory held), cores, backend, state."""
        return status(self._engines(), self.backend)

    @property
    def shape(self) -> WorldShape:
        """Backend, ranks, hosts and threads per rank: what a job script for this world needs."""
        return shape(self._engines(), self.backend, self.config.threads or 1)

    def where(self, wait: float = 1.0, group: bool = False) -> list[str]:
        """Where each rank is now: its cell lines, its last collective, the odd one marked (doctor.py);
        ``group``: ranks at the same place are one entry."""
        return where(self._engines(), wait, group)

    def view(self, ranks: list[int]) -> Any:
        """An ipyparallel DirectView on these ranks' engines."""
        return self._engines().view(ranks)
