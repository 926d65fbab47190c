"""Warm engines: processes that imported torch before anyone asked for a cluster.

Importing torch takes about 2 s per process and is most of a cold ``%dist_start``.
``warm(n)`` starts n processes (``python -m nbdist.engine.warm``) that import torch
and ipyparallel's engine and then wait; ``%load_ext nbdist`` calls it, so the
import happens while the user reads and types. When a cluster starts engines, its
launcher (``WarmEngineSetLauncher``) hands each engine's arguments to a warm
process instead of starting a new one; without a matching warm process it starts
one cold, exactly as ipyparallel would.

Warm processes are children of this process: the launcher tracks them by pid like
any engine, they end with the kernel (parentwatch), and ``shutdown()`` closes
their pipes so they exit. Set ``NBDIST_WARM=0`` to never start any.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import threading
from typing import Any

from ipyparallel.cluster.launcher import LocalEngineLauncher, LocalEngineSetLauncher

from . import compat

ENGINE_CMD = [sys.executable, "-m", "nbdist.engine"]
_WARM_CMD = [sys.executable, "-m", "nbdist.engine.warm"]
# Environment that a process reads when it imports torch: a warm process only
# serves an engine that asks for the same values.
_IMPORT_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")

_lock = threading.Lock()
_warm: list[tuple[tuple, subprocess.Popen]] = []
_atexit = False


def enabled() -> bool:
    return os.environ.get("NBDIST_WARM", "1").strip().lower() not in ("0", "false", "no", "off")


def _key(env: dict[str, str]) -> tuple:
    return tuple(env.get(name, "") for name in _IMPORT_ENV)


def warm(n: int, threads: int) -> int:
    """Have n warm processes ready for engines with ``threads`` threads each; return how many were started."""
    global _atexit
    if not enabled():
        return 0
    env = os.environ.copy()
    env.update(
        NBDIST_PARENT_PID=str(os.getpid()),
        OMP_NUM_THREADS=str(threads),
        PYTHONUNBUFFERED="1",
    )
    key = _key(env)
    started = 0
    with _lock:
        _drop_dead()
        have = sum(1 for k, _ in _warm if k == key)
        for _ in range(n - have):
            proc = subprocess.Popen(
                _WARM_CMD,
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # like ipyparallel's engines: no terminal Ctrl-C
            )
            _warm.append((key, proc))
            started += 1
        if started and not _atexit:
            atexit.register(shutdown)
            _atexit = True
    return started


def take(env: dict[str, str]) -> subprocess.Popen | None:
    """A warm process for an engine with this environment, or None."""
    key = _key(env)
    with _lock:
        _drop_dead()
        for i, (k, proc) in enumerate(_warm):
            if k == key:
                del _warm[i]
                return proc
    return None


def count() -> int:
    with _lock:
        _drop_dead()
        return len(_warm)


def pids() -> list[int]:
    with _lock:
        return [proc.pid for _, proc in _warm]


def shutdown(timeout: float = 3.0) -> None:
    """End every warm process: close its pipe (it exits), kill it if it does not."""
    with _lock:
        procs = [proc for _, proc in _warm]
        _warm.clear()
    for proc in procs:
        try:
            proc.stdin.close()  # type: ignore[union-attr]
        except OSError:
            pass
    for proc in procs:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _drop_dead() -> None:
    _warm[:] = [(k, p) for k, p in _warm if p.poll() is None]


class WarmEngineLauncher(LocalEngineLauncher):
    """ipyparallel's local engine launcher, served from the warm pool when it can be."""

    def start(self) -> None:
        args = list(self.args)
        if self.state != "before" or args[: len(ENGINE_CMD)] != ENGINE_CMD:
            return super().start()
        env = os.environ.copy()
        env.update(self.get_env())
        proc = take(env)
        if proc is None:
            return super().start()
        job = {
            "args": args[len(ENGINE_CMD) :],
            "env": env,
            "cwd": os.path.abspath(self.work_dir),
            "output": self.output_file,
        }
        try:
            proc.stdin.write(json.dumps(job).encode() + b"\n")  # type: ignore[union-attr]
            proc.stdin.close()  # type: ignore[union-attr]
        except OSError:  # it died after take(): start cold
            proc.kill()
            return super().start()
        import psutil

        compat.set_launcher_popen(self, proc)
        self.pid = proc.pid
        self.process = psutil.Process(proc.pid)
        self.notify_start(proc.pid)
        self._start_waiting()
        return None


class WarmEngineSetLauncher(LocalEngineSetLauncher):
    launcher_class: Any = WarmEngineLauncher
