"""Warm engines: a process that imported torch before anyone asked for a cluster, and forks engines.

Importing torch takes about 1 s of a core per process and is most of a cold
``%dist_start``; on a 2-core laptop two engines importing it at once, beside the
controller's own start, take twice as long. ``warm()`` starts one fork server
(``python -m nbdist.engine.warm``) that imports torch and ipyparallel's engine once;
``%load_ext nbdist`` calls it, so the import happens while the user reads and types. When a
cluster starts local engines, its launcher (``WarmEngineSetLauncher``) asks the server to
fork one per engine (milliseconds each) instead of starting a new interpreter; without a
matching server it starts the engine cold, exactly as ipyparallel would. The server stays
for the next ``%dist_start`` or ``%dist_restart``.

The server is a child of this process and ends when its pipe closes: ``shutdown()``,
``%unload_ext nbdist``, or the kernel's death. Forked engines are its children, tracked by
pid like any engine, and watch the kernel themselves (engine/parentwatch.py), so a server
that ends does not take running engines with it. ``NBDIST_WARM=0`` turns warming off.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import threading
import time
from typing import Any

from ipyparallel.cluster.launcher import LocalEngineLauncher, LocalEngineSetLauncher

from .. import compat
from . import procs

ENGINE_CMD = [sys.executable, "-m", "nbdist.engine"]
_WARM_CMD = [sys.executable, "-m", "nbdist.engine.warm"]
# Environment that a process reads when it imports torch and numba: a server only forks
# engines that ask for the same values.
_IMPORT_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")
FORK_TIMEOUT = 60.0  # seconds to wait for a server still importing torch to fork

_lock = threading.Lock()
_servers: list[Server] = []
_atexit = False


def enabled() -> bool:
    return os.environ.get("NBDIST_WARM", "1").strip().lower() not in ("0", "false", "no", "off")


def _key(env: dict[str, str]) -> tuple:
    return tuple(env.get(name, "") for name in _IMPORT_ENV)


class Forked:
    """A forked engine, as a launcher's Popen: ``poll``, ``wait``. It is the server's child, not
    ours, so its exit status is not ours to read: ``returncode`` is 0 once it is gone."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not procs.alive(self.pid):
            self.returncode = 0
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
            time.sleep(0.02)
        return 0


class Server:
    """One fork server: its process, the import settings it serves, one job at a time."""

    def __init__(self, key: tuple, env: dict[str, str]) -> None:
        self.key = key
        self.lock = threading.Lock()
        self.proc = subprocess.Popen(
            _WARM_CMD,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # like ipyparallel's engines: no terminal Ctrl-C
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def fork(self, job: dict[str, Any], timeout: float = FORK_TIMEOUT) -> int | None:
        """Fork an engine for this job; its pid, or None if the server cannot (then start cold)."""
        with self.lock:
            try:
                pid = procs.ask_fork(self.proc, job, timeout)
            except procs.ForkRefused as refused:
                print(
                    f"nbdist: the warm process (pid {self.pid}) cannot fork ranks safely: {refused}. They start cold "
                    "instead (a fresh Python each: about a second of a core more per rank). Something that runs "
                    "when Python starts (a sitecustomize, a .pth file) did this; NBDIST_WARM=0 starts ranks cold "
                    "without asking.",
                    file=sys.stderr,
                    flush=True,
                )
                self.close(kill=True)  # it stays unsafe: the next start makes a new one
                return None
            except (OSError, TimeoutError, EOFError):
                self.close(kill=True)
                return None
        return pid if pid > 0 else None

    def close(self, kill: bool = False, timeout: float = 3.0) -> None:
        """End the server (its forked engines keep running): close its pipe, kill it if it lingers."""
        try:
            self.proc.stdin.close()  # type: ignore[union-attr]
        except OSError:
            pass
        if kill:
            self.proc.kill()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def warm(n: int, threads: int) -> int | None:
    """Have a fork server ready for engines with ``threads`` threads each (``n``: how many engines
    are expected; one server forks any number). Returns the pid of the server it started, or
    None when one was there already (or warming is off)."""
    global _atexit
    if not enabled() or n < 1:
        return None
    env = {**os.environ, **procs.process_env(threads)}
    key = _key(env)
    with _lock:
        _drop_dead()
        if any(s.key == key for s in _servers):
            return None
        server = Server(key, env)
        _servers.append(server)
        if not _atexit:
            atexit.register(shutdown)
            _atexit = True
    return server.pid


def close(pid: int) -> None:
    """End the server with this pid (one this process started), if it is still there."""
    with _lock:
        found = [s for s in _servers if s.pid == pid]
        _servers[:] = [s for s in _servers if s.pid != pid]
    for server in found:
        server.close()


def server_for(env: dict[str, str]) -> Server | None:
    """The server for engines with this environment, or None."""
    key = _key(env)
    with _lock:
        _drop_dead()
        return next((s for s in _servers if s.key == key), None)


def count() -> int:
    with _lock:
        _drop_dead()
        return len(_servers)


def pids() -> list[int]:
    with _lock:
        return [s.pid for s in _servers]


def shutdown(timeout: float = 3.0) -> None:
    """End every server (engines forked from them keep running until their cluster stops)."""
    with _lock:
        servers = list(_servers)
        _servers.clear()
    for server in servers:
        server.close(timeout=timeout)


def _drop_dead() -> None:
    _servers[:] = [s for s in _servers if s.alive()]


class WarmEngineLauncher(LocalEngineLauncher):
    """ipyparallel's local engine launcher, forked from the warm process when it can be."""

    def start(self) -> None:
        args = list(self.args)
        if self.state != "before" or args[: len(ENGINE_CMD)] != ENGINE_CMD:
            return super().start()
        env = os.environ.copy()
        env.update(self.get_env())
        server = server_for(env)
        job = {
            "args": args[len(ENGINE_CMD) :],
            "env": env,
            "cwd": os.path.abspath(self.work_dir),
            "output": self.output_file,
        }
        pid = server.fork(job) if server is not None else None
        if pid is None:
            return super().start()
        import psutil

        compat.set_launcher_popen(self, Forked(pid))
        self.pid = pid
        self.process = psutil.Process(pid)
        self.notify_start(pid)
        compat.start_waiting(self)
        return None


class WarmEngineSetLauncher(LocalEngineSetLauncher):
    launcher_class: Any = WarmEngineLauncher
