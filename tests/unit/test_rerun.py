"""lifecycle/rerun.py: a loop around the loop over the loader that begins again when recovery runs the cell again,
read from the cell's code; and peer_recovery.decide refusing a plan there (and only there). The names a setup cell
binds (recovery forgets a checkpoint of a model or optimizer it replaced)."""

from __future__ import annotations

import pytest

from nbdist.lifecycle.peer_recovery import decide
from nbdist.lifecycle.rerun import binds, fix, starts_over
from nbdist.wire import Holding, Names

NESTED = """
for epoch in range(3):
    for x, y in loader:
        step(x, y)
    scheduler.step()
"""


@pytest.mark.parametrize(
    ("code", "header"),
    [
        (NESTED, "for epoch in range(3)"),
        (NESTED.replace("range(3)", "range(loader.epoch, 3)"), ""),
        (NESTED.replace("x, y in loader", "i, (x, y) in enumerate(loader)"), "for epoch in range(3)"),
        ("for epoch in range(E):\n    for b in tqdm(loader):\n        pass", "for epoch in range(E)"),
        ("for i, (x, y) in enumerate(loader):\n    pass", ""),  # no loop around it: the pass goes on
        ("for epoch in range(3):\n    for s, b in loader.steps(9):\n        pass", ""),  # steps() counts steps
        (NESTED.replace("in loader", "in val_loader"), ""),  # another loader
        ("%time x = 1\nfor a in loader:\n", ""),  # not Python: nothing said
    ],
)
def test_the_loop_around_the_loaders_loop_that_begins_again_is_named(code, header):
    assert starts_over(code, "loader") == header


def test_the_fix_begins_the_loop_where_the_loader_is():
    assert fix("for epoch in range(3)", "loader") == "write `for epoch in range(loader.epoch, 3)`"
    assert fix("for e in range(1, n + 1)", "dl") == "write `for e in range(dl.epoch, n + 1)`"
    assert fix("for e in epochs", "dl") == "begin it at dl.epoch"


def _said(rank: int, passes: int) -> Holding:
    names = Names(models=("model",), optimizers=("opt",), loader="loader")
    return Holding(rank, done=7, steps={7: 20}, passes={7: passes}, checksum="a", keeps={7: (1, True)}, names=names)


def test_a_plan_the_cells_outer_loop_would_repeat_is_refused_saying_what_to_write():
    plan, why = decide([_said(0, 1)], [1], code=NESTED)
    assert plan is None
    assert why == (
        "the cell runs again from its first line, and its `for epoch in range(3)` would begin again although it had "
        "finished 1 pass(es) over loader: write `for epoch in range(loader.epoch, 3)`"
    )
    for code, passes in ((NESTED, 0), (NESTED.replace("range(3)", "range(loader.epoch, 3)"), 1), ("", 1)):
        plan, why = decide([_said(0, passes)], [1], code=code)
        assert why == "" and plan is not None and (plan.step, plan.passes) == (20, passes)


def test_binds_names_a_setup_cells_top_level_names_and_not_its_functions_own():
    code = """import os.path, torch as t
from x import y as z
model, (opt, q) = 1, (2, 3)
for i in range(3): pass
with open('f') as fh: pass
def f():
    inner = 1
class C:
    member = 2
if (w := 3): pass
obj.attr = 5
d['k'] = 1
lam = lambda arg: arg
"""
    assert binds(code) == {"os", "t", "z", "model", "opt", "q", "i", "fh", "f", "C", "w", "lam"}  # not obj, d
    assert binds("model = (") == set()  # what does not parse binds nothing
