"""print(result) of a cell is a line for the cell and one per rank; show() prints every rank's whole text
(issue 26: the repr printed every rank's traceback with terminal colours)."""

from __future__ import annotations

from nbdist.results import RankResult, RankStatus, RunResult

TRACEBACK = [
    "\x1b[0;31m---------------------------------------------------------------------------\x1b[0m",
    "\x1b[0;31mValueError\x1b[0m                                Traceback (most recent call last)",
    "Cell \x1b[0;32mIn[1], line 2\x1b[0m",
    "\x1b[0;31mValueError\x1b[0m: bad batch",
]


def _result() -> RunResult:
    return RunResult(
        ranks=[
            RankResult(0, 0, RankStatus.INTERRUPTED, stdout="step 1\nstep 2\n", wall_s=1.5),
            RankResult(
                1,
                1,
                RankStatus.ERROR,
                stdout="step 1\n",
                error={"ename": "ValueError", "evalue": "bad batch\nmore", "traceback": TRACEBACK, "line": 2},
                wall_s=0.25,
            ),
        ],
        wall_s=1.5,
        notes=["rank 0 was at cell line 3 when released"],
    )


def test_the_repr_is_a_line_per_rank_without_colours_or_tracebacks():
    text = repr(_result())
    assert text.splitlines() == [
        "RunResult(2 rank(s), 1.50 s, not ok on rank(s) 0, 1)",
        "  rank 0: interrupted, 1.50 s, 2 line(s) of output",
        "  rank 1: error, 0.25 s, ValueError: bad batch (cell line 2)",
    ]
    assert "\x1b" not in text and "Traceback" not in text


def test_show_prints_every_ranks_whole_text_without_colours(capsys):
    _result().show()
    out = capsys.readouterr().out
    assert "\x1b" not in out
    assert "---- rank 1: error, 0.25 s, ValueError: bad batch (cell line 2)\nstep 1\n" in out
    assert "ValueError                                Traceback (most recent call last)" in out
    assert out.rstrip().endswith("rank 0 was at cell line 3 when released")
