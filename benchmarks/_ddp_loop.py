"""The DDP training loop both runners execute: nbdist engines and torchrun processes.

Run as a script (by torchrun) it initialises the process group from the env and writes
rank 0's figures to the JSON path given as its argument.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(512, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 10),
    )


def _no_comm_hook(state, bucket):  # the same step with the gradient all-reduce skipped
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def train(steps: int = 150, batch: int = 64, warmup: int = 20, skip_comm: bool = False) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(make_model())
    if skip_comm:
        model.register_comm_hook(None, _no_comm_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(batch, 512, generator=g), torch.randint(0, 10, (batch,), generator=g)
    for i in range(warmup + steps):
        if i == warmup:
            dist.barrier()
            tic = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    dist.barrier()
    took = time.perf_counter() - tic
    world = dist.get_world_size()
    return {"step_s": took / steps, "samples_per_s": steps * batch * world / took}


def measure(steps: int = 150, batch: int = 64) -> dict:
    full = train(steps, batch)
    local = train(steps, batch, skip_comm=True)
    full["comm_fraction"] = max(0.0, 1 - local["step_s"] / full["step_s"])
    return full


if __name__ == "__main__":
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    result = measure()
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as fh:
            json.dump(result, fh)
    dist.destroy_process_group()
