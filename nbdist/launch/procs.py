"""Processes nbdist started, by id: alive or not, children, ending them, and the environment each gets.

nbdist never ends a process by name; every function here takes pids the caller
started (or their descendants, which the controller forks).
"""

from __future__ import annotations

import os
from typing import Any

from .. import compat, wire


def alive(pid: int) -> bool:
    """Is this process running (not gone, not a zombie)? Reads /proc directly: this is on every cell's path."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (not Linux): ask psutil
        import psutil

        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state not in (b"Z", b"X")


def descendants(pids: list[int]) -> set[int]:
    """Processes started by these processes (the controller forks its heart monitor), from one look at every
    process's parent: psutil's ``children`` looks at every process once per pid asked about (1.4 s for 256 engines
    on a host of 380 processes). A process younger than the one it names as its parent is taken, as psutil does: an
    older one names a parent whose pid was reused."""
    import psutil

    born: dict[int, float] = {}
    below: dict[int, list[int]] = {}
    for proc in psutil.process_iter(["ppid", "create_time"]):
        ppid, created = proc.info["ppid"], proc.info["create_time"]
        if created is not None:
            born[proc.pid] = created
            below.setdefault(ppid, []).append(proc.pid)
    out: set[int] = set()
    todo = [pid for pid in pids if pid in born]
    while todo:
        parent = todo.pop()
        for child in below.get(parent, []):
            if child not in out and born[child] >= born[parent]:
                out.add(child)
                todo.append(child)
    return out


def exited(launcher: Any) -> bool:
    """Has this ipyparallel launcher's process ended? (Asks the process; launcher.state lags behind.)"""
    popen = compat.launcher_popen(launcher)
    if popen is not None:
        return popen.poll() is not None
    return getattr(launcher, "state", "") == "after"


def kill(pids: list[int], timeout: float = 5.0) -> None:
    """SIGKILL these processes and wait for them to go."""
    import psutil

    procs = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            proc.kill()
            procs.append(proc)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=timeout)


def reap(pids: list[int], timeout: float = 3.0) -> None:
    """Make sure these processes are gone: TERM, then KILL what is left."""
    import psutil

    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    if not procs:
        return
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, left = psutil.wait_procs(procs, timeout=timeout)
    for p in left:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(left, timeout=timeout)


def process_env(threads: int, keep: float | str | None = None) -> dict[str, str]:
    """What every process nbdist starts (controller, engines, the warm process) gets on top of the kernel's
    environment: the kernel's pid to watch, threads per rank, unbuffered output; ``keep``: the seconds of
    idleness a kept world outlives the kernel by (engine/parentwatch.py)."""
    env = {
        "NBDIST_PARENT_PID": str(os.getpid()),
        "OMP_NUM_THREADS": str(threads),
        "NUMBA_NUM_THREADS": str(threads),
        "PYTHONUNBUFFERED": "1",
    }
    if keep is not None:
        env[wire.KEEP_ENV] = str(float(keep))
    return env


class ForkRefused(RuntimeError):
    """The warm process refused to fork: forking from it is not safe now (the reason, in words)."""


def ask_fork(proc: Any, job: dict[str, Any], timeout: float) -> int:
    """Hand a job to a warm process (engine/warm.py) through its pipes and read back the pid of the engine it
    forked (-1: it could not). Raises OSError, TimeoutError or EOFError when it does not answer, and
    ForkRefused when it says a fork is not safe there (engine/warm.unsafe)."""
    import json
    import select
    import time

    proc.stdin.write(json.dumps(job).encode() + b"\n")
    proc.stdin.flush()
    out, line, deadline = proc.stdout.fileno(), b"", time.monotonic() + timeout
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([out], [], [], left)[0]:
            raise TimeoutError
        chunk = os.read(out, 64)
        if not chunk:
            raise EOFError
        line += chunk
    pid, _, reason = line.decode(errors="replace").strip().partition(" ")
    if reason:
        raise ForkRefused(reason)
    return int(pid or -1)
