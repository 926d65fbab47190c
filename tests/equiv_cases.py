"""Training cells with the bugs that make N ranks train unlike one, each with its fix (for %dist_equiv).

One small regression (fp64, an MLP, SGD, a global batch of 16 shared by the ranks through DistributedSampler)
written as users write it; ``cell(**change)`` plants one change. ``CASES``: name -> (the cause %dist_equiv
must name, the buggy cell, the fixed cell, or None when the fix is the correct cell). ``CORRECT`` trains alike
on any world size that divides the batch. Used by tests/integration/test_equiv.py and benchmarks/equiv.py.
"""

from __future__ import annotations

HEAD = """\
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import nbdist.parallel

torch.manual_seed(0)
world = dist.get_world_size()
g = torch.Generator().manual_seed(1)
X = torch.randn({rows}, 8, generator=g, dtype=torch.float64)
Y = X @ torch.randn(8, 1, generator=g, dtype=torch.float64) + 0.1 * torch.randn({rows}, 1, generator=g, dtype=torch.float64)
data = TensorDataset(X, Y, torch.arange({rows}))
BATCH = 16  # the global batch: one rank's whole batch, shared by the ranks
"""


def cell(
    rows: int = 64,
    batch: str = "BATCH // world",
    lr: str = "0.05",
    layers: str = "nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)",
    wrap: str = "net",
    loss: str = "nn.functional.mse_loss(model(x), y)",
    augment: str = "",
    drop_last: bool = False,
    sampler: str = "DistributedSampler(data, shuffle=True, seed=0{drop})",
    ddp: bool = True,
    epochs: int = 7,
) -> str:
    drop = ", drop_last=True" if drop_last else ""
    made = sampler.format(drop=drop)
    model = "nn.parallel.DistributedDataParallel(net)" if ddp else "net"
    return (
        HEAD.format(rows=rows)
        + f"""\
sampler = {made}
loader = DataLoader(data, batch_size={batch}, sampler=sampler{drop})
net = nn.Sequential({layers}).double()
net = {wrap}
model = {model}
opt = torch.optim.SGD(model.parameters(), lr={lr})
for epoch in range({epochs}):
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    for x, y, index in loader:
{augment}        opt.zero_grad()
        loss = {loss}
        loss.backward()
        opt.step()
"""
    )


CORRECT = cell()
BN = "nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1)"
NOISE = "        x = x + 0.1 * torch.randn_like(x)  # augmentation\n"
KEYED = (
    "        x = x + 0.1 * torch.stack([torch.randn(8, generator=torch.Generator().manual_seed(int(i)), "
    "dtype=torch.float64) for i in index])  # augmentation keyed to the row\n"
)

CASES: dict[str, tuple[str, str, str | None]] = {
    "per_rank_batch": ("per_rank_batch", cell(batch="BATCH"), None),
    "lr_scaled": ("lr", cell(lr="0.05 * world"), None),
    "sampler_padding": ("padding", cell(rows=61), cell(rows=61, drop_last=True)),
    "batchnorm": ("batchnorm", cell(layers=BN), cell(layers=BN, wrap="nbdist.parallel.sync_batchnorm(net)")),
    "loss_averaged_twice": ("averaged_twice", cell(loss="nn.functional.mse_loss(model(x), y) / world"), None),
    "same_random_stream": ("same_random", cell(augment=NOISE), cell(augment=KEYED)),
    # two more that newcomers write: no sampler (every rank reads all the data), no DDP (nothing is averaged)
    "no_sampler": ("same_batch", cell(sampler="None", batch="BATCH // world"), None),
    "no_ddp": ("not_averaged", cell(ddp=False), None),
}
