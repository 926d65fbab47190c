"""The moment a process on this host ends, told to whoever follows it: Linux pidfds, one per process, polled by one
thread for the notebook's life (``EXITS``).

A running cell used to see a rank's death when it next read ``/proc`` (every 0.1 s, after a wait of up to 50 ms for
the next look): at 8 ranks, 0.04-0.16 s of a recovery's 0.6 s (issue 52). A cell follows its ranks' processes here
instead and is woken by the kernel. The thread and the pidfds are shared by every cell: a cell adds only the
processes not yet followed (a rank replaced, a world started), so a cell whose ranks are the same costs a lookup,
not a thread (a thread per cell was 0.2 ms, a tenth of a trivial cell at 2 ranks).

Where pidfds are missing (not Linux, a kernel before 5.3, a sandbox that refuses the call), nothing is followed
and the caller's own periodic look is the only one (``Exits.works`` is then False).
"""

from __future__ import annotations

import os
import select
import threading
from collections.abc import Callable, Iterable

OnExit = Callable[[int], None]  # the pid that ended; called on the thread that polls (keep it short)


class Exits:
    """Processes followed by pidfd, and the listeners told when one ends (each is told of every pid that ends:
    it keeps those it cares about)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fds: dict[int, int] = {}  # pid -> its pidfd, while it runs
        self._listeners: dict[int, OnExit] = {}
        self._next = 0
        self._wake: tuple[int, int] | None = None  # a pipe: the poll looks at new pidfds when a byte comes
        self._thread: threading.Thread | None = None
        self.works = hasattr(os, "pidfd_open")
        self._closing = False

    def follow(self, pids: Iterable[int], on_exit: OnExit) -> Callable[[], None]:
        """Tell ``on_exit(pid)`` when one of these processes ends (now, for one already gone), until the returned
        function is called."""
        key = self._add_listener(on_exit)
        new = [pid for pid in pids if pid not in self._fds]
        gone: list[int] = []
        if new and self.works:
            with self._lock:
                for pid in new:
                    if pid in self._fds:
                        continue
                    try:
                        self._fds[pid] = os.pidfd_open(pid)
                    except ProcessLookupError:
                        gone.append(pid)
                    except OSError:  # refused here (a sandbox, an old kernel): the caller's own look remains
                        self.works = False
                        break
                self._start()
            if self._wake is not None:
                os.write(self._wake[1], b"+")
        for pid in gone:
            on_exit(pid)
        return lambda: self._listeners.pop(key, None)  # type: ignore[arg-type,return-value]

    def close(self) -> bool:
        """Follow nothing more: the thread ends, every pidfd is closed (an ``Exits`` of a test; ``EXITS`` lives as long
        as the process). False if the thread did not end within 5 s."""
        with self._lock:
            self._closing = True
        thread = self._thread
        if self._wake is not None:
            os.write(self._wake[1], b"x")
        if thread is not None:
            thread.join(5)
        self.forget()
        return thread is None or not thread.is_alive()

    def forget(self) -> None:
        """Close every pidfd and the wake pipe (in a forked child, whose copies they are): nothing is followed."""
        for fd in [*self._fds.values(), *(self._wake or ())]:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds, self._listeners, self._wake, self._thread = {}, {}, None, None

    def _add_listener(self, on_exit: OnExit) -> int:
        with self._lock:
            self._next += 1
            self._listeners[self._next] = on_exit
            return self._next

    def _start(self) -> None:
        """The polling thread, once (again in a forked child, which has the parent's pidfds but not its thread)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._wake = os.pipe()
        self._thread = threading.Thread(target=self._poll, name="nbdist-exits", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        assert self._wake is not None
        wake = self._wake[0]
        poller = select.poll()
        poller.register(wake, select.POLLIN)
        polled: dict[int, int] = {}  # pidfd -> pid
        while True:
            with self._lock:
                for pid, fd in self._fds.items():
                    if fd not in polled:
                        poller.register(fd, select.POLLIN)
                        polled[fd] = pid
            for fd, _ in poller.poll():
                if fd == wake:
                    os.read(wake, 4096)
                    if self._closing:
                        return
                    continue
                poller.unregister(fd)
                pid = polled.pop(fd)
                with self._lock:
                    self._fds.pop(pid, None)
                    listeners = list(self._listeners.values())
                os.close(fd)
                for on_exit in listeners:
                    on_exit(pid)


EXITS = Exits()


def _forked() -> None:
    """A child forked from this process follows nothing of its parent's (its pidfds are closed, its listeners
    dropped); it starts its own thread if it follows processes."""
    global EXITS
    EXITS.forget()
    EXITS = Exits()


os.register_at_fork(after_in_child=_forked)
