"""Per-rank torch.profiler traces of a few steps, saved where the notebook can link them."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist


@contextlib.contextmanager
def profile(directory: str = "nbdist-traces", record_shapes: bool = False) -> Iterator[Any]:
    """Profile the steps run inside the block; write ``directory/rank{r}.json`` (Chrome trace
    format: open it in chrome://tracing or Perfetto) and print its path."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    rank = dist.get_rank() if dist.is_initialized() else 0
    os.makedirs(directory, exist_ok=True)
    with torch_profile(activities=activities, record_shapes=record_shapes) as prof:
        yield prof
    path = os.path.abspath(os.path.join(directory, f"rank{rank}.json"))
    prof.export_chrome_trace(path)
    print(f"profiler trace: {path}")


def trace_links(directory: str = "nbdist-traces") -> Any:
    """Links to the traces in a notebook (run where the notebook runs)."""
    from IPython.display import FileLinks

    return FileLinks(directory)
