# What a worker sees of its launch: torchrun's variables and the interactive flag libraries read.
import json
import os
import sys

import torch.distributed as dist

OUT = "__OUT__"


def main():
    dist.init_process_group("gloo")
    from lightning.fabric.utilities.imports import _IS_INTERACTIVE

    seen = {k: v for k, v in os.environ.items() if k.startswith(("TORCHELASTIC_", "ROLE_", "GROUP_", "LOCAL_"))}
    seen.update({k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")})
    seen["torchelastic_launched"] = dist.is_torchelastic_launched()
    seen["interactive"] = _IS_INTERACTIVE or hasattr(sys, "ps1")
    with open(f"{OUT}-rank{dist.get_rank()}.json", "w") as fh:
        json.dump(seen, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
