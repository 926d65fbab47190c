"""peer_recovery.decide: from what the living ranks say they hold, whether and how a world is rebuilt from them
(no process group: the answers of parallel/peer.hold written out)."""

from __future__ import annotations

from nbdist.lifecycle.peer_recovery import decide

NAMES = {"model": "model", "optimizer": "opt", "loader": "loader", "extra": "", "state": {}}


def _said(rank: int, done: int, keeps: dict[int, list] | None = None, checksum: str = "abc") -> dict:
    """A living rank after ``done`` optimizer steps, its own parts for the last two, the loop one step ahead."""
    return {
        "rank": rank,
        "why": "",
        "done": done,
        "steps": {done - 1: done - 1, done: done},
        "checksum": checksum,
        "keeps": keeps or {},
        "names": NAMES,
    }


def test_a_restarted_rank_gets_its_part_from_the_rank_that_kept_it():
    said = [_said(0, 7, keeps={7: [1, True]}), _said(2, 7), _said(3, 7)]
    plan, why = decide(said, [1])
    assert why == "" and plan is not None
    assert (plan.done, plan.step, plan.source, plan.parts_from) == (7, 7, 0, {1: 0})


def test_the_fewest_steps_any_living_rank_completed_and_a_source_that_completed_exactly_those():
    said = [_said(0, 8), _said(2, 7), _said(3, 7)]  # rank 0 passed the step whose exchange broke elsewhere
    said[0]["steps"] = {6: 6, 7: 7, 8: 8}
    plan, _ = decide(said, [])
    assert plan is not None and (plan.done, plan.source) == (7, 2)


def test_a_world_that_goes_on_without_the_dead_needs_no_part_of_theirs_and_numbers_ranks_anew():
    said = [_said(0, 8), _said(2, 7), _said(3, 7)]  # nobody kept rank 1's part: no matter, it is not rebuilt
    said[0]["steps"] = {6: 6, 7: 7, 8: 8}
    plan, why = decide(said, [], renumbered={0: 0, 2: 1, 3: 2})
    assert why == "" and plan is not None and (plan.source, plan.parts_from) == (1, {})  # old rank 2 is rank 1 now
    restarted, why = decide(said, [1])
    assert restarted is None and "rank 1's own part" in why and "reached no living rank" in why


def test_ranks_that_hold_different_parameters_are_named_and_none_is_copied():
    said = [_said(0, 7, keeps={7: [1, True]}), _said(2, 7, checksum="abd"), _said(3, 7)]
    plan, why = decide(said, [1])
    assert plan is None and "rank(s) 0, 3: abc" in why and "rank(s) 2: abd" in why
