"""What a collective costs here, measured: each kind a step uses, timed at a few sizes on real ranks (the live
world's, or two gloo processes this module starts), then fitted as latency + bytes / bandwidth and carried to other
world sizes as a ring does (nbdist.forecast.time_of).

``measure_here`` runs on every rank of a world at once; ``measure_pair`` starts a world of two for it when the
notebook has none.
"""

from __future__ import annotations

import math
import os
import socket
import time
import warnings
from queue import Empty
from typing import Any

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "send")
SIZES = (4 << 10, 256 << 10, 1 << 20, 4 << 20)
_LIKE = {"broadcast": "all_gather", "all_to_all": "all_gather"}  # timed as the kind that moves as many bytes


def measure_here(sizes: tuple[int, ...] = SIZES, reps: int = 7) -> dict[str, list[tuple[int, float]]]:
    """On every rank of the default group at once: seconds per collective of each kind and byte size (the median of
    ``reps``, then the slowest rank's). ``send`` is rank 0 to rank 1 and back, halved."""
    with warnings.catch_warnings():  # torch 2.13 calls the tensor collectives deprecated
        warnings.simplefilter("ignore", FutureWarning)
        return _measured(sizes, reps)


def _measured(sizes: tuple[int, ...], reps: int) -> dict[str, list[tuple[int, float]]]:
    import statistics

    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    out: dict[str, list[tuple[int, float]]] = {k: [] for k in KINDS}
    for size in sizes:
        full = torch.zeros(max(n, size // 4))
        part = torch.zeros(full.numel() // n)
        whole = full[: part.numel() * n]
        runs: dict[str, tuple[Any, tuple[Any, ...]]] = {
            "all_reduce": (dist.all_reduce, (full,)),
            "all_gather": (dist.all_gather_into_tensor, (whole, part)),
            "reduce_scatter": (dist.reduce_scatter_tensor, (part, whole)),
            "send": (_ping, (full, rank)),
        }
        for kind, (fn, args) in runs.items():
            fn(*args)
            walls = []
            for _ in range(reps):
                dist.barrier()
                tic = time.perf_counter()
                fn(*args)
                walls.append(time.perf_counter() - tic)
            wall = torch.tensor([statistics.median(walls) / (2 if kind == "send" else 1)])
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)
            out[kind].append((full.numel() * 4, float(wall)))
    return out


def _ping(t: Any, rank: int) -> None:
    import torch.distributed as dist

    if rank == 0:
        dist.send(t, 1)
        dist.recv(t, 1)
    elif rank == 1:
        dist.recv(t, 0)
        dist.send(t, 0)


def _pair_rank(rank: int, port: int, queue: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        got = measure_here()
        if rank == 0:
            queue.put(got)
    finally:
        dist.destroy_process_group()


def gloo_world(
    target: Any,
    n: int,
    args: tuple[Any, ...] = (),
    timeout: float = 60.0,
    answers: int = 1,
    start: str = "spawn",
    partial: bool = False,
) -> list[Any]:
    """Start ``n`` processes (``start``: multiprocessing's start method) that form a gloo world on 127.0.0.1, each
    running ``target(rank, port, queue, *args)``; the first ``answers`` things they put on the queue. Fails at once
    when one of them dies, and ends them all, by their own handles, whatever happens. ``partial``: what came within
    ``timeout`` instead of failing when less did (a benchmark that counts the ranks that never answer)."""
    import multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx: Any = mp.get_context(start)  # typed by its name: spawn, fork or forkserver
    queue = ctx.Queue()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    procs = [ctx.Process(target=target, args=(r, port, queue, *args), daemon=True) for r in range(n)]
    for p in procs:
        p.start()
    got: list[Any] = []
    try:
        deadline = time.monotonic() + timeout
        while len(got) < answers:
            try:
                got.append(queue.get(timeout=1.0))
            except Empty:
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if partial and time.monotonic() > deadline:
                    return got
                if failed or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"a world of {n} gloo processes failed (exit codes {failed}) or took more than {timeout:.0f} s"
                    ) from None
        return got
    finally:
        grace = 30 if len(got) >= answers else 0  # all answered: each may finish its teardown; else end them now
        for p in procs:
            p.join(timeout=grace)
            if p.is_alive():
                p.kill()
                p.join()


def measure_pair(timeout: float = 60.0) -> dict[str, list[tuple[int, float]]]:
    """Two gloo processes on 127.0.0.1, started and ended here: ``measure_here``'s answer for a world of two."""
    return gloo_world(_pair_rank, 2, timeout=timeout)[0]


def fitted(samples: dict[str, list[tuple[int, float]]]) -> dict[str, tuple[float, float]]:
    """Each kind's (seconds, seconds per byte), fitted to its samples by least squares (neither below zero)."""
    out = {}
    for kind, pts in samples.items():
        if not pts:
            continue
        mean_b = sum(b for b, _ in pts) / len(pts)
        mean_t = sum(t for _, t in pts) / len(pts)
        var = sum((b - mean_b) ** 2 for b, _ in pts)
        slope = max(0.0, sum((b - mean_b) * (t - mean_t) for b, t in pts) / var) if var else 0.0
        out[kind] = (max(0.0, mean_t - slope * mean_b), slope)
    return out


def time_of(kind: str, nbytes: int, world: int, fit: dict[str, tuple[float, float]], measured_at: int) -> float:
    """Seconds for one collective of ``nbytes`` (its largest tensor) among ``world`` ranks, from the fit made on a
    world of ``measured_at``. Carried to another world size (an estimate; measure on a world of that size to know):
    the latency grows with log2 of the ranks (gloo's halving-doubling), the bytes each rank moves with
    (world - 1) / world."""
    kind = _LIKE.get(kind, kind)
    if world < 2 or kind not in fit:
        return 0.0
    latency, per_byte = fit[kind]
    if kind == "send":
        return latency + per_byte * nbytes
    steps = math.log2(world) / math.log2(max(2, measured_at))
    share = ((world - 1) / world) / ((measured_at - 1) / measured_at)
    return latency * steps + per_byte * nbytes * share
