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
from traitlets import Unicode

from .. import compat
from . import procs

ENGINE_CMD = [sys.executable, "-m", "nbdist.engine"]
_WARM_CMD = [sys.executable, "-m", "nbdist.engine.warm"]
START_METHODS = ("fork", "forkserver", "spawn")
# Environment that a process reads when it imports torch and numba: a server only forks
# engines that ask for the same values.
_IMPORT_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")
FORK_TIMEOUT = 60.0  # seconds to wait for a server still importing torch to fork

_lock = threading.Lock()
_servers: list[Server] = []
_refused: set[tuple] = set()  # (key, lean) of servers that refused this start: its other ranks go on, unasked
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
    """One fork server: its process, the import settings it serves, lean or not (forkserver or the warm fork),
    one job at a time."""

    def __init__(self, key: tuple, env: dict[str, str], lean: bool = False) -> None:
        self.key = key
        self.lean = lean
        self.lock = threading.Lock()
        self.proc = subprocess.Popen(
            [*_WARM_CMD, "--lean"] if lean else _WARM_CMD,
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

    def fork(self, job: dict[str, Any], timeout: float = FORK_TIMEOUT) -> tuple[int | None, str]:
        """Fork an engine for this job: its pid, or None if the server cannot, with the reason when it refused
        because a fork is not safe there (then it is ended: it stays unsafe)."""
        with self.lock:
            try:
                pid = procs.ask_fork(self.proc, job, timeout)
            except procs.ForkRefused as refused:
                self.close(kill=True)
                return None, str(refused)
            except (OSError, TimeoutError, EOFError):
                self.close(kill=True)
                return None, ""
        return (pid if pid > 0 else None), ""

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


def warm(n: int, threads: int, lean: bool = False) -> int | None:
    """Have a fork server ready for engines with ``threads`` threads each (``n``: how many engines
    are expected; one server forks any number; ``lean``: a forkserver, not the warm process). Returns the pid of
    the server it started, or None when one was there already (or warming is off). A start asks this first: what
    refused the last start is asked again."""
    if not enabled() or n < 1:
        return None
    env = {**os.environ, **procs.process_env(threads)}
    key = _key(env)
    with _lock:  # a new start asks every kind of server again
        _refused.difference_update({(key, False), (key, True)})
    server = _begin(env, lean, only_new=True)
    return server.pid if server is not None else None


def _begin(env: dict[str, str], lean: bool, only_new: bool = False) -> Server | None:
    """The server for ``env`` of this kind, begun now if there is none (None: one was there and ``only_new``)."""
    global _atexit
    key = _key(env)
    with _lock:
        _drop_dead()
        there = next((s for s in _servers if s.key == key and s.lean == lean), None)
        if there is not None:
            return None if only_new else there
        server = Server(key, env, lean)
        _servers.append(server)
        if not _atexit:
            atexit.register(shutdown)
            _atexit = True
    return server


def close(pid: int) -> None:
    """End the server with this pid (one this process started), if it is still there."""
    with _lock:
        found = [s for s in _servers if s.pid == pid]
        _servers[:] = [s for s in _servers if s.pid != pid]
    for server in found:
        server.close()


def server_for(env: dict[str, str], lean: bool = False) -> Server | None:
    """The server of this kind for engines with this environment, or None."""
    key = _key(env)
    with _lock:
        _drop_dead()
        return next((s for s in _servers if s.key == key and s.lean == lean), None)


def close_lean(threads: int) -> None:
    """End the forkserver for engines with ``threads`` threads (a world that used it stopped)."""
    key = _key({**os.environ, **procs.process_env(threads)})
    with _lock:
        found = [s for s in _servers if s.key == key and s.lean]
        _servers[:] = [s for s in _servers if s not in found]
    for server in found:
        server.close()


def fork_engine(job: dict[str, Any], env: dict[str, str], start: str) -> int | None:
    """The pid of an engine forked for ``job`` as the start method says (None: start it cold). ``fork`` asks the
    warm process, then (where that refused) a forkserver; ``forkserver`` asks a forkserver, begun when there is
    none (a restart after one refused, a grow). A server that refuses is said once, here, naming the way on."""
    if start == "spawn" or not enabled():
        return None
    kinds = (False, True) if start == "fork" else (True,)
    for lean in kinds:
        key = _key(env)
        with _lock:
            if (key, lean) in _refused:
                continue
        server = _begin(env, lean) if lean else server_for(env)
        if server is None:
            continue
        pid, reason = server.fork(job)
        if pid is not None:
            return pid
        if reason:
            with _lock:
                _refused.add((key, lean))
            _say_refused(server, reason, "forkserver" if not lean else "spawn")
    return None


def _say_refused(server: Server, reason: str, then: str) -> None:
    what = "the fork server" if server.lean else "the warm process"
    way = {
        "forkserver": "They start from a fork server of their own instead (--start forkserver: a fresh process "
        "that imports only torch and ipyparallel's engine)",
        "spawn": "They start cold instead (--start spawn: a fresh Python each, about a second of a core more per rank)",
    }[then]
    print(
        f"nbdist: {what} (pid {server.pid}) cannot fork ranks safely: {reason}. {way}. Something that runs when "
        "Python starts (a sitecustomize, a .pth file) or is imported there can do this; --start spawn starts "
        "ranks cold without asking.",
        file=sys.stderr,
        flush=True,
    )


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
    """ipyparallel's local engine launcher, forked from a fork server when its start method says so and it can be."""

    start_method = Unicode("fork", help="how the engine's process is made: " + ", ".join(START_METHODS)).tag(
        config=True
    )

    def start(self) -> None:
        args = list(self.args)
        if self.state != "before" or args[: len(ENGINE_CMD)] != ENGINE_CMD:
            return super().start()
        env = os.environ.copy()
        env.update(self.get_env())
        job = {
            "args": args[len(ENGINE_CMD) :],
            "env": env,
            "cwd": os.path.abspath(self.work_dir),
            "output": self.output_file,
        }
        pid = fork_engine(job, env, self.start_method)
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
