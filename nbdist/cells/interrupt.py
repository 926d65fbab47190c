"""Ctrl-C (the notebook's stop button) while a cell is followed: counted, never lost (watch.py acts on it)."""

from __future__ import annotations

import queue
import signal
import threading
from collections.abc import Callable
from typing import Any


class CtrlC:
    """Ctrl-C while a cell is followed, counted by a handler of our own (main thread only).

    Python's default handler raises KeyboardInterrupt wherever the main thread happens to
    be, and a few places (a finalizer, a C call that clears errors) swallow it: the press
    would be lost and the ranks left blocked. This handler only counts and wakes the loop,
    which then acts on it; the previous handler comes back when the cell is over.
    """

    def __init__(self, wake: queue.SimpleQueue[int]) -> None:
        self.wake, self.pressed, self.previous = wake, 0, None
        # only where Ctrl-C means KeyboardInterrupt now: a process that ignores SIGINT keeps ignoring it
        if (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        ):
            try:
                self.previous = signal.signal(signal.SIGINT, self._on_sigint)
            except ValueError:  # not the main interpreter
                self.previous = None

    def _on_sigint(self, signum: int, frame: Any) -> None:
        self.pressed += 1
        self.wake.put(1)  # SimpleQueue.put is reentrant: safe in a signal handler

    def take(self) -> bool:
        pressed, self.pressed = self.pressed, 0
        return pressed > 0

    def around(self, fn: Callable[[str], str]) -> Callable[[str], str]:
        """``fn`` with Ctrl-C raising KeyboardInterrupt again while it runs (a prompt: the kernel's
        ``input`` waits for its answer and would never look at our count)."""

        def call(prompt: str) -> str:
            if self.previous is None:
                return fn(prompt)
            signal.signal(signal.SIGINT, self.previous)
            try:
                return fn(prompt)
            finally:
                signal.signal(signal.SIGINT, self._on_sigint)

        return call

    def restore(self) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
            self.previous = None
