"""One rank of a world: its torch rank, the engine serving it, and where it runs (``EngineSet.ranks``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RankInfo:
    """One rank: its torch rank, the ipyparallel engine serving it, and where it runs."""

    rank: int
    engine_id: int
    pid: int = 0  # on its host
    host: str = ""
    addr: str = ""  # its address on the route to the controller (MASTER_ADDR when it is rank 0)
    local: bool = True  # on this host, so its pid means something here
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    gpu_ids: list[str] = field(default_factory=list)  # the GPUs its process sees (UUIDs), [] without CUDA
    gpu: int | None = None  # the visible device it binds under nccl (None: no GPU of its own)
    cpus: list[int] | None = None  # the cores this rank is pinned to (None: not pinned)

    def where(self) -> str:
        """'' here, 'on node2' when the rank runs on another host (a message names ranks, never engine ids)."""
        return "" if self.local else f"on {self.host}"
