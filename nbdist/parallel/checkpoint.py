"""Checkpoints with torch.distributed.checkpoint: every rank writes its part, and the
'latest' pointer moves only after the whole checkpoint is on disk.

Layout: ``path/step-000100/`` (a DCP directory, plus ``rank-N.pt`` per rank: its RNG
states and its loader's position) and ``path/latest`` (a text file holding the newest
complete step). A checkpoint is written to ``step-N.partial`` first; rank 0 renames it
and then rewrites ``latest`` atomically, after a barrier, so a crash mid-save never
leaves a half-written checkpoint as the latest.

Loading restores the model, the optimizer, each rank's RNG states (torch, CUDA when in
use, numpy, random) and the loader's position, so a resumed run continues exactly as an
uninterrupted one would have. The last save also tells nbdist what to restore after an
automatic restart (``restore_latest``) and what to save on preemption (engine/preempt.py).
"""

from __future__ import annotations

import os
import random
import shutil
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ..engine import metrics, preempt
from ..errors import ConfigError

KEY = "nbdist.checkpoint"  # what the notebook learns of the last save (run.py reads it)


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


def save_checkpoint(
    path: str, model: torch.nn.Module, optimizer: Any, step: int, extra: dict | None = None, loader: Any = None
) -> str:
    """Save model and optimizer state (DDP or FSDP), this rank's RNG states and the loader's position
    (a ShardedLoader) for ``step``: the number of steps done. Returns the directory."""
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
    own = {"rng": rng_states(), "loader": loader.state_dict() if loader is not None else None}
    torch.save(own, os.path.join(partial, f"rank-{rank}.pt"))
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
    _remember(path, model, optimizer, loader)
    return final


def rng_states() -> dict[str, Any]:
    """This process's random states: torch (CPU, and CUDA once initialised), numpy (when imported), random."""
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "random": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        out["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss)  # loadable weights_only
    return out


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["random"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    if "numpy" in states:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = states["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss))


def _remember(path: str, model: Any, optimizer: Any, loader: Any) -> None:
    """The last save: preemption saves again the same way; the notebook learns the variable names
    (so that after a restart and the setup cells' replay it can load into the new objects)."""
    preempt.DEFAULT[:] = [lambda step: save_checkpoint(path, model, optimizer, step or 0, loader=loader)]
    preempt.install()
    names = _names({"model": model, "optimizer": optimizer, "loader": loader})
    metrics.publish(KEY, {"path": os.path.abspath(path), "names": names})


def _names(objects: dict[str, Any]) -> dict[str, str]:
    """The notebook-level variable names on this rank that hold these objects."""
    try:
        from IPython import get_ipython

        ns = get_ipython().user_ns  # type: ignore[union-attr]
    except Exception:
        return {}
    out = {}
    for role, obj in objects.items():
        if obj is None:
            continue
        for name, value in ns.items():
            if value is obj and not name.startswith("_"):
                out[role] = name
                break
    return out


def restore_latest(path: str, names: dict[str, str]) -> int | None:
    """After a restart: load the latest checkpoint under ``path`` into the namespace's objects
    named in ``names`` (model, optimizer, loader); the step, or None when there is none yet."""
    if latest_step(path) is None:
        return None
    from IPython import get_ipython

    ns = get_ipython().user_ns  # type: ignore[union-attr]
    missing = [n for role, n in names.items() if n not in ns and role != "loader"]
    if missing or "model" not in names or "optimizer" not in names:
        raise ConfigError(
            f"cannot restore {path!r}: no variable {(missing or ['model/optimizer'])[0]!r} after the setup cells "
            "ran again; build the model and optimizer in a %%distributed --setup cell."
        )
    loader = ns.get(names["loader"]) if "loader" in names else None
    return load_checkpoint(path, ns[names["model"]], ns[names["optimizer"]], loader=loader)


def load_checkpoint(
    path: str, model: torch.nn.Module, optimizer: Any, step: int | None = None, loader: Any = None
) -> int:
    """Load the given (default: latest complete) step into model and optimizer, and this rank's
    RNG states and the loader's position when the checkpoint has them; return the step."""
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
    rank = dist.get_rank() if dist.is_initialized() else 0
    own_path = os.path.join(directory, f"rank-{rank}.pt")
    if os.path.exists(own_path):
        own = torch.load(own_path, weights_only=True)
        set_rng_states(own["rng"])
        if loader is not None and own.get("loader") is not None:
            loader.load_state_dict(own["loader"])
    return int(state["meta"]["step"])
