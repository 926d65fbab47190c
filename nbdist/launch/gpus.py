"""GPUs seen from the kernel, without initialising CUDA in it.

The kernel never touches ``torch.cuda``: a process that has initialised CUDA cannot
fork children that use it, and the ranks are other processes that must find their
GPUs untouched. What the kernel needs, how many GPUs this host offers, comes from
``CUDA_VISIBLE_DEVICES`` when it is set (Slurm, Kubernetes' device plugin and most
schedulers set it) or from ``nvidia-smi -L``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping


def visible(env: Mapping[str, str] | None = None) -> tuple[list[str], str]:
    """(the GPUs this process may use, where that came from): ids from CUDA_VISIBLE_DEVICES,
    else the GPUs ``nvidia-smi -L`` lists; ([], '') when there are none."""
    env = os.environ if env is None else env
    if "CUDA_VISIBLE_DEVICES" in env:
        return parse_visible(env["CUDA_VISIBLE_DEVICES"]), "CUDA_VISIBLE_DEVICES"
    ids = parse_nvidia_smi(_nvidia_smi())
    return ids, ("nvidia-smi -L" if ids else "")


def parse_visible(text: str) -> list[str]:
    """CUDA_VISIBLE_DEVICES as CUDA reads it: ids up to the first invalid one ('', '-1', 'NoDevFiles')."""
    ids = []
    for item in text.split(","):
        item = item.strip()
        if not item or item.startswith("-") or item == "NoDevFiles":
            break
        ids.append(item)
    return ids


def parse_nvidia_smi(out: str) -> list[str]:
    """``nvidia-smi -L`` lines -> device ids. MIG instances, when a GPU has them, are what CUDA sees."""
    gpus, migs = [], []
    for line in out.splitlines():
        stripped = line.strip()
        if stripped.startswith("GPU ") and ":" in stripped:
            gpus.append(stripped[4:].split(":", 1)[0].strip())
        elif stripped.startswith("MIG ") and "UUID:" in stripped:
            migs.append(stripped.rsplit("UUID:", 1)[1].strip(" )"))
    return migs or gpus


def _nvidia_smi() -> str:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return ""
    try:
        done = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout if done.returncode == 0 else ""
