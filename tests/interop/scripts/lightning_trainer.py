# A LightningModule fitted by lightning.pytorch.Trainer(strategy="ddp"), unchanged from a torchrun script.
import json
import os

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

OUT = "__OUT__"


class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        xb, yb = batch
        return torch.nn.functional.mse_loss(self.net(xb), yb)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.05)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}


def main():
    pl.seed_everything(0)
    x = torch.randn(64, 8)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8, shuffle=True)
    model = Regressor()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader)
    rank = trainer.global_rank
    torch.save(model.net.state_dict(), f"{OUT}-rank{rank}.pt")
    with open(f"{OUT}-rank{rank}.json", "w") as fh:
        json.dump(
            {
                "world": int(os.environ.get("RANK") is not None and torch.distributed.get_world_size()),
                "seen": trainer.world_size,
                "env": os.environ.get("WORLD_SIZE"),
            },
            fh,
        )
    trainer.strategy.barrier()  # no rank exits before all have written (tests/torchrun.py)


if __name__ == "__main__":
    main()
