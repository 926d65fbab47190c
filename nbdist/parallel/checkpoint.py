"""Checkpoints with torch.distributed.checkpoint: every rank writes its part, and the
'latest' pointer moves only after the whole checkpoint is on disk.

Layout: ``path/step-000100/`` (a DCP directory) and ``path/latest`` (a text file
holding the newest complete step). A checkpoint is written to ``step-N.partial``
first; rank 0 renames it and then rewrites ``latest`` atomically, after a barrier,
so a crash mid-save never leaves a half-written checkpoint as the latest.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ..errors import ConfigError


def _step_dir(path: str, step: int) -> str:
    return os.path.join(path, f"step-{step:09d}")


def latest_step(path: str) -> int | None:
    """The newest complete step under ``path``, or None."""
    try:
        with open(os.path.join(path, "latest")) as fh:
            return int(fh.read().strip())
    except (FileNotFoundError, ValueError):
        return None


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(path: str, model: torch.nn.Module, optimizer: Any, step: int, extra: dict | None = None) -> str:
    """Save model and optimizer state (DDP or FSDP) for ``step``; return the directory."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    final = _step_dir(path, step)
    partial = final + ".partial"
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "meta": {"step": step, **(extra or {})}}
    dcp.save(state, checkpoint_id=partial)
    _barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        tmp = os.path.join(path, f"latest.{os.getpid()}")
        with open(tmp, "w") as fh:
            fh.write(str(step))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, os.path.join(path, "latest"))
    _barrier()
    return final


def load_checkpoint(path: str, model: torch.nn.Module, optimizer: Any, step: int | None = None) -> int:
    """Load the given (default: latest complete) step into model and optimizer; return the step."""
    if step is None:
        step = latest_step(path)
        if step is None:
            raise ConfigError(f"no complete checkpoint under {path!r}; save one with save_checkpoint first.")
    directory = _step_dir(path, step)
    if not os.path.isdir(directory):
        raise ConfigError(f"checkpoint step {step} is not under {path!r}; latest is {latest_step(path)}.")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd, "meta": {"step": step}}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["meta"]["step"])
