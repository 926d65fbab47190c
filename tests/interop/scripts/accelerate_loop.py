# HF Accelerate as its README teaches it: Accelerator(), prepare(), accelerator.backward().
import json
import os

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

OUT = "__OUT__"


def main():
    accelerator = Accelerator()
    set_seed(0)
    x = torch.randn(64, 8)
    data = TensorDataset(x, x.sum(1, keepdim=True))
    loader = DataLoader(data, batch_size=8, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    for _ in range(2):
        for xb, yb in loader:
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            opt.zero_grad()
            accelerator.backward(loss)
            opt.step()
    rank = int(os.environ["RANK"])
    torch.save(accelerator.unwrap_model(model).state_dict(), f"{OUT}-rank{rank}.pt")
    with open(f"{OUT}-rank{rank}.json", "w") as fh:
        json.dump(
            {
                "world": int(os.environ["WORLD_SIZE"]),
                "seen": accelerator.num_processes,
                "env": os.environ.get("WORLD_SIZE"),
            },
            fh,
        )
    accelerator.wait_for_everyone()  # no rank exits before all have written (tests/torchrun.py)
    accelerator.end_training()


if __name__ == "__main__":
    main()
