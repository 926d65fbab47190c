"""Ranks, per-rank env and the torch.distributed world, seen from the notebook side.

Pure planning functions (``plan_local_ranks``, ``choose_backend``) plus
``build_world``, which asks rank 0 to open the rendezvous store on a port the OS
picks and then has every rank join the process group and prove it with one
all_reduce.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from .errors import ClusterError, ConfigError

if TYPE_CHECKING:
    from .cluster import Cluster

LOOPBACK = "127.0.0.1"


def plan_cpus(allowed: list[int], local_rank: int, local_world_size: int) -> list[int] | None:
    """The cores for one rank: the host's allowed cores split into local_world_size equal
    contiguous groups, or None (no pinning) when there are fewer cores than ranks."""
    per = len(allowed) // max(1, local_world_size)
    if per < 1:
        return None
    return sorted(allowed)[local_rank * per : (local_rank + 1) * per]


def plan_local_ranks(hosts: list[str]) -> list[tuple[int, int]]:
    """(LOCAL_RANK, LOCAL_WORLD_SIZE) for each rank, given each rank's host name."""
    counts: dict[str, int] = {}
    seen: dict[str, int] = {}
    for host in hosts:
        counts[host] = counts.get(host, 0) + 1
    plan = []
    for host in hosts:
        local_rank = seen.get(host, 0)
        seen[host] = local_rank + 1
        plan.append((local_rank, counts[host]))
    return plan


def choose_backend(requested: str | None, cuda_devices: list[int], local_ranks: list[int]) -> str:
    """nccl when every rank has a GPU of its own, gloo otherwise; check a requested one."""
    every_rank_has_gpu = all(n > lr for n, lr in zip(cuda_devices, local_ranks, strict=True))
    if requested is None:
        return "nccl" if cuda_devices and every_rank_has_gpu else "gloo"
    if requested == "nccl" and not every_rank_has_gpu:
        lacking = [r for r, (n, lr) in enumerate(zip(cuda_devices, local_ranks, strict=True)) if n <= lr]
        raise ConfigError(f"backend 'nccl' needs one GPU per rank, but rank {lacking[0]} has none; use --backend gloo.")
    return requested


def master_address(launcher: str, rank0_host: str) -> str:
    """Where rank 0's store listens: loopback for the local launcher, rank 0's host otherwise."""
    return LOOPBACK if launcher == "local" else rank0_host


def build_world(cluster: Cluster, timeout: float | None = None) -> float:
    """Create the process group on every rank; return seconds taken.

    Rank 0 opens the store first, so a port that is taken cannot leave the other
    ranks waiting (FAULTS.md row 6); if any rank fails to join, the error names it.
    """
    from .engine import runtime

    tic = time.perf_counter()
    cfg = cluster.config
    timeout = timeout or min(cfg.timeout, 30.0)
    client = cluster.client
    ranks = cluster.ranks
    rank0 = ranks[0]
    try:
        port = client[rank0.engine_id].apply_sync(runtime.open_store, cluster.master_addr, timeout)
    except Exception as exc:
        raise ClusterError(f"rank 0 (engine {rank0.engine_id}) could not open the rendezvous store: {exc}") from exc
    cluster.master_port = int(port)
    futures = [
        client[r.engine_id].apply_async(
            runtime.join_world,
            master_addr=cluster.master_addr,
            port=port,
            backend=cluster.backend,
            timeout=timeout,
            pg_timeout=cfg.pg_timeout,
        )
        for r in ranks
    ]
    expected = len(ranks) * (len(ranks) + 1) / 2
    errors: list[str] = []
    for r, fut in zip(ranks, futures, strict=True):
        try:
            total = fut.get(timeout=timeout + 5)
        except Exception as exc:
            errors.append(f"rank {r.rank} (engine {r.engine_id}): {_short(exc)}")
            continue
        if total != expected:
            errors.append(f"rank {r.rank}: the proving all_reduce gave {total}, expected {expected}")
    if errors:
        _reset_world(cluster)
        raise ClusterError(
            "the process group could not be formed: "
            + "; ".join(errors)
            + ". Run %dist_restart to start fresh engines."
        )
    return time.perf_counter() - tic


def rebuild_world(cluster: Cluster) -> float:
    """Tear the process group down on every rank and build a new one."""
    _reset_world(cluster)
    return build_world(cluster)


def _reset_world(cluster: Cluster) -> None:
    from .engine import runtime

    ids = [r.engine_id for r in cluster.ranks]
    try:
        cluster.client[ids].apply_sync(runtime.leave_world)
    except Exception:
        pass


def _short(exc: BaseException) -> str:
    text = getattr(exc, "evalue", None) or str(exc)
    ename = getattr(exc, "ename", None) or type(exc).__name__
    return f"{ename}: {str(text).splitlines()[0][:300] if text else ''}"


def describe_env(rank: int, world_size: int, local: tuple[int, int], master_addr: str, threads: int) -> dict[str, Any]:
    """The env vars a rank gets, as configure() sets them (for display and tests)."""
    return {
        "RANK": rank,
        "LOCAL_RANK": local[0],
        "WORLD_SIZE": world_size,
        "LOCAL_WORLD_SIZE": local[1],
        "MASTER_ADDR": master_addr,
        "OMP_NUM_THREADS": threads,
        "NUMBA_NUM_THREADS": threads,
    }
