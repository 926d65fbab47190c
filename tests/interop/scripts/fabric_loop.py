# Lightning Fabric as its docs teach it for a script run by torchrun.
import json
import os

import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, TensorDataset

OUT = "__OUT__"


def train(fabric):
    fabric.seed_everything(0)
    x = torch.randn(64, 8)
    data = TensorDataset(x, x.sum(1, keepdim=True))
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=8, shuffle=True))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = fabric.setup(model, opt)
    for _ in range(2):
        for xb, yb in loader:
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            opt.zero_grad()
            fabric.backward(loss)
            opt.step()
    rank = fabric.global_rank
    torch.save(model.module.state_dict(), f"{OUT}-rank{rank}.pt")
    with open(f"{OUT}-rank{rank}.json", "w") as fh:
        json.dump(
            {"world": int(os.environ["WORLD_SIZE"]), "seen": fabric.world_size, "env": os.environ.get("WORLD_SIZE")}, fh
        )
    fabric.barrier()  # no rank exits before all have written (tests/torchrun.py)


def main():
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    train(fabric)


if __name__ == "__main__":
    main()
