"""A DDP (or FSDP2) training cell with one fault planted on one rank, for %dist_why (tests/integration/test_why.py
and benchmarks/why.py). ``cell(fault, rank, seed, wrap=...)``; FAULTS: fault -> the causes %dist_why may name for
it; FSDP_FAULTS: those an FSDP2 loop can have (its forward needs every rank, so one rank cannot evaluate alone, and it
has no DDP communication hook)."""

from __future__ import annotations

FAULTS = {
    "none": ("balanced",),
    "data": ("data",),  # the loader sleeps on that rank
    "compute": ("compute",),  # that rank's batch is 8 times the others'
    "hook": ("hook",),  # its DDP communication hook sleeps on that rank
    "gc": ("gc",),  # garbage: a collection of cyclic lists in each step on that rank
    "io": ("other",),  # 4 MiB written to a file and synced in each step on that rank
    "save": ("save",),  # torch.save of a 16 MB state each step on that rank
    "eval": ("eval",),  # a forward without gradients over a validation set each step on that rank
    "hang": ("hang",),  # that rank stops at step 8, outside any collective
    "desync": ("desync",),  # at step 8 that rank all-reduces 3 numbers, the others 4
}
GPU_FAULTS = {  # on a GPU (``devices``): a slow device, the device's work queued by the host and not waited for
    "device": ("compute",),  # that rank's GPU spins 20 ms inside the forward (torch.cuda._sleep): host time ~0
}

FSDP_FAULTS = [f for f in FAULTS if f not in ("hook", "eval")]

CELL = """\
import contextlib, gc, os, tempfile, time
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

FAULT, K, STEPS, WRAP, DEVICES = {fault!r}, {rank}, {steps}, {wrap!r}, {devices!r}
rank = dist.get_rank()
dev = torch.device(DEVICES[rank] if DEVICES else "cpu")
torch.manual_seed({seed})


class Spin(nn.Module):  # the "device" fault: the GPU busy for about 20 ms, the host not
    def forward(self, x):
        if FAULT == "device" and rank == K:
            torch.cuda._sleep(40_000_000)  # cycles: 20 ms at 2 GHz
        return x


net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1), Spin()).to(dev)
if WRAP == "fsdp":
    from torch.distributed.fsdp import fully_shard

    for layer in net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    model = fully_shard(net)
else:
    model = nn.parallel.DistributedDataParallel(net)


def hook(state, bucket):
    if FAULT == "hook" and rank == K:
        time.sleep(0.03)
    return default_hooks.allreduce_hook(state, bucket)


if WRAP == "ddp":
    model.register_comm_hook(None, hook)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
g = torch.Generator().manual_seed({seed} * 100 + rank)
rows = 4096 if FAULT == "compute" and rank == K else 512
val = torch.randn(8192, 64, generator=g)
big = torch.randn(4_000_000, generator=g)
scratch = os.path.join(tempfile.gettempdir(), f"why-{{os.getpid()}}")


class Batches(torch.utils.data.IterableDataset):
    def __iter__(self):
        for _ in range(STEPS):
            if FAULT == "data" and rank == K:
                time.sleep(0.03)
            yield torch.randn(rows, 64, generator=g).to(dev), torch.randn(rows, 1, generator=g).to(dev)


loader = torch.utils.data.DataLoader(Batches(), batch_size=None)
STEP = globals().get("STEP") or (lambda model: contextlib.nullcontext())  # traceml's trace_step, in its script
stamps = []  # each step's end (benchmarks/why.py reads the step time without %dist_why from them)
for step, (x, y) in enumerate(loader):
    with STEP(model):  # one step: traceml's boundary (a no-op here)
        if FAULT == "hang" and rank == K and step == 8:
            time.sleep(3600)
        if FAULT == "desync" and step == 8:
            dist.all_reduce(torch.ones(3 if rank == K else 4))
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        if FAULT == "gc" and rank == K:
            junk = [[] for _ in range(100_000)]
            for item in junk:
                item.append(item)
            del junk
            gc.collect()
        if FAULT == "io" and rank == K:
            with open(scratch, "wb") as fh:
                fh.write(os.urandom(4 << 20))
                fh.flush()
                os.fsync(fh.fileno())
        if FAULT == "save" and rank == K:
            torch.save({{"model": model.state_dict(), "extra": big}}, scratch)
        if FAULT == "eval" and rank == K:
            net.eval()
            with torch.no_grad():
                net(val.to(dev))
            net.train()
        opt.step()
    stamps.append(time.perf_counter())
if os.path.exists(scratch):
    os.unlink(scratch)
"""


def cell(
    fault: str, rank: int, seed: int = 0, steps: int = 25, wrap: str = "ddp", devices: tuple[str, ...] | None = None
) -> str:
    """``devices``: each rank's device ('cuda:0', 'cpu'); None: all on the CPU."""
    return CELL.format(fault=fault, rank=rank, seed=seed, steps=steps, wrap=wrap, devices=devices)
