"""The DDP training loop both runners execute: nbdist engines and torchrun processes.

Run as a script (by torchrun) it initialises the process group from the env and writes
rank 0's figures to the JSON path given as its argument.
"""

from __future__ import annotations

import json
import os
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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def train(steps: int = 150, batch: int = 64, warmup: int = 20, skip_comm: bool = False, device: str = "cpu") -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = torch.device(device)
    model = DDP(make_model().to(dev), device_ids=[dev.index] if dev.type == "cuda" else None)
    if skip_comm:
        model.register_comm_hook(None, _no_comm_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(batch, 512, generator=g).to(dev), torch.randint(0, 10, (batch,), generator=g).to(dev)
    for i in range(warmup + steps):
        if i == warmup:
            _sync(dev)
            tic = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    _sync(dev)
    took = time.perf_counter() - tic
    world = dist.get_world_size()
    return {"step_s": took / steps, "samples_per_s": steps * batch * world / took}


def measure(steps: int = 150, batch: int = 64, device: str = "cpu") -> dict:
    full = train(steps, batch, device=device)
    local = train(steps, batch, skip_comm=True, device=device)
    full["comm_fraction"] = max(0.0, 1 - local["step_s"] / full["step_s"])
    return full


if __name__ == "__main__":  # torchrun ... _ddp_loop.py OUT.json [cuda] [batch]
    on_gpu = len(sys.argv) > 2 and sys.argv[2] == "cuda"
    batch = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    device = f"cuda:{os.environ['LOCAL_RANK']}" if on_gpu else "cpu"
    if on_gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if on_gpu else "gloo")
    torch.set_num_threads(1)
    result = measure(batch=batch, device=device)
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as fh:
            json.dump(result, fh)
    dist.destroy_process_group()
