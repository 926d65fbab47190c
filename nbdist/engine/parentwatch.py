"""End this process soon after the process that started it (the notebook kernel) is gone.

ipyparallel starts its controller and engines in their own sessions so Ctrl-C in a
terminal does not reach them; the price is that they outlive a killed kernel. The
launcher passes the kernel's pid in NBDIST_PARENT_PID; when our parent pid is no
longer that pid (we were re-parented because it died), we end the processes we
started ourselves (the controller forks its heart monitor) and exit at once.
Processes forked from a watched process watch their own parent the same way.

A kept world (``%dist_start --keep``: NBDIST_KEEP_S in the environment) outlives the kernel: each
process then waits until the cluster's lease file (NBDIST_CLUSTER_DIR/lease) has not been touched for
NBDIST_KEEP_S seconds, and only then leaves. The attached kernel touches it every few seconds, and
so does an engine while it runs a cell: the timer runs in the world, not in the kernel.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

from .. import wire

ENV = "NBDIST_PARENT_PID"
_FORK_HOOK = False
LOOKS: dict[str, int] = {}  # each watcher thread's looks that found what it watches alive (a test waits on them)


def watch_parent(interval: float = 0.5, on_exit: Callable[[], None] | None = None) -> threading.Thread | None:
    """Start a daemon thread that exits this process when its parent dies (after ``on_exit``).

    Does nothing when NBDIST_PARENT_PID is unset or is not our parent (for example
    when a batch system started us on another host).
    """
    global _FORK_HOOK
    try:
        parent = int(os.environ.get(ENV, "0"))
    except ValueError:
        return None
    if parent <= 1 or os.getppid() != parent:
        return None
    if not _FORK_HOOK:
        os.register_at_fork(after_in_child=_watch_in_forked_child)
        _FORK_HOOK = True
    return _start(parent, interval, on_exit)


def watch_process(pid: int, interval: float = 0.5) -> threading.Thread | None:
    """Exit this process soon after process ``pid`` (on this host, not our parent) is gone.

    For engines forked by the warm process (engine/warm.py): their parent is that server,
    but what they must not outlive is the kernel. The pid is checked with its start time,
    so a new process that reuses it does not keep us alive."""
    born = start_time(pid)
    if born is None:
        return None

    def _watch() -> None:
        while True:
            time.sleep(interval)
            if start_time(pid) != born:
                _leave(None)
            _looked()

    thread = threading.Thread(target=_watch, name="nbdist-kernel-watch", daemon=True)
    thread.start()
    return thread


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (None: gone, or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def _watch_in_forked_child() -> None:
    os.environ[ENV] = str(os.getppid())
    _start(os.getppid(), 0.5, None)


def _start(parent: int, interval: float, on_exit: Callable[[], None] | None) -> threading.Thread:
    def _watch() -> None:
        while True:
            time.sleep(interval)
            if os.getppid() != parent:
                _leave(on_exit)
            _looked()

    thread = threading.Thread(target=_watch, name="nbdist-parent-watch", daemon=True)
    thread.start()
    return thread


def _looked() -> None:
    name = threading.current_thread().name
    LOOKS[name] = LOOKS.get(name, 0) + 1


def _leave(on_exit: Callable[[], None] | None) -> None:
    """The kernel is gone: end this process (after ``on_exit`` and its children), at once, or in a kept
    world once it has been idle for its time."""
    wait_while_kept()
    if on_exit is not None:
        try:
            on_exit()
        except Exception:
            pass
    _end_children()
    os._exit(70)


def keep_world(directory: str, keep_s: float) -> None:
    """This process belongs to a world kept for ``keep_s`` idle seconds (its lease in ``directory``): run on
    every rank when the world is kept (an engine forked from the warm process has the warm process's
    environment, not the launcher's)."""
    os.environ[wire.KEEP_ENV] = str(float(keep_s))
    os.environ["NBDIST_CLUSTER_DIR"] = directory


def wait_while_kept(interval: float = 0.5) -> None:
    """In a kept world, return once its lease is older than NBDIST_KEEP_S (or gone: the world was stopped);
    touch the lease meanwhile while this engine runs a cell. Elsewhere, return at once."""
    try:
        keep = float(os.environ.get(wire.KEEP_ENV) or 0)
    except ValueError:
        keep = 0.0
    directory = os.environ.get("NBDIST_CLUSTER_DIR", "")
    if keep <= 0 or not directory:
        return
    lease = os.path.join(directory, wire.LEASE)
    touch(os.path.join(directory, wire.WAITING.format(pid=os.getpid())))  # it stays: said where one can see it
    while True:
        state = sys.modules.get("nbdist.engine.state")  # an engine: is a cell running? (not imported elsewhere)
        if state is not None and state.STATE.busy_since is not None:
            touch(lease)
        try:
            idle = time.time() - os.stat(lease).st_mtime
        except OSError:
            return
        if idle > keep:
            return
        time.sleep(min(interval, keep - idle + 0.05))


def touch(path: str) -> None:
    """Mark a sign of life on a lease (created 0600 if missing)."""
    try:
        os.utime(path)
    except FileNotFoundError:
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
        except OSError:
            pass
    except OSError:
        pass


def _end_children() -> None:
    """Kill the processes this process started (by pid), before leaving."""
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            try:
                child.kill()
            except psutil.Error:
                pass
    except Exception:
        pass
