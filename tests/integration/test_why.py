"""%dist_why on a real 2-rank gloo world: a fault planted on rank 1 is named with its cause; a hang and a desync are
named while they hang, with the rank and the cell line, within 10 s of the stall; balanced runs get no verdict.

The cell is tests/why_cases.py's DDP loop. Time bounds only catch a hang (the cell's own release, RELEASE_S); how
often each verdict is right, over seeds and on 4 ranks, and what the timing costs: benchmarks/why.py.
"""

from __future__ import annotations

import pytest

import nbdist
from tests.helpers import run_cell
from tests.why_cases import cell

RELEASE_S = 12  # a hung cell's ranks are released after this (the verdict comes 3-5 s after the cell starts)
NAMED_WITHIN_S = 10
# A balanced run must get no verdict: measured with no other test beside it, as a user's machine runs one world.
pytestmark = pytest.mark.alone


@pytest.mark.parametrize("fault", ["none", "data", "compute", "hook", "save", "eval", "gc"])
def test_a_fault_on_rank_1_is_named_with_its_cause_and_a_balanced_run_gets_none(cluster, fault):
    verdict = nbdist.why(cell(fault, 1 if fault != "none" else -1), cluster)
    if fault == "none":
        assert verdict.cause == "balanced", verdict.text
    else:
        assert (verdict.cause, verdict.figures.get("ranks")) == (fault, [1]), verdict.text


@pytest.mark.parametrize("fault", ["none", "data", "compute", "save"])
def test_the_same_verdicts_for_an_fsdp2_loop(cluster, fault):
    """FSDP2's waits for its all-gathers and reduce-scatters are timed apart from compute: a rank with 8 times the
    rows is compute skew, not the waiting ranks."""
    verdict = nbdist.why(cell(fault, 1 if fault != "none" else -1, wrap="fsdp"), cluster)
    if fault == "none":
        assert verdict.cause == "balanced", verdict.text
    else:
        assert (verdict.cause, verdict.figures.get("ranks")) == (fault, [1]), verdict.text


@pytest.mark.parametrize("fault", ["hang", "desync"])
def test_a_hang_and_a_desync_are_named_while_they_hang_with_the_rank_and_line(cluster, fault, capsys):
    verdict = nbdist.why(cell(fault, 1), cluster, timeout=RELEASE_S)
    assert verdict.cause == fault, verdict.text
    assert verdict.figures["stalled_s"] <= NAMED_WITHIN_S, verdict.text
    said = capsys.readouterr().err
    assert f"nbdist: {verdict.text}" in said  # shown while the cell still hung, before its release
    if fault == "hang":
        assert verdict.figures["ranks"] == [1] and "rank 1 is at cell line" in verdict.text
        assert "(time.sleep(3600))" in verdict.text
    else:
        # rank 1's all_reduce of 3 numbers returned against rank 0's of 4 (gloo does not check); it waits in backward
        assert "all_reduce [4] float32" in verdict.text and "backward (DDP's gradient all-reduce)" in verdict.text
    result = cluster.run("_t = torch.ones(1); dist.all_reduce(_t)", sink=nbdist.cells.output.Sink())
    assert result.raise_for_error() and [float(t) for t in cluster.pull("_t")] == [2.0, 2.0]


def test_the_magic_judges_the_cell_and_the_line_form_judges_the_last_cell_again(cluster, ip):
    first = run_cell(ip, "%%dist_why\n" + cell("data", 1))
    assert (first.cause, first.figures["ranks"]) == ("data", [1])
    again = run_cell(ip, "%dist_why")
    assert again.cause == "data" and again.figures["ranks"] == [1]


def test_a_cell_with_no_training_loop_is_said_to_have_none(cluster):
    verdict = nbdist.why("x = sum(range(10))", cluster)
    assert verdict.cause == "cannot" and "fewer than 3 training steps were timed" in verdict.text
