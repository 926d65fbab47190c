"""The release policy (docs/faults.md, rows 2, 3 and 10) on a fake clock: no cluster, no sleeping."""

from __future__ import annotations

import pytest

from nbdist.release import Action, ReleasePolicy
from nbdist.results import Release


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock():
    return Clock()


def policy(clock, grace=1.0, watchdog=None, timeout=None, escalate=3.0):
    return ReleasePolicy(grace=grace, watchdog=watchdog, timeout=timeout, escalate=escalate, clock=clock)


def test_nothing_happens_while_every_rank_runs_without_failing(clock):
    p = policy(clock, watchdog=60.0)
    for _ in range(100):
        clock.advance(10.0)
        assert p.observe(failed=False, finished=False) is Action.WAIT
    assert p.released is None


def test_a_failure_releases_the_others_after_the_grace_not_before(clock):
    p = policy(clock, grace=1.0)
    assert p.observe(failed=True, finished=True) is Action.WAIT  # the failure is seen now
    clock.advance(0.99)
    assert p.observe(failed=True, finished=True) is Action.WAIT
    clock.advance(0.02)
    assert p.observe(failed=True, finished=True) is Action.RELEASE
    assert p.released is Release.FAILURE


def test_the_grace_counts_from_when_the_failure_was_seen_not_from_the_start(clock):
    p = policy(clock, grace=1.0)
    clock.advance(50.0)  # ranks ran fine for 50 s
    assert p.observe(failed=True, finished=True) is Action.WAIT
    clock.advance(0.5)
    assert p.observe(failed=True, finished=True) is Action.WAIT


def test_a_timeout_releases_every_running_rank(clock):
    p = policy(clock, timeout=5.0)
    clock.advance(4.9)
    assert p.observe(failed=False, finished=False) is Action.WAIT
    clock.advance(0.2)
    assert p.observe(failed=False, finished=False) is Action.RELEASE
    assert p.released is Release.TIMEOUT


def test_the_timeout_counts_from_when_the_cell_started(clock):
    started = clock()
    clock.advance(4.0)  # a --noblock cell collected 4 s later with wait(timeout=5)
    p = ReleasePolicy(grace=1.0, watchdog=None, timeout=5.0, clock=clock, started=started)
    clock.advance(1.1)
    assert p.observe(failed=False, finished=False) is Action.RELEASE


def test_the_watchdog_asks_where_ranks_are_and_releases_only_a_rank_in_a_collective(clock):
    p = policy(clock, watchdog=2.0)
    assert p.observe(failed=False, finished=True) is Action.WAIT  # rank 1 done, rank 0 still running
    clock.advance(2.1)
    assert p.observe(failed=False, finished=True) is Action.PROBE
    assert p.probed(in_collective=True) is Action.RELEASE
    assert p.released is Release.WATCHDOG


def test_legitimate_work_is_looked_at_again_a_watchdog_later(clock):
    p = policy(clock, watchdog=2.0)
    p.observe(failed=False, finished=True)
    clock.advance(2.1)
    assert p.observe(failed=False, finished=True) is Action.PROBE
    assert p.probed(in_collective=False) is Action.WAIT  # sleeping or computing, not waiting
    clock.advance(1.9)
    assert p.observe(failed=False, finished=True) is Action.WAIT
    clock.advance(0.2)
    assert p.observe(failed=False, finished=True) is Action.PROBE
    assert p.released is None


def test_no_watchdog_means_no_probe(clock):
    p = policy(clock, watchdog=None)
    p.observe(failed=False, finished=True)
    clock.advance(10_000.0)
    assert p.observe(failed=False, finished=True) is Action.WAIT


def test_ctrl_c_releases_at_once_and_only_once(clock):
    p = policy(clock)
    assert p.interrupt() is Action.RELEASE
    assert p.released is Release.INTERRUPT
    assert p.interrupt() is Action.WAIT  # a second Ctrl-C does not release again


def test_ranks_that_do_not_stop_are_killed_once_after_the_escalation(clock):
    p = policy(clock, grace=0.5, escalate=3.0)
    p.observe(failed=True, finished=True)
    clock.advance(0.6)
    assert p.observe(failed=True, finished=True) is Action.RELEASE
    clock.advance(2.9)
    assert p.observe(failed=True, finished=True) is Action.WAIT
    clock.advance(0.2)
    assert p.observe(failed=True, finished=True) is Action.KILL
    clock.advance(10.0)
    assert p.observe(failed=True, finished=True) is Action.WAIT  # killed once, not again


def test_a_release_is_not_replaced_by_a_later_reason(clock):
    p = policy(clock, grace=1.0, timeout=1.5)
    p.observe(failed=True, finished=True)
    clock.advance(1.1)
    assert p.observe(failed=True, finished=True) is Action.RELEASE
    clock.advance(1.0)  # past the timeout too
    assert p.observe(failed=True, finished=True) is Action.WAIT
    assert p.released is Release.FAILURE
