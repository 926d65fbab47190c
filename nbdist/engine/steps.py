"""Where an engine is on its way into the world, said in a file the notebook reads when a start stalls.

Each engine writes its latest step to ``$NBDIST_STEPS_DIR/HOST-PID`` (0600, the cluster's 0700 directory,
shared across hosts): started, torch imported, connection file read, registering with the controller,
registered (starting its kernel), and its kernel started with the heart beating. ``world/registration.py``
reads them when engines do not register in time, to name which processes are alive, which reached the
controller and where each one that did not waits. A step is one small file write (no fsync).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from .. import wire

ENV = wire.STEPS_ENV

STARTED = "started"
IMPORTED = "torch imported"
CONNECTION = "connection file read"
REGISTERING = "registering with the controller"
REGISTERED = "registered; starting its kernel"
BEATING = "kernel started, heart beating"


def say(step: str, engine_id: int | None = None) -> None:
    """Note this process's step (and its engine id once it has one); nothing when the directory is not set."""
    directory = os.environ.get(ENV, "")
    if not directory:
        return
    path = os.path.join(directory, f"{socket.gethostname()}-{os.getpid()}")
    line = f"{time.time():.3f}\t{'' if engine_id is None else engine_id}\t{step}\n"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(line)
    except OSError:
        pass  # a step unsaid costs only the diagnosis


def read(directory: str) -> dict[str, dict[str, Any]]:
    """Each engine's last step: 'HOST-PID' -> {host, pid, time, engine_id (None until registered), step}."""
    out: dict[str, dict[str, Any]] = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return out
    for name in names:
        try:
            with open(os.path.join(directory, name)) as fh:
                when, eid, step = fh.read().rstrip("\n").split("\t", 2)
            host, _, pid = name.rpartition("-")
            out[name] = {
                "host": host,
                "pid": int(pid),
                "time": float(when),
                "engine_id": int(eid) if eid else None,
                "step": step,
            }
        except (OSError, ValueError):
            continue
    return out


def follow_registration() -> None:
    """Have ipyparallel's engine say its registration steps (compat/ipyparallel_private.py wraps its two methods)."""
    from .. import compat

    compat.on_engine_registration(
        registering=lambda: say(REGISTERING),
        registered=lambda: say(REGISTERED),
        beating=lambda engine_id: say(BEATING, engine_id),
    )
