"""``control.wait`` (engine/control.py): the main thread's wait for a collective of nbdist's own groups (the
preemption flags) lets a signal in, where gloo's own wait, C++, holds it until the work completes. The work here is
a torch Future behind a gloo work's two methods: its ``wait`` is C++ too, and holds a signal the same way (checked
first, so the test shows the difference and not a property of the stand-in)."""

from __future__ import annotations

import signal
import threading
import time

import pytest
import torch

from nbdist.engine import control

LATE_S = 1.5  # the work completes this long after the wait began
ALARM_S = 0.1  # the signal comes this long after


class Work:
    """A gloo work's ``is_completed`` and ``wait``, over a torch Future completed (or failed) ``after`` seconds on."""

    def __init__(self, after: float | None, error: Exception | None = None) -> None:
        self.future: torch.futures.Future = torch.futures.Future()
        self.waits = 0
        if after is not None:
            done = (lambda: self.future.set_exception(error)) if error else (lambda: self.future.set_result(None))
            timer = threading.Timer(after, done)
            timer.daemon = True
            timer.start()

    def is_completed(self) -> bool:
        return self.future.done()

    def wait(self) -> None:
        self.waits += 1
        self.future.wait()


class Alarm(Exception):
    pass


@pytest.fixture
def alarm():
    def ring(*_):
        raise Alarm

    before = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, ALARM_S)
    yield
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, before)


def _interrupted_after(wait) -> float:
    tic = time.perf_counter()
    with pytest.raises(Alarm):
        wait()
    return time.perf_counter() - tic


def test_gloo_like_wait_holds_a_signal_until_its_work_completes(alarm):
    work = Work(after=LATE_S)
    assert _interrupted_after(work.wait) >= LATE_S * 0.9


def test_a_signal_reaches_the_thread_waiting_for_a_control_collective(alarm):
    work = Work(after=LATE_S)
    took = _interrupted_after(lambda: control.wait(work))
    assert took < LATE_S / 2, f"the signal waited for the work ({took:.2f} s)"


def test_a_completed_work_is_waited_for_once_on_the_calling_thread():
    work = Work(after=None)
    work.future.set_result(None)
    control.wait(work)
    assert work.waits == 1


def test_the_collectives_error_is_raised_whether_it_came_before_or_during_the_wait():
    failed = Work(after=None)
    failed.future.set_exception(RuntimeError("Connection closed by peer"))
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        control.wait(failed)
    later = Work(after=0.05, error=RuntimeError("Connection reset by peer"))
    with pytest.raises(RuntimeError, match="Connection reset by peer"):
        control.wait(later)
    assert later.waits == 1
