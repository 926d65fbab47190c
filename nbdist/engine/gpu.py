"""A rank's GPU, on the engine side: which devices it sees, binding one, what it holds.

nbdist's one binding rule: the launcher's ``CUDA_VISIBLE_DEVICES`` stays as it is and each
rank calls ``torch.cuda.set_device`` on the visible device with its ``LOCAL_RANK`` (device 0
when the launcher gave each task a single GPU of its own, as ``srun --gpus-per-task=1``
does). Only ranks of an nccl world bind; CUDA is first initialised here, in the rank's own
process, never in the kernel.
"""

from __future__ import annotations

import os
from typing import Any


def ids() -> list[str]:
    """The GPUs this process sees, each named so that the same physical GPU has the same name in
    every process of the host (its UUID when CUDA can tell it); [] without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return []
    count = torch.cuda.device_count()
    names = []
    for i in range(count):
        try:
            names.append(str(torch.cuda.get_device_properties(i).uuid))
        except Exception:  # an old driver: fall back on the launcher's ids
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
            names.append(visible.split(",")[i] if visible.count(",") + 1 == count else str(i))
    return names


def bind(index: int) -> Any:
    """Make ``cuda:index`` this rank's current device; return it."""
    import torch

    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def info() -> dict[str, Any]:
    """This rank's current GPU: index, name, memory this process holds and the device's total (MiB);
    {} when the rank has not initialised CUDA (a gloo world)."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return {
        "index": index,
        "name": props.name,
        "memory_mib": round(torch.cuda.memory_reserved(index) / 2**20),
        "total_mib": round(props.total_memory / 2**20),
    }


def memory_mib() -> float:
    """GPU memory this rank's tensors hold now (MiB); 0 without an initialised GPU."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return 0.0
    return torch.cuda.memory_allocated() / 2**20
