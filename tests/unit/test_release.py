"""The release policy (docs/faults.md, rows 2, 3 and 10) on a fake clock: no cluster, no sleeping."""

from __future__ import annotations

import types

import pytest

from nbdist.cells.release import FIRST_LOOK_S, LAST_RESORT_S, Action, ReleasePolicy, stuck
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


def test_a_death_releases_the_others_at_once_when_the_cell_will_run_again(clock):
    """death_grace=0 (automatic recovery will run the cell again): a rank's process gone releases the others as
    soon as it is seen; a rank that raised still gives them the grace; without death_grace a death does too."""
    p = ReleasePolicy(grace=1.0, watchdog=None, timeout=None, clock=clock, death_grace=0.0)
    assert p.observe(failed=True, finished=True) is Action.WAIT  # raised: the grace
    assert p.observe(failed=True, finished=True, died=True) is Action.RELEASE and p.released is Release.FAILURE
    p = policy(clock, grace=1.0)
    assert p.observe(failed=True, finished=True, died=True) is Action.WAIT
    clock.advance(1.01)
    assert p.observe(failed=True, finished=True, died=True) is Action.RELEASE


def test_a_rank_that_exited_gets_the_others_probed_after_the_grace_and_released_if_they_wait(clock):
    p = policy(clock, grace=1.0, watchdog=60.0)  # rank 1's code called exit(); rank 0 still runs
    assert p.observe(failed=False, finished=True, exited=True) is Action.WAIT
    clock.advance(1.1)
    assert p.observe(failed=False, finished=True, exited=True) is Action.PROBE
    assert p.probed(in_collective=True) is Action.RELEASE
    assert p.released is Release.EXITED and "had exited" in Release.EXITED.because


def test_work_of_its_own_after_another_rank_exited_is_looked_at_again_a_grace_later(clock):
    p = policy(clock, grace=1.0, watchdog=60.0)
    p.observe(failed=False, finished=True, exited=True)
    clock.advance(1.1)
    assert p.observe(failed=False, finished=True, exited=True) is Action.PROBE
    assert p.probed(in_collective=False) is Action.WAIT
    clock.advance(0.9)
    assert p.observe(failed=False, finished=True, exited=True) is Action.WAIT
    clock.advance(0.2)
    assert p.observe(failed=False, finished=True, exited=True) is Action.PROBE
    clock.advance(60.0)  # the watchdog's probe, later, still means the watchdog
    p.probed(in_collective=False)
    assert p.observe(failed=False, finished=True) is Action.PROBE and p.probing is Release.WATCHDOG
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


def test_ranks_that_do_not_stop_are_looked_at_every_escalation_and_killed_once_at_the_last_resort(clock):
    p = policy(clock, grace=0.5, escalate=3.0)
    p.observe(failed=True, finished=True)
    clock.advance(0.6)
    assert p.observe(failed=True, finished=True) is Action.RELEASE
    clock.advance(FIRST_LOOK_S - 0.1)
    assert p.observe(failed=True, finished=True) is Action.WAIT
    clock.advance(0.2)
    assert p.observe(failed=True, finished=True) is Action.CHECK  # the stuck are ended, the slow left be
    assert p.observe(failed=True, finished=True) is Action.WAIT
    clock.advance(2.9)
    assert p.observe(failed=True, finished=True) is Action.WAIT  # the next look an escalation after the first
    clock.advance(0.2)
    assert p.observe(failed=True, finished=True) is Action.CHECK
    clock.advance(3.1)
    assert p.observe(failed=True, finished=True) is Action.CHECK  # and so on
    clock.advance(LAST_RESORT_S - 7.0)  # the release 30.3 s old
    assert p.observe(failed=True, finished=True) is Action.KILL  # whatever still runs, stuck or not
    clock.advance(10.0)
    assert p.observe(failed=True, finished=True) is Action.WAIT  # killed once, not again


def _at(line, stack=("torch/autograd/graph.py:989 in _engine_run_backward",), collective=False, busy=True, cpu=1.0):
    report = {"busy": busy, "cell_line": line, "function": "f", "stack": list(stack), "in_collective": collective}
    return {**report, "cpu_s": cpu}


def test_after_a_release_only_the_stuck_ranks_are_ended_never_one_that_is_slow_to_stop():
    running = [0, 1, 2, 3, 4, 5]
    broke = {"broke": (40, 189, 1000.0), "broke_cpu_s": 1.0}
    first = {
        0: {**_at(5, collective=True), **broke},  # still in a collective, idle since its watcher shut the connections
        7: _at(5, collective=True, cpu=0.5),  # in a collective, its group not broken (no CPU at a break): a later look
        8: {**_at(5, collective=True, cpu=1.5), **broke},  # in a collective, but working since the break: likewise
        1: _at(5),  # in backward, waiting: looked at again
        2: _at(None, stack=("IPython/core/ultratb.py:1200 in format",)),  # formatting its traceback: stopping
        3: _at(None, busy=False),  # its cell is over, its reply on the way
        # 4 silent once: not yet
        5: _at(7, stack=("<cell>:7 in <module>",)),  # a loop of its own at one line
        6: _at(None, stack=("IPython/core/ultratb.py:1200 in format",)),
    }
    running = [*running, 6, 7, 8]
    assert stuck(running, first, {}) == [0]
    before = {r: first.get(r) for r in running}
    assert stuck([7, 8], first, before) == [7, 8]  # still in the collective at the next look: stuck
    second = {
        1: _at(5),  # the very same place and no CPU used since: waiting, stuck
        2: _at(None, stack=("IPython/core/ultratb.py:1350 in structured_traceback",)),  # moved on: stopping
        4: _at(None, stack=("inspect.py:994 in getmodule",)),  # answered now
        5: _at(7, stack=("<cell>:7 in <module>",), cpu=2.5),  # the same line, but working: left to finish
        # 6 silent now, not before: not yet
    }
    assert stuck(running[1:], second, before) == [1]
    # the same reports once more: nothing moved and no CPU was used, and rank 6 is silent a second time
    assert stuck([1, 2, 4, 5, 6], second, {r: second.get(r) for r in [1, 2, 4, 5, 6]}) == [1, 2, 4, 5, 6]


def test_a_rank_in_backward_idle_since_its_watcher_broke_the_group_is_ended_at_the_first_look():
    """DDP's all-reduce waits in autograd's C++ on a send gloo never tells of (cells/release.py): the rank's main
    thread used no CPU since its watcher shut the group's connections. One that computed since, one whose group was
    never broken, one idle since the break but not in backward, and one in a Python frame of its own backward (a
    custom Function's, computing) are left to the two looks."""
    broke = (40, 189, 1000.0)
    first = {
        0: {**_at(5, cpu=1.004), "broke": broke, "broke_cpu_s": 1.0},  # 4 ms of CPU since: a wait
        1: {**_at(5, cpu=1.5), "broke": broke, "broke_cpu_s": 1.0},  # computing its backward since the break
        2: _at(5, cpu=1.0),  # the group never broken on this rank (no CPU at a break to compare)
        3: {**_at(5, stack=("<cell>:5 in <module>",), cpu=1.0), "broke": broke, "broke_cpu_s": 1.0},  # a line of its own
        4: {
            **_at(5, stack=("torch/autograd/graph.py:989 in _engine_run_backward", "<cell>:2 in backward"), cpu=1.0),
            "broke": broke,
            "broke_cpu_s": 1.0,
        },  # in a custom Function's backward: its own code, not the C++ wait
    }
    assert stuck([0, 1, 2, 3, 4], first, {}) == [0]


def test_a_release_is_not_replaced_by_a_later_reason(clock):
    p = policy(clock, grace=1.0, timeout=1.5)
    p.observe(failed=True, finished=True)
    clock.advance(1.1)
    assert p.observe(failed=True, finished=True) is Action.RELEASE
    clock.advance(1.0)  # past the timeout too
    assert p.observe(failed=True, finished=True) is Action.WAIT
    assert p.released is Release.FAILURE


# ---------------------------------------------------------------- the hang doctor's view (doctor.py)

from nbdist.doctor import odd_ranks, render  # noqa: E402
from nbdist.results import mismatch  # noqa: E402


def _rep(busy=True, line=None, count=0, inside=False, op="all_reduce"):
    return {
        "busy": busy,
        "cell_line": line,
        "function": "all_reduce" if inside else "<module>",
        "in_collective": inside,
        "collective": {
            "op": op,
            "shapes": ["[3] float32"],
            "count": count,
            "done": not inside,
            "seconds": 2.0,
            "group_seq": count,
        },
    }


def test_the_odd_rank_is_the_one_behind_the_one_outside_or_the_one_still_busy():
    behind = odd_ranks({0: _rep(line=5, count=3, inside=True), 1: _rep(line=4, count=2)})
    assert list(behind) == [1] and "rank(s) 0 entered all_reduce #3" in behind[1]
    # reports arrive in any order (here as the ranks answered): the line names ranks in order
    late = odd_ranks(
        {0: _rep(line=5, count=5), 2: _rep(line=5, count=5), 3: _rep(line=4, count=3), 1: _rep(line=5, count=5)}
    )
    assert late == {3: "behind: rank(s) 0, 1, 2 entered all_reduce #5; this rank is at #3"}
    outside = odd_ranks(
        {0: _rep(line=5, count=2, inside=True), 1: _rep(line=4, count=2), 2: _rep(line=5, count=2, inside=True)}
    )
    assert list(outside) == [1] and "rank(s) 0, 2 wait in one" in outside[1]
    alone = odd_ranks({0: _rep(busy=False), 1: _rep(line=7, count=4, inside=True)})
    assert list(alone) == [1] and "rank(s) 0 finished it" in alone[1]
    minority = odd_ranks({0: _rep(line=3, count=1), 1: _rep(line=3, count=1), 2: _rep(line=9, count=1)})
    assert list(minority) == [2]
    assert odd_ranks({0: _rep(line=3, count=1), 1: _rep(line=3, count=1)}) == {}
    assert odd_ranks({0: _rep(line=3)}) == {}


def test_render_names_each_rank_its_cell_lines_and_the_ranks_that_did_not_answer():
    reps = {
        0: {
            **_rep(line=5, count=3, inside=True),
            "cell_stack": [{"line": 5, "function": "<module>", "code": "dist.all_reduce(t)"}],
        }
    }
    lines = render(reps, {0: "", 1: "on node2"})
    assert lines[0] == "rank 0: at cell line 5, in all_reduce (inside torch.distributed)"
    assert "    cell line   5 in <module>: dist.all_reduce(t)" in lines
    assert any(ln.startswith("    last collective: all_reduce [3] float32, this rank's collective #3") for ln in lines)
    assert lines[-1].startswith("rank(s) 1 did not answer")


def test_torchs_collective_mismatch_becomes_one_line_naming_both_ranks_and_calls():
    fp = "CollectiveFingerPrint(SequenceNumber={s}, OpType={op}, TensorShape=[{sh}], TensorDtypes=Float, TensorDeviceTypes=x)"
    evalue = (
        "Detected mismatch between collectives on ranks. Rank 1 is running collective: "
        + fp.format(s=4, op="ALLREDUCE", sh=4)
        + ", but Rank 0 is running collective: "
        + fp.format(s=4, op="BROADCAST", sh=3)
    )
    text = mismatch(evalue)
    assert text.startswith(
        "ranks called different collectives: rank 1 called allreduce([4] float) as its collective #5"
    )
    assert "but rank 0 called broadcast([3] float)" in text
    assert mismatch("some other RuntimeError") == ""


def test_time_in_the_debugger_counts_toward_no_timer(clock):
    """A person at a rank's pdb prompt is not a hang: timeout, grace and watchdog wait, then go on from where
    they were."""
    p = policy(clock, grace=1.0, watchdog=5.0, timeout=10.0)
    clock.advance(8.0)
    assert p.observe(failed=False, finished=True) is Action.WAIT  # a rank finished at 8 s
    for _ in range(60):  # ten minutes at the prompt
        assert p.observe(failed=True, finished=True, paused=True) is Action.WAIT
        clock.advance(10.0)
    assert p.released is None
    assert p.observe(failed=False, finished=True) is Action.WAIT  # out of it at 8 s of the cell's own time
    clock.advance(1.0)  # 9 s of the cell's own time: timeout (10) and watchdog (8 + 5) not reached
    assert p.observe(failed=False, finished=True) is Action.WAIT
    clock.advance(1.5)  # 10.5 s: past the timeout
    assert p.observe(failed=False, finished=True) is Action.RELEASE
    assert p.released is Release.TIMEOUT


def test_a_failure_while_someone_debugs_gets_its_grace_after_the_debugger(clock):
    p = policy(clock, grace=1.0)
    clock.advance(100.0)
    assert p.observe(failed=True, finished=True, paused=True) is Action.WAIT
    assert p.observe(failed=True, finished=True) is Action.WAIT  # out of the debugger: the grace starts
    clock.advance(1.5)
    assert p.observe(failed=True, finished=True) is Action.RELEASE
    assert p.released is Release.FAILURE


def test_ctrl_c_in_the_debugger_still_releases_and_escalates(clock):
    p = policy(clock, escalate=3.0)
    assert p.observe(failed=False, finished=False, paused=True) is Action.WAIT
    assert p.interrupt() is Action.RELEASE
    clock.advance(4.0)
    assert p.observe(failed=False, finished=False, paused=True) is Action.CHECK, "a release is never paused"
    clock.advance(LAST_RESORT_S)
    assert p.observe(failed=False, finished=False, paused=True) is Action.KILL


def test_ranks_ended_for_not_stopping_are_recovered_with_the_ranks_that_died():
    """When automatic recovery runs anyway (a rank died by itself), the ranks nbdist ended after the release are
    restarted with it: leaving them dead failed the recovery's new process group (benchmarks/kill_loop.py)."""
    from nbdist.lifecycle.recovery import Recovery, repair
    from nbdist.results import RankResult, RankStatus, RunResult

    killed = {"ename": "Killed", "evalue": "did not stop after an interrupt; nbdist ended it"}
    result = RunResult(
        [
            RankResult(0, 0, RankStatus.INTERRUPTED),
            RankResult(1, 1, RankStatus.DEAD, error={"ename": "EngineError", "evalue": "its process ended"}),
            RankResult(2, 2, RankStatus.DEAD, error=killed),
        ],
        released="failure",
    )
    assert repair(result, [2], Recovery(budget=3), False, membership=None) == [1, 2]  # type: ignore[arg-type]
    spent = Recovery(budget=1, used=1)  # no recovery: nothing returned, the note says what to run
    assert repair(result, [2], spent, False, membership=_Held("")) == []  # type: ignore[arg-type]


class _Held:
    """A membership whose launcher says why it ended every engine (a Ray driver that failed), or says nothing."""

    def __init__(self, why: str) -> None:
        self.engines = types.SimpleNamespace(launcher=types.SimpleNamespace(why_gone=lambda: why))


def test_the_note_of_ranks_that_died_says_why_when_what_held_them_ended_them_all():
    """A Ray world whose driver failed: every rank died with it, and the driver said why in its file
    (launch/ray.py say_ended): the note of their deaths carries that line, next to the command that brings them back."""
    from nbdist.lifecycle.recovery import Recovery, repair
    from nbdist.results import RankResult, RankStatus, RunResult

    result = RunResult([RankResult(r, r, RankStatus.DEAD, host="rnode1") for r in range(2)])
    why = "the Ray driver that held the world's ranks failed and ended them (RuntimeError: lost)"
    assert repair(result, [], Recovery(budget=0), False, membership=_Held(why)) == []  # type: ignore[arg-type]
    assert result.notes == [
        f"rank(s) 0 (on rnode1), 1 (on rnode1) died; {why}; %dist_restart --ranks 0,1 brings them back (the other "
        "ranks keep their variables)."
    ], result.notes


def test_what_a_rank_in_a_collective_waits_for():
    """The panel's words for a hang (doctor.waiting): the ranks not in the collective, or behind it on collectives."""
    from nbdist.doctor import waiting

    def rep(busy=True, inside=False, count=1, function="barrier"):
        return {"busy": busy, "in_collective": inside, "function": function, "collective": {"count": count}}

    assert waiting({0: rep(inside=True, count=2), 1: rep(count=1, function="<module>")}) == {
        0: "waiting in barrier for rank 1"
    }
    assert waiting({0: rep(inside=True), 1: {"busy": False}, 2: rep(inside=True)}) == {
        0: "waiting in barrier for rank 1",
        2: "waiting in barrier for rank 1",
    }
    assert waiting({0: rep(inside=True, count=3), 1: rep(inside=True, count=2), 2: rep(inside=True, count=2)}) == {
        0: "waiting in barrier for ranks 1,2",
        1: "waiting in barrier",
        2: "waiting in barrier",
    }
    assert waiting({0: rep(), 1: rep()}) == {}  # busy, in no collective: nobody waits
