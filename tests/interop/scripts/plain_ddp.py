# Plain torch DDP with a DistributedSampler, as a torchrun tutorial writes it.
import json
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

OUT = "__OUT__"


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    data = TensorDataset(x, x.sum(1, keepdim=True))
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
    torch.save(model.module.state_dict(), f"{OUT}-rank{rank}.pt")
    with open(f"{OUT}-rank{rank}.json", "w") as fh:
        json.dump(
            {"world": dist.get_world_size(), "seen": dist.get_world_size(), "env": os.environ.get("WORLD_SIZE")}, fh
        )
    dist.barrier()  # no rank exits before all have written (tests/torchrun.py)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
