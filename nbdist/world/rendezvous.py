"""Ranks, per-rank env and the torch.distributed world, seen from the notebook side.

Pure planning functions (``plan_local_ranks``, ``plan_cpus``, ``plan_gpus``, ``choose_backend``), then
the two steps that talk to the engines: ``configure_ranks`` gives each engine its rank
(env vars, threads, cores, watcher) and ``build_world`` has rank 0 open the rendezvous
store on a port the OS picks, every rank join the process group and prove it with one
all_reduce. ``build_world`` returns a ``World``; it changes nothing else.
"""

from __future__ import annotations

import secrets
import socket
import time
from dataclasses import dataclass
from typing import Any

from ..config import StartConfig
from ..engine import group, runtime
from ..errors import ClusterError, ConfigError
from .answers import Answers, Call
from .engineset import EngineSet, RankInfo


@dataclass(frozen=True, slots=True)
class World:
    """A formed process group: its backend, where its store listens, and how long it took."""

    backend: str
    master_addr: str
    master_port: int
    seconds: float


def plan_cpus(allowed: list[int], local_rank: int, local_world_size: int) -> list[int] | None:
    """The cores for one rank: the host's allowed cores split into local_world_size equal
    contiguous groups, or None (no pinning) when there are fewer cores than ranks."""
    per = len(allowed) // max(1, local_world_size)
    if per < 1:
        return None
    return sorted(allowed)[local_rank * per : (local_rank + 1) * per]


def plan_node_ranks(hosts: list[str]) -> list[int]:
    """NODE_RANK of each rank: hosts numbered in the order their first rank appears (SLURM_NODEID
    for Slurm's block distribution)."""
    order: dict[str, int] = {}
    for host in hosts:
        order.setdefault(host, len(order))
    return [order[h] for h in hosts]


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


def plan_gpus(hosts: list[str], local_ranks: list[int], gpu_ids: list[list[str]]) -> list[int | None]:
    """The visible device each rank binds: its LOCAL_RANK, or 0 when it sees a single GPU (the
    launcher gave each task its own); None when that GPU is not its own (another rank on the
    host binds the same physical GPU, or the rank sees too few)."""
    picks: list[int | None] = []
    for local_rank, ids in zip(local_ranks, gpu_ids, strict=True):
        picks.append(local_rank if local_rank < len(ids) else (0 if len(ids) == 1 else None))
    owners: dict[tuple[str, str], int] = {}
    for host, ids, pick in zip(hosts, gpu_ids, picks, strict=True):
        if pick is not None:
            owners[(host, ids[pick])] = owners.get((host, ids[pick]), 0) + 1
    return [
        None if pick is None or owners[(host, ids[pick])] > 1 else pick
        for host, ids, pick in zip(hosts, gpu_ids, picks, strict=True)
    ]


def choose_backend(requested: str | None, gpus: list[int | None]) -> str:
    """nccl when every rank has a GPU of its own (``plan_gpus``), gloo otherwise; check a requested one."""
    lacking = [rank for rank, g in enumerate(gpus) if g is None]
    if requested is None:
        return "nccl" if gpus and not lacking else "gloo"
    if requested == "nccl" and lacking:
        raise ConfigError(
            f"backend 'nccl' needs one GPU per rank, but rank {lacking[0]} has none of its own; use --backend gloo."
        )
    return requested


def configure_ranks(
    engines: EngineSet, ranks: list[RankInfo], *, pin: bool, timeout: float, infos: list[dict[str, Any]] | None = None
) -> str:
    """Give these ranks' engines their rank env, threads, cores and watcher; return MASTER_ADDR.

    Fills in each RankInfo's pid, host, address, GPUs, local and node rank, and cores, from each engine's
    ``runtime.local_info`` (asked here, or ``infos`` when the caller asked already).
    LOCAL_RANK is a rank's position among the ranks on its host (SLURM_LOCALID for a Slurm launch).
    """
    config = engines.config
    if infos is None:
        asked = engines.call([r.rank for r in ranks], runtime.local_info, timeout=timeout)
        infos = asked.ordered("the ranks' hosts and processes", [r.rank for r in ranks])
    allowed = {}
    here = socket.gethostname()
    for r, info in zip(ranks, infos, strict=True):
        r.pid, r.host, r.gpu_ids, r.addr = info["pid"], info["host"], info["gpu_ids"], info["addr"]
        r.local = r.host == here
        allowed[r.rank] = info["cpus"]
    every = engines.ranks
    hosts = [r.host for r in every]
    for r, (local_rank, local_size), node in zip(every, plan_local_ranks(hosts), plan_node_ranks(hosts), strict=True):
        r.local_rank, r.local_world_size, r.node_rank = local_rank, local_size, node
    gpus = plan_gpus(hosts, [r.local_rank for r in every], [r.gpu_ids for r in every])
    for r, g in zip(every, gpus, strict=True):
        r.gpu = g
    for r in ranks:
        r.cpus = plan_cpus(allowed[r.rank], r.local_rank, r.local_world_size) if pin else None
    master_addr = engines.launcher.master_address(every[0].addr)
    calls = {
        r.rank: (
            runtime.configure,
            (),
            dict(
                rank=r.rank,
                world_size=len(every),
                local_rank=r.local_rank,
                local_world_size=r.local_world_size,
                master_addr=master_addr,
                threads=config.world.threads,
                report_dir=engines.workdir,
                cpus=r.cpus,
                node_rank=r.node_rank,
                interface=engines.launcher.multi_host,
                max_restarts=config.recovery.max_restarts,
                peer=config.recovery.max_restarts > 0 and config.recovery.recover_from == "peer",
            ),
        )
        for r in ranks
    }
    engines.call_each(calls, timeout=timeout).ordered("giving the ranks their rank", [r.rank for r in ranks])
    return master_addr


def build_world(
    engines: EngineSet,
    *,
    backend: str,
    master_addr: str,
    timeout: float,
    pg_timeout: float,
    debug: bool = False,
    restarts: int = 0,
    port: int | None = None,
) -> World:
    """Create the process group on every rank (``restarts``: the world's restart count, which every
    rank shows as TORCHELASTIC_RESTART_COUNT; ``port``: the store's, when rank 0 opened it already).

    Rank 0 opens the store first, so a port that is taken cannot leave the other
    ranks waiting (docs/faults.md, row 6); if any rank fails to join, the error names it.
    """
    tic = time.perf_counter()
    ranks = engines.ranks
    if port is None:
        opened = engines.call([0], group.open_store, master_addr, timeout, timeout=timeout + 5)
        if 0 not in opened.values:
            raise _no_store(opened)
        port = int(opened.values[0])
    prefix = f"nbdist-{secrets.token_hex(6)}/"  # this forming's keys in the store, which outlives a forming
    joined = engines.call_each(
        {
            r.rank: (
                group.join_world,
                (),
                dict(
                    master_addr=master_addr,
                    port=port,
                    backend=backend,
                    timeout=timeout,
                    pg_timeout=pg_timeout,
                    gpu_index=r.gpu,
                    debug=debug,
                    restarts=restarts,
                    prefix=prefix,
                ),
            )
            for r in ranks
        },
        timeout=timeout + 5,
        release=True,  # a rank that dies before it joins: the others stop waiting for it (group.arrive)
    )
    expected = len(ranks) * (len(ranks) + 1) / 2
    errors: list[str] = []
    if joined.late:
        errors.append(joined.problem("joining the process group"))
    for r in ranks:
        if r.rank in joined.errors:
            errors.append(f"rank {r.rank}: {_short(joined.errors[r.rank])}")
        elif r.rank in joined.values and joined.values[r.rank] != expected:
            errors.append(f"rank {r.rank}: the proving all_reduce gave {joined.values[r.rank]}, expected {expected}")
    if errors:
        leave_world(engines)
        raise ClusterError(
            "the process group could not be formed: "
            + "; ".join(errors)
            + ". Run %dist_restart to start fresh engines."
        )
    return World(backend=backend, master_addr=master_addr, master_port=port, seconds=time.perf_counter() - tic)


def form_world(
    engines: EngineSet,
    ranks: list[RankInfo],
    config: StartConfig,
    restarts: int,
    infos: list[dict[str, Any]] | None = None,
    port: int | None = None,
) -> World:
    """Configure these ranks' engines (new ones: all, or those restarted), choose the backend, and build the
    world on every rank; the ``World``. ``infos`` and ``port``: the ranks' ``local_info`` and the store's port, when
    the caller asked for them already (``rejoin``)."""
    master_addr = configure_ranks(engines, ranks, pin=config.world.pin, timeout=config.world.timeout, infos=infos)
    backend = choose_backend(config.world.backend, [r.gpu for r in engines.ranks])
    return _build(engines, backend, master_addr, config, restarts, port=port)


def reform_world(engines: EngineSet, world: World, config: StartConfig, restarts: int) -> World:
    """Tear the process group down on every rank and build a new one on the same backend and address."""
    leave_world(engines, timeout=min(config.world.timeout, 30.0))
    return _build(engines, world.backend, world.master_addr, config, restarts)


def rejoin(engines: EngineSet, ranks: list[RankInfo], config: StartConfig, restarts: int) -> World:
    """Leave the process group on every rank, then form it again with these ranks configured anew: ``leave_world``
    then ``form_world``. Where rank 0 is not among them (ranks replaced: the store stays where it is), the leaving,
    the new ranks' ``local_info`` and rank 0's store go in one call to the ranks (engine/group.py, ``leave_then``):
    3 round trips instead of 5, about 0.04 s of a recovery at 8 ranks on 2 cores (issue 52)."""
    if not ranks or any(r.rank == 0 for r in ranks):
        leave_world(engines)
        return form_world(engines, ranks, config, restarts)
    timeout = min(config.world.timeout, 30.0)
    master_addr = engines.launcher.master_address(engines.ranks[0].addr)
    calls: dict[int, Call] = {r.rank: (group.leave_then, (), {}) for r in engines.ranks}
    calls.update({r.rank: (group.leave_then, (runtime.local_info,), {}) for r in ranks})
    calls[0] = (group.leave_then, (group.open_store, master_addr, timeout), {})
    left = engines.call_each(calls, timeout=timeout + 5)
    if left.late:
        raise ClusterError(left.problem("leaving the process group") + "; run %dist_restart once they answer again.")
    if 0 in left.errors:
        raise _no_store(left)
    infos = left.ordered("the new ranks' hosts and processes", [r.rank for r in ranks])
    return form_world(engines, ranks, config, restarts, infos=infos, port=int(left.values[0]))


def _no_store(answers: Answers) -> ClusterError:
    return ClusterError("rank 0 could not open the rendezvous store: " + answers.problem("opening the store"))


def _build(
    engines: EngineSet, backend: str, master_addr: str, config: StartConfig, restarts: int, port: int | None = None
) -> World:
    return build_world(
        engines,
        backend=backend,
        master_addr=master_addr,
        timeout=min(config.world.timeout, 30.0),
        pg_timeout=config.world.pg_timeout,
        debug=config.world.debug_collectives,
        restarts=restarts,
        port=port,
    )


def leave_world(engines: EngineSet, timeout: float = 30.0) -> None:
    """Destroy the process group on every rank, whatever state it is in; ClusterError naming the ranks that did
    not answer within ``timeout`` (a rank that raised has dropped its group anyway)."""
    left = engines.call(list(range(len(engines.ranks))), group.leave_world, timeout=timeout)
    if left.late:
        raise ClusterError(left.problem("leaving the process group") + "; run %dist_restart once they answer again.")


def _short(exc: BaseException) -> str:
    text = getattr(exc, "evalue", None) or str(exc)
    ename = getattr(exc, "ename", None) or type(exc).__name__
    return f"{ename}: {str(text).splitlines()[0][:300] if text else ''}"
