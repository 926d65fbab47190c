# DeepSpeed ZeRO with a torch optimizer (no compiled ops), as deepspeed.initialize is documented.
import json
import os

import deepspeed
import torch
import torch.distributed as dist

OUT = "__OUT__"
STAGE = 2


def main():
    deepspeed.init_distributed()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    config = {
        "train_batch_size": 16,
        "train_micro_batch_size_per_gpu": 8,
        "zero_optimization": {"stage": STAGE},
        "steps_per_print": 10**6,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(6):
        xb = torch.randn(8, 8, generator=g)
        loss = torch.nn.functional.mse_loss(engine(xb), xb.sum(1, keepdim=True))
        engine.backward(loss)
        engine.step()
    if STAGE == 3:
        from deepspeed.utils import safe_get_full_fp32_param

        state = {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
    else:
        state = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    torch.save(state, f"{OUT}-rank{rank}.pt")
    with open(f"{OUT}-rank{rank}.json", "w") as fh:
        json.dump(
            {
                "world": dist.get_world_size(),
                "seen": engine.world_size if hasattr(engine, "world_size") else dist.get_world_size(),
                "env": os.environ.get("WORLD_SIZE"),
            },
            fh,
        )
    dist.barrier()  # no rank exits before all have written (tests/torchrun.py)


if __name__ == "__main__":
    main()
