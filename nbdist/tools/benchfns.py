"""Measurements run on every rank at once by nbdist.tools.bench (through ipyparallel's apply)."""

from __future__ import annotations

import os
import time
from typing import Any


def allreduce_sweep(sizes: list[int], min_time: float = 0.05, max_iters: int = 50) -> list[dict[str, float]]:
    """Seconds per all_reduce of float32 tensors of each byte size (the slowest rank's view)."""
    import torch
    import torch.distributed as dist

    from nbdist.parallel.ddp import device

    out = []
    for size in sizes:
        t = torch.ones(max(1, size // 4), device=device())
        for _ in range(2):  # warm-up
            dist.all_reduce(t)
        # calibrate, then agree on one iteration count (every rank must run the same number)
        dist.barrier()
        tic = time.perf_counter()
        for _ in range(3):
            dist.all_reduce(t)
        est = torch.tensor([(time.perf_counter() - tic) / 3], device=device())
        dist.all_reduce(est, op=dist.ReduceOp.MAX)
        iters = int(min(max_iters, max(3, min_time / max(est.item(), 1e-7))))
        dist.barrier()
        tic = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        elapsed = time.perf_counter() - tic
        out.append({"bytes": float(t.numel() * 4), "seconds": elapsed / iters})
    return out


def memcpy_bandwidth(nbytes: int = 64 << 20, reps: int = 10) -> float:
    """Bytes per second of a tensor copy on this rank (the in-process ceiling)."""
    import torch

    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    tic = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    return nbytes * reps / (time.perf_counter() - tic)


def train_throughput(
    steps: int = 200, batch: int = 64, distributed: bool = True, threads: int | None = None, comm: bool = True
) -> dict[str, Any]:
    """Samples per second of a small MLP training loop on this rank (DDP across ranks, or alone). ``comm=False``:
    DDP's ``no_sync``, each rank trains on its own (what sharing the machine costs, without communication)."""
    import contextlib

    import torch
    import torch.distributed as dist

    old = torch.get_num_threads()
    mine = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if threads:
        from ..engine.runtime import pin

        pin(None)  # a rank is pinned to its own cores: measuring "one process on all cores" needs them all
        torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        model: Any = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))
        if distributed:
            from nbdist.parallel import apply_ddp

            model = apply_ddp(model, metrics=False)  # it times itself; logged rows would show up under the next cell
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = torch.randn(batch, 512), torch.randint(0, 10, (batch,))
        for i in range(steps + 5):
            if i == 5:
                if distributed:
                    dist.barrier()
                tic = time.perf_counter()
            opt.zero_grad()
            with contextlib.nullcontext() if comm or not distributed else model.no_sync():
                torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        took = time.perf_counter() - tic
        return {"samples_per_s": steps * batch / took, "threads": torch.get_num_threads()}
    finally:
        torch.set_num_threads(old)
        if threads and mine:
            os.sched_setaffinity(0, mine)
