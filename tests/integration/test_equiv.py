"""%dist_equiv on a real 2-rank gloo world: each planted bug named, each fix equivalent to one rank.

The cells are tests/equiv_cases.py's (fp64): the buggy one must get its cause, the fixed one (or the correct
cell) 'equivalent' with the loss within 1e-5 relative over 20 steps; the world must be whole after each (rank 0
ran the cell in a world of one and is back in the world's group). Then the line form, a long loop cut at the
steps compared, the cell's own output kept back, and bad input: a cell with no training step, a cell that only
runs on N ranks, both forms at once. How fast: benchmarks/equiv.py.
"""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError

import nbdist
from tests.equiv_cases import CASES, CORRECT
from tests.helpers import run_cell

AGREE = 1e-5  # the loss, relative, over 20 steps (fp64, gloo), for a fix to count as equivalent
RUNS = [("correct", "equivalent", CORRECT)] + [
    run
    for name, (cause, buggy, fixed) in CASES.items()
    for run in [(name, cause, buggy)] + ([(f"{name}-fixed", "equivalent", fixed)] if fixed else [])
]


def _world_whole(cluster) -> None:
    result = cluster.run(
        "_t = torch.ones(1) * (dist.get_rank() + 1); dist.all_reduce(_t); _n = dist.get_world_size()",
        sink=nbdist.cells.output.Sink(),
    )
    result.raise_for_error()
    assert cluster.pull("_n") == [2, 2]
    assert [float(t) for t in cluster.pull("_t")] == [3.0, 3.0]


@pytest.mark.parametrize(("name", "cause", "code"), RUNS, ids=[r[0] for r in RUNS])
def test_each_planted_bug_is_named_and_each_fix_trains_like_one_rank(cluster, name, cause, code):
    verdict = nbdist.equiv(code, cluster)
    assert verdict.cause == cause, verdict.text
    if cause == "equivalent":
        assert verdict.figures["steps"] == 20
        assert verdict.figures["loss"] <= AGREE, verdict.text
        one, world = zip(*verdict.figures["losses"], strict=True)
        assert len(set(one)) > 1, "the loss should move: the steps train"
    else:
        assert verdict.step is not None and 0 <= verdict.step < 20, verdict.text
    _world_whole(cluster)


def test_the_magic_prints_the_verdict_and_keeps_the_cells_own_output_back(cluster, ip, capsys):
    verdict = run_cell(ip, "%%dist_equiv\nprint('from the training cell')\n" + CASES["lr_scaled"][1])
    assert verdict.cause == "lr"
    out = capsys.readouterr().out
    assert "the learning rate is 0.1 on 2 ranks and 0.05 on one" in out, out
    assert "from the training cell" not in out
    run_cell(ip, "%%distributed\ndef train():\n" + "\n".join("    " + line for line in CORRECT.splitlines()))
    run_cell(ip, "%dist_equiv train")
    assert "equivalent: over 20 steps 2 ranks and one rank" in capsys.readouterr().out


def test_a_long_loop_stops_after_the_steps_compared_and_the_rank_stays_up(cluster):
    code = CORRECT.replace("for epoch in range(7):", "steps_done = 0\nfor epoch in range(10_000):").replace(
        "opt.step()", "opt.step()\n        steps_done += 1"
    )
    verdict = nbdist.equiv(code, cluster, steps=5)
    assert verdict.equivalent and verdict.figures["steps"] == 5, verdict.text
    assert cluster.pull("steps_done") == [5, 5]  # the N-rank run's, left in the namespaces
    _world_whole(cluster)


def test_bad_input_gets_one_line_that_says_what_cannot_be_told(cluster, ip):
    nothing = nbdist.equiv("x = 1 + 1", cluster)
    assert nothing.cause == "cannot" and "no training step was seen" in nothing.text
    only_n = nbdist.equiv("assert dist.get_world_size() > 1, 'needs ranks'\n" + CORRECT, cluster)
    assert only_n.cause == "cannot", only_n.text
    assert "the cell failed on one rank (in a world of one rank)" in only_n.text and "needs ranks" in only_n.text
    with pytest.raises(UsageError, match="not both or neither"):
        ip.run_cell_magic("dist_equiv", "train", "x = 1")
    with pytest.raises(nbdist.ConfigError, match=r"steps \(0\)"):
        nbdist.equiv(CORRECT, cluster, steps=0)
    _world_whole(cluster)


def test_the_one_rank_run_is_what_python_prog_py_gives(cluster, tmp_path):
    """The reference itself: the correct cell as a plain one-process program (``python prog.py``, a gloo world of
    one it makes itself) prints each step's loss; %dist_equiv's one-rank run recorded the same losses."""
    import subprocess
    import sys

    from tests.helpers import free_port

    prog = tmp_path / "prog.py"
    prog.write_text(
        "import os\nimport torch.distributed as dist\n"
        f"os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT='{free_port()}')\n"
        "dist.init_process_group('gloo', rank=0, world_size=1)\n"
        + CORRECT.replace("        opt.step()", "        opt.step()\n        print(repr(loss.item()))")
        + "dist.destroy_process_group()\n"
    )
    done = subprocess.run([sys.executable, str(prog)], capture_output=True, text=True, timeout=120, check=True)
    theirs = [float(x) for x in done.stdout.split()][:20]
    verdict = nbdist.equiv(CORRECT, cluster)
    ours = [one for one, _ in verdict.figures["losses"]]
    assert len(ours) == len(theirs) == 20
    assert max(abs(a - b) / abs(b) for a, b in zip(ours, theirs, strict=True)) <= 1e-12, (ours, theirs)
