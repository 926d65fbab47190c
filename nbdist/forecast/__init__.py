"""Will it fit: a per-rank forecast of a training step's peak memory, before anything the model's size exists.

``nbdist.fit(cell_source, strategies=..., world_sizes=..., memory=...)`` runs the cell in a process of its own under
fake tensors and a fake process group, once per strategy and world size (and per stage of a pipeline), and counts
one rank's step with torch's MemTracker: parameters, gradients, optimizer state, activations, temporaries. The
notebook's kernel and world are not touched. ``%%dist_fit`` is its face.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from ..config import FitConfig
from ..errors import ConfigError, NbdistError
from .comm import fitted
from .report import Forecast, Option, Times

__all__ = ["Forecast", "Option", "fit"]


def fit(
    source: str,
    *,
    comm: dict[str, Any] | None = None,
    measured_at: int = 2,
    cores: int | None = None,
    setup: list[str] | None = None,
    **config: Any,
) -> Forecast:
    """Forecast each rank's peak memory for the model ``source`` builds.

    ``source``: code that defines ``model`` (a torch.nn.Module) and ``batch`` (one rank's input, or (input,
    target)); optionally ``loss_fn(output, target)``, ``optimizer`` (params -> optimizer; default AdamW),
    ``tp_plan`` (for parallelize_module), ``fsdp_blocks`` (a class or a list of modules: FSDP's units; default
    each child, or each element of a ModuleList or Sequential child) and ``microbatches``.

    ``config``: FitConfig's fields: ``strategies`` (ddp, fsdp, tp, pp, fsdp+tp), ``world_sizes``, ``memory``
    ("16GiB": then ``best`` names the smallest world that fits), ``microbatches``, ``timeout``, ``device`` (cpu,
    cuda, cuda:N: each rank's tensors there, and ``memory`` that GPU's unless given). ``comm``: collectives measured on a live world of ``measured_at`` ranks
    (``comm.measure_here``'s answer); without it two gloo processes measure them. ``cores``: the cores the ranks of
    one world share (default: this machine's); ranks beyond them share time. ``setup``: cells run before
    ``source`` (a world's ``--setup`` cells: the classes the model needs).
    """
    cfg = FitConfig(**config)
    if cfg.device != "cpu":
        memory = device_memory(cfg.device)  # the device must be here: its tensors are made there (fake)
        cfg.memory = cfg.memory if cfg.memory is not None else memory
    configs: list[tuple[str, int]] = [(s, n) for s in cfg.strategies for n in cfg.world_sizes]
    request = json.dumps(
        {
            "source": source,
            "configs": configs,
            "microbatches": cfg.microbatches,
            "comm": comm,
            "setup": setup or [],
            "measured_at": measured_at,
            "device": cfg.device,
        }
    )
    paths = [p for p in sys.path if p and os.path.isdir(p)]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        **({"CUDA_VISIBLE_DEVICES": ""} if cfg.device == "cpu" else {}),
        "PYTHONPATH": os.pathsep.join([os.getcwd(), *paths]),
    }
    tic = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "nbdist.forecast"],
            input=request,
            capture_output=True,
            text=True,
            env=env,
            timeout=cfg.timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise NbdistError(
            f"the forecast took more than {cfg.timeout:.0f} s and was ended; forecast fewer strategies or world sizes, "
            "or pass timeout= (%%dist_fit --timeout S)."
        ) from None
    options = {(s, n): Option(s, n) for s, n in configs}
    model, config_errors = None, []
    for line in done.stdout.splitlines():
        row = json.loads(line)
        if "comm" in row:
            model = Times(fitted(row["comm"]), row["measured_at"], cores or os.cpu_count() or 1, cfg.microbatches)
            continue
        if model is not None and "compute_s" in row:
            model.add(row)
        opt = options[(row["strategy"], row["world"])]
        if "error" in row:
            opt.error = row["error"]
            if row.get("config_error"):
                config_errors.append(row["error"])
        else:
            opt.ranks[row["rank"]] = row
    if done.returncode != 0 and not any(o.ranks or o.error for o in options.values()):
        tail = (done.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
        raise NbdistError(f"the forecast's process failed (exit {done.returncode}): {tail}")
    said = set(config_errors)
    if len(said) == 1 and all(o.error in said for o in options.values()):  # the cell itself is wrong: say it once
        raise ConfigError(said.pop())
    for opt in options.values():
        if not opt.ranks and not opt.error:
            opt.error = "the forecast's process ended before it (see its stderr)"
    where = f"the live world's {measured_at} ranks" if comm is not None else "two gloo processes of this host"
    return Forecast(
        list(options.values()), memory=cfg.memory, seconds=time.monotonic() - tic, measured=where, device=cfg.device
    )


def device_memory(device: str) -> int:
    """The bytes the CUDA device ``device`` has; ConfigError, naming what this machine has, when it is not here."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(device.partition(":")[2] or 0)
    if index < count:
        return int(torch.cuda.get_device_properties(index).total_memory)
    if count == 0:
        build = "a CPU build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise ConfigError(
            f"--device {device!r} does not exist here: torch {torch.__version__} ({build}) sees no CUDA device. "
            "Forecast where the GPU is, or here with --device cpu --memory 80GiB (the same tensors, without the CUDA "
            "allocator's rounding and the optimizers' GPU code)."
        )
    have = ", ".join(f"cuda:{i}" for i in range(count))
    raise ConfigError(f"--device {device!r} does not exist here: this machine has {count} CUDA device(s) ({have}).")
