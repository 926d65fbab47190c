# transformers.Trainer on a tiny GPT-2 built from a config (nothing downloaded).
import json
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

OUT = "__OUT__"


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 32, (32, 12), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main():
    config = GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=OUT + "-run",
        per_device_train_batch_size=4,
        max_steps=4,
        seed=0,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        learning_rate=1e-2,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    trainer.train()
    rank = int(os.environ["RANK"])
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, f"{OUT}-rank{rank}.pt")
    with open(f"{OUT}-rank{rank}.json", "w") as fh:
        json.dump(
            {"world": int(os.environ["WORLD_SIZE"]), "seen": args.world_size, "env": os.environ.get("WORLD_SIZE")}, fh
        )
    torch.distributed.barrier()  # no rank exits before all have written (tests/torchrun.py)


if __name__ == "__main__":
    main()
