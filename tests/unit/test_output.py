"""Output tagging and error rendering, without a cluster."""

from __future__ import annotations

import pytest

from nbdist.cells.output import TaggedPrinter
from nbdist.errors import RankError, RunTimeout
from nbdist.results import RankResult, RunResult, remote_error


def test_tagged_printer_tags_whole_lines_and_flushes_partials(capsys):
    p = TaggedPrinter()
    p.stream(1, "stdout", "hel")
    p.stream(0, "stdout", "a\nb")
    p.stream(1, "stdout", "lo\nworld")
    p.stream(0, "stderr", "oops\n")
    p.flush()
    out, err = capsys.readouterr()
    assert out.splitlines() == ["[rank 0] a", "[rank 1] hello", "[rank 0] b", "[rank 1] world"]
    assert err == "[rank 0] oops\n"


def test_quiet_printer_hides_other_ranks(capsys):
    p = TaggedPrinter(quiet_ranks={1})
    p.stream(0, "stdout", "zero\n")
    p.stream(1, "stdout", "one\n")
    p.tick()  # as the watch does after each batch it hands over
    assert capsys.readouterr().out == "[rank 0] zero\n"


class _Remote(Exception):
    ename = "ValueError"
    evalue = "boom"
    traceback = ["\x1b[31mValueError\x1b[0m Traceback", "Cell \x1b[32mIn[3]\x1b[0m, line 4", "ValueError: boom"]


def test_remote_error_finds_cell_line_through_ansi():
    err = remote_error(_Remote())
    assert err["ename"] == "ValueError" and err["line"] == 4


def test_raise_for_error_puts_the_raising_rank_first():
    ok = RankResult(rank=0, engine_id=5, status="interrupted", error={"ename": "KeyboardInterrupt", "evalue": ""})
    bad = RankResult(rank=1, engine_id=6, status="error", error={**remote_error(_Remote())})
    result = RunResult(ranks=[ok, bad], released="failure", notes=["the process group was rebuilt"])
    with pytest.raises(RankError) as info:
        result.raise_for_error()
    err = info.value
    assert err.rank == 1 and err.engine_id == 6
    assert str(err).startswith("rank 1 raised ValueError in cell line 4: boom")  # ranks, never engine ids
    rendered = "\n".join(err._render_traceback_())
    assert rendered.index("traceback from rank 1") < rendered.index("rank 0 was interrupted")
    assert "Cell In[3], line 4" in rendered and "\x1b[" not in rendered
    err.cell = 15  # the notebook's count for the cell, set where a magic knows it: the rank's In[3] is the page's [15]
    assert "Cell In[15], line 4" in "\n".join(err._render_traceback_())
    assert "the process group was rebuilt" in rendered


def test_timeout_raises_run_timeout():
    r = RankResult(rank=0, engine_id=0, status="timeout", error={"ename": "KeyboardInterrupt", "evalue": "", "line": 7})
    with pytest.raises(RunTimeout, match="^rank 0 did not finish in time in cell line 7"):
        RunResult(ranks=[r], released="timeout").raise_for_error()


def test_ok_result_returns_itself():
    r = RunResult(ranks=[RankResult(rank=0, engine_id=0, status="ok")])
    assert r.raise_for_error() is r and r.ok
    with pytest.raises(KeyError, match="rank 3 did not run this cell"):
        r[3]


def test_huge_output_is_cut_with_a_note(capsys):
    p = TaggedPrinter(limit=50)
    for _ in range(100):
        p.stream(0, "stderr", "x" * 20 + "\n")
    p.flush()
    err = capsys.readouterr().err
    assert len(err) < 400
    assert "stderr of rank 0 cut at 50 characters; the whole text is in the RunResult" in err
