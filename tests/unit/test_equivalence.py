"""equivalence.compare on made-up records: the verdicts the planted cells (tests/integration/test_equiv.py) do
not reach, and the edges where it must say it cannot tell."""

from __future__ import annotations

from nbdist.equivalence import compare


def step(rows, grad, lr=0.1, loss=1.0, rng=7, random=False, dtype="float64", params=None):
    s = {"rows": rows, "grad": grad, "lr": [lr], "losses": [loss], "rng": rng, "random": random, "dtype": dtype}
    if params is not None:
        s["params"] = params
    return s


def record(steps, batchnorm=(), dropout=()):
    return {"steps": steps, "batchnorm": list(batchnorm), "dropout": list(dropout), "syncbn": 0}


ONE = record([step([1, 2, 3, 4], [1.0, 2.0], params=[0.5, 0.5]), step([5, 6, 7, 8], [3.0, 1.0])])


def world(*per_rank_rows, grads=([1.0, 2.0], [3.0, 1.0]), params=(0.5, 0.5), **kw):
    return [
        record([step(rows[0], grads[0], params=list(params), **kw), step(rows[1], grads[1], **kw)])
        for rows in per_rank_rows
    ]


def test_a_world_of_one_or_no_steps_cannot_be_told():
    assert "the world has 1 rank" in compare(ONE, [ONE]).text
    empty = compare(record([]), world(([1, 2], [5, 6]), ([3, 4], [7, 8])))
    assert empty.cause == "cannot" and "no training step was seen (no optimizer.step() on one rank)" in empty.text


def test_other_starting_weights_are_said_before_anything_else():
    verdict = compare(ONE, world(([1, 2], [5, 6]), ([3, 4], [7, 8]), params=(0.5, 0.6)))
    assert verdict.cause == "start" and "torch.manual_seed(0)" in verdict.text


def test_the_same_run_split_two_ways_is_equivalent_and_the_figure_is_given():
    verdict = compare(ONE, world(([1, 2], [5, 6]), ([3, 4], [7, 8])))
    assert verdict.equivalent and verdict.figures["grad"] == 0.0 and verdict.figures["loss"] == 0.0


def test_summed_gradients_rows_in_other_steps_and_rows_dropped():
    summed = compare(ONE, world(([1, 2], [5, 6]), ([3, 4], [7, 8]), grads=([2.0, 4.0], [6.0, 2.0])))
    assert summed.cause == "summed" and "2 times one rank's" in summed.text
    order = compare(ONE, world(([1, 5], [2, 6]), ([3, 7], [4, 8])))
    assert (order.cause, order.step) == ("order", 0)
    dropped = compare(ONE, world(([1, 2], [5]), ([3, 4], [7])))
    assert (dropped.cause, dropped.step) == ("drop_last", 1)


def test_gradients_that_part_with_no_known_cause_are_said_unknown_not_guessed():
    verdict = compare(ONE, world(([1, 2], [5, 6]), ([3, 4], [7, 8]), grads=([1.0, 2.5], [3.0, 1.0])))
    assert verdict.cause == "unknown" and "cannot name" in verdict.text
    drawn = compare(ONE, world(([1, 2], [5, 6]), ([3, 4], [7, 8]), grads=([1.0, 2.5], [3.0, 1.0]), random=True))
    assert drawn.cause == "same_random"


def test_float32_gradients_get_float32s_tolerance():
    one = record([step([1, 2], [1.0, 2.0], dtype="float32", params=[0.5])])
    near = [record([step([1], [1.00001, 2.0], dtype="float32", params=[0.5])]) for _ in range(2)]
    near[1]["steps"][0]["rows"] = [2]
    assert compare(one, near).equivalent
