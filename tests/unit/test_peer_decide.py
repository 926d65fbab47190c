"""peer_recovery.decide: from what the living ranks say they hold, whether and how a world is rebuilt from them
(no process group: the answers of parallel/peer_give.hold written out, as the typed message a rank sends)."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from nbdist.lifecycle.peer_recovery import decide
from nbdist.wire import HOLDING_VERSION, Holding, Names

NAMES = Names(models=("model",), optimizers=("opt",), loader="loader")


def _said(rank: int, done: int, keeps: dict[int, tuple[int, bool]] | None = None, checksum: str = "abc", **more) -> Holding:
    """A living rank after ``done`` optimizer steps, its own parts for the last two, the loop one step ahead."""
    fields = {"steps": {done - 1: done - 1, done: done}, "checksum": checksum, "keeps": keeps or {}, "names": NAMES}
    return Holding(rank, done=done, **{**fields, **more})


def test_a_restarted_rank_gets_its_part_from_the_rank_that_kept_it():
    said = [_said(0, 7, keeps={7: (1, True)}), _said(2, 7), _said(3, 7)]
    plan, why = decide(said, [1])
    assert why == "" and plan is not None
    assert (plan.done, plan.step, plan.source, plan.parts_from, plan.ahead) == (7, 7, 0, {1: 0}, ())


def test_the_fewest_steps_any_living_rank_completed_and_a_source_that_completed_exactly_those():
    said = [_said(0, 8, steps={6: 6, 7: 7, 8: 8}), _said(2, 7), _said(3, 7)]  # rank 0 passed the broken step
    plan, _ = decide(said, [])
    assert plan is not None and (plan.done, plan.source) == (7, 2)
    assert plan.ahead == (0,)  # it alone is sent the source's state; ranks 2 and 3 hold it (their checksums agree)


def test_a_world_that_goes_on_without_the_dead_needs_no_part_of_theirs_and_numbers_ranks_anew():
    said = [_said(0, 8, steps={6: 6, 7: 7, 8: 8}), _said(2, 7), _said(3, 7)]  # nobody kept rank 1's part
    plan, why = decide(said, [], renumbered={0: 0, 2: 1, 3: 2})
    assert why == "" and plan is not None and (plan.source, plan.parts_from) == (1, {})  # old rank 2 is rank 1 now
    late = [_said(0, 7), _said(2, 7), _said(3, 8, steps={6: 6, 7: 7, 8: 8})]
    plan, _ = decide(late, [], renumbered={0: 0, 2: 1, 3: 2})
    assert plan is not None and plan.ahead == (2,)  # old rank 3, a step ahead, in the new numbers
    restarted, why = decide(said, [1])
    assert restarted is None and "rank 1's own part" in why and "reached no living rank" in why


def test_ranks_that_hold_different_parameters_are_named_and_none_is_copied():
    said = [_said(0, 7, keeps={7: (1, True)}), _said(2, 7, checksum="abd"), _said(3, 7)]
    plan, why = decide(said, [1])
    assert plan is None and "rank(s) 0, 3: abc" in why and "rank(s) 2: abd" in why


def test_a_rank_that_can_give_nothing_says_why_and_nothing_is_copied():
    said = [_said(0, 7, keeps={7: (1, True)}), Holding(2, why="the model is sharded (FSDP)"), _said(3, 7)]
    assert decide(said, [1]) == (None, "the model is sharded (FSDP)")


def test_the_answer_is_typed_versioned_and_crosses_a_pickle_as_it_is():
    said = _said(0, 7, keeps={7: (1, True)})
    assert pickle.loads(pickle.dumps(said)) == said  # what ipyparallel does between a rank and the notebook
    with pytest.raises(AttributeError):  # a misspelt field fails where it is written, not mid-recovery
        _ = said.dnoe  # type: ignore[attr-defined]
    with pytest.raises(TypeError):
        Holding(0, dnoe=7)  # type: ignore[call-arg]
    other = dataclasses.replace(_said(2, 7), version=HOLDING_VERSION + 1)
    plan, why = decide([_said(0, 7, keeps={7: (1, True)}), other], [1])
    assert plan is None and "rank 2 answers in another nbdist's words" in why and str(HOLDING_VERSION + 1) in why


def test_mypy_finds_a_misspelt_field_of_the_message():
    """``make test`` runs mypy on nbdist before any test: a misspelt field of the message is found there."""
    from mypy import api

    code = "from nbdist.wire import Holding\nsaid = Holding(0)\nprint(said.dnoe, said.done + 1)\n"
    out, _, status = api.run(["--config-file=", "--no-incremental", "--follow-imports=silent", "-c", code])
    assert status == 1 and 'has no attribute "dnoe"' in out and out.count("error:") == 1, out


def test_a_rank_keeps_the_part_of_the_rank_whose_buddy_it_is(monkeypatch):
    """``source_of`` (whose part a rank keeps) is ``buddy``'s inverse, whatever the ranks a host holds: the two pairs
    a rank makes for the exchange (engine/control.pair_groups) must be its buddy's and its source's."""
    from nbdist.parallel.peer import buddy, source_of

    for local in ("1", "2", "3", "4", ""):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
        for size in range(2, 40):
            keepers = [buddy(r, size) for r in range(size)]
            assert sorted(keepers) == list(range(size)), (local, size)  # every part has one keeper
            assert [source_of(keeper, size) for keeper in keepers] == list(range(size)), (local, size)
