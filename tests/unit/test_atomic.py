"""engine/atomic.py: a SIGINT sent (by the kernel, as a release sends it) while a stretch is held raises
KeyboardInterrupt only at its end, and never in a later cell for a hold a step that raised left open."""

from __future__ import annotations

import os
import signal
import time

import pytest

from nbdist.engine import atomic
from nbdist.engine.state import STATE


@pytest.fixture(autouse=True)
def _python_handler():
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    cell = STATE.cell
    try:
        yield
    finally:
        STATE.cell = cell
        try:
            atomic.let_go()  # a hold a test left open
        except KeyboardInterrupt:
            pass
        signal.signal(signal.SIGINT, before)


def _sigint_and_wait() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)  # Python runs its handler at the next bytecode: well within this


def test_a_sigint_inside_the_stretch_raises_at_its_end_and_the_handler_is_put_back():
    reached = []
    atomic.hold()
    assert atomic.held()
    _sigint_and_wait()
    reached.append("the stretch ran to its end")
    with pytest.raises(KeyboardInterrupt):
        atomic.let_go()
    assert reached == ["the stretch ran to its end"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(KeyboardInterrupt):  # not held any more
        _sigint_and_wait()


def test_a_stretch_without_a_sigint_ends_quietly_and_a_second_hold_is_one_hold():
    atomic.hold()
    atomic.hold()  # as when a step that raised left the hold open: the next step's end ends it
    atomic.let_go()
    assert not atomic.held()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_hold_an_earlier_cell_left_open_never_holds_a_later_cells_sigint():
    atomic.hold()  # the step raised: no let_go in this cell
    STATE.cell += 1
    assert not atomic.held()
    with pytest.raises(KeyboardInterrupt):
        _sigint_and_wait()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_later_cells_hold_puts_back_the_handler_from_before_the_one_left_open():
    atomic.hold()
    STATE.cell += 1
    atomic.hold()
    atomic.let_go()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_handler_that_ignores_sigint_is_kept_ignoring_it():
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    atomic.hold()
    _sigint_and_wait()
    atomic.let_go()  # nothing raised: the handler before the hold ignored it
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
