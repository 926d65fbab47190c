"""The trackers a run can go to, each opened the same way (``open_run``) and checked first: not installed, a
folder that cannot be written, a run name already taken are one line each, before anything is written.

TensorBoard: event files under ``DIR/NAME`` (``runs/`` and a dated name by default, TensorBoard's own habit),
written by torch's ``SummaryWriter`` and flushed after each batch, so ``tensorboard --logdir runs`` shows a run
while it trains. MLflow, Weights & Biases and trackio are named but not written to yet.
"""

from __future__ import annotations

import os
import time
from typing import Any

from ..config.values import did_you_mean
from ..errors import ConfigError
from .steps import Point

KINDS = ("tensorboard", "mlflow", "wandb", "trackio")
WRITTEN = ("tensorboard",)
EXTRA = 'pip install "nbdist[track]"'


class TensorBoardRun:
    """A TensorBoard run: one folder of event files."""

    def __init__(self, folder: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(
                f"%dist_track tensorboard needs the tensorboard package, which is not installed here; {EXTRA} "
                "(or pip install tensorboard), then run %dist_track again."
            ) from None
        self.where = folder
        self.writer = SummaryWriter(log_dir=folder)

    def scalars(self, points: list[Point]) -> None:
        for tag, value, step in points:
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def text(self, tag: str, text: str, step: int) -> None:
        self.writer.add_text(tag, text, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def open_run(kind: str, name: str | None = None, folder: str | None = None) -> Any:
    """A new run of tracker ``kind`` named ``name`` (a dated one when None), checked before anything is written."""
    if kind not in KINDS:
        raise ConfigError(f"{kind!r} is not a tracker nbdist knows; {did_you_mean(kind, KINDS)}")
    if kind not in WRITTEN:
        raise ConfigError(
            f"%dist_track {kind}: nbdist writes to {', '.join(WRITTEN)} so far ({kind} is not built yet); "
            "use %dist_track tensorboard."
        )
    name = name or time.strftime("nbdist-%Y%m%d-%H%M%S")
    if not name or os.sep in name or name in (".", ".."):
        raise ConfigError(f"run name {name!r} is not a name; give one word such as %dist_track tensorboard mnist-ddp.")
    base = os.path.abspath(folder or "runs")
    path = os.path.join(base, name)
    if os.path.isdir(path) and any(f.startswith("events.out.tfevents") for f in os.listdir(path)):
        raise ConfigError(
            f"the run name {name!r} is taken in {base} (its events are there); give another name, or remove {path}."
        )
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, ".nbdist-probe")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as exc:
        raise ConfigError(
            f"--dir {base} cannot be written ({exc.strerror or exc}); give a folder you can write to, such as "
            "--dir runs."
        ) from None
    return TensorBoardRun(path)
