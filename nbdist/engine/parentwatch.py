"""End this process soon after the process that started it (the notebook kernel) is gone.

ipyparallel starts its controller and engines in their own sessions so Ctrl-C in a
terminal does not reach them; the price is that they outlive a killed kernel. The
launcher passes the kernel's pid in NBDIST_PARENT_PID; when our parent pid is no
longer that pid (we were re-parented because it died), we end the processes we
started ourselves (the controller forks its heart monitor) and exit at once.
Processes forked from a watched process watch their own parent the same way.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

ENV = "NBDIST_PARENT_PID"
_FORK_HOOK = False


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
    born = _start_time(pid)
    if born is None:
        return None

    def _watch() -> None:
        while True:
            time.sleep(interval)
            if _start_time(pid) != born:
                _end_children()
                os._exit(70)

    thread = threading.Thread(target=_watch, name="nbdist-kernel-watch", daemon=True)
    thread.start()
    return thread


def _start_time(pid: int) -> int | None:
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
                if on_exit is not None:
                    try:
                        on_exit()
                    except Exception:
                        pass
                _end_children()
                os._exit(70)

    thread = threading.Thread(target=_watch, name="nbdist-parent-watch", daemon=True)
    thread.start()
    return thread


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
