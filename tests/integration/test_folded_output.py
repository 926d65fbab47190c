"""Output at many ranks on a real cluster: folded across ranks, progress bars live and right at the end.

The reference for a progress bar is the same loop in one process: what its last line shows.
"""

from __future__ import annotations

import contextlib
import io
import re

import pytest

import nbdist
from nbdist.cells.fold import shape, visible
from tests.helpers import run_cell

TQDM = (
    "from tqdm import tqdm\n"
    "dist.barrier()  # the ranks start their loops together: what is tested is the folding, not the launch order\n"
    "for _ in tqdm(range(200), desc='train', mininterval=0.01):\n"
    "    sum(range(2000))\n"
    "print('after')\n"
)


@pytest.fixture(scope="module")
def four():
    with nbdist.start(n=4, oversubscribe=True, timeout=120) as cluster:
        yield cluster


@contextlib.contextmanager
def screen():
    """What the notebook shows: stdout and stderr in one stream, in the order written."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        yield out


def test_a_line_every_rank_prints_is_shown_once_and_kept_whole_per_rank(four):
    with screen() as out:
        result = four.run("print('epoch 1 done')\nprint(f'loss {0.5 + dist.get_rank() / 10:.2f}')")
    result.raise_for_error()
    assert out.getvalue().splitlines() == [
        "[ranks 0-3] epoch 1 done",
        "[ranks 0-3] loss 0.50…0.80  (low rank 0, high rank 3)",
    ]
    assert [r.stdout for r in result.ranks] == [f"epoch 1 done\nloss {0.5 + i / 10:.2f}\n" for i in range(4)]


def test_each_shows_every_ranks_lines_as_they_are(four):
    with screen() as out:
        four.run("print('epoch 1 done')", each=True).raise_for_error()
    assert sorted(out.getvalue().splitlines()) == [f"[rank {i}] epoch 1 done" for i in range(4)]


def test_the_magic_takes_each(four, ip, capsys):
    run_cell(ip, "%%distributed --each --ranks 0,1\nprint('hi')")
    assert sorted(capsys.readouterr().out.splitlines()) == ["[rank 0] hi", "[rank 1] hi"]
    run_cell(ip, "%%distributed --ranks 0,1\nprint('hi')")
    assert capsys.readouterr().out.splitlines() == ["[ranks 0,1] hi"]


def test_a_tqdm_bar_ends_at_100_percent_before_the_line_printed_after_it(four):
    from tqdm import tqdm

    class Terminal(io.StringIO):
        encoding = "utf-8"  # as a rank's stderr is: tqdm draws its bar with block characters

    reference = Terminal()  # the same loop in one process: its bar's last state
    for _ in tqdm(range(200), desc="train", mininterval=0.01, file=reference):
        sum(range(2000))
    expected = visible(reference.getvalue().rstrip("\n").split("\n")[-1])
    assert "100%" in expected and "200/200" in expected

    with screen() as out:
        result = four.run(TQDM)
    result.raise_for_error()
    lines = out.getvalue().splitlines()
    bars = [ln for ln in lines if "train" in ln]
    assert len(bars) == 1, f"one line for the four bars' final states: {lines}"
    tag, _, bar = bars[0].partition("] ")
    assert tag == "[ranks 0-3" and "\r" not in bar and " 0%|" not in bar
    plain = re.sub(r"  \(low rank \d+, high rank \d+\)$", "", re.sub(r"…[\d.]+", "", bar))
    assert shape(plain) == shape(expected), (bar, expected)
    assert lines.index(bars[0]) < lines.index("[ranks 0-3] after"), "the bar ends before the line after it"
    assert all("200/200" in visible(r.stderr.rstrip("\n").split("\n")[-1]) for r in result.ranks), "kept whole"


def test_tqdm_auto_draws_the_console_bar_on_a_rank(four):
    """A rank is an IPython kernel of its own: tqdm.auto would pick a notebook widget per rank there."""
    with screen() as out:
        result = four.run(TQDM.replace("from tqdm import tqdm", "from tqdm.auto import tqdm, trange\nlist(trange(3))"))
    result.raise_for_error()
    assert all(r.outputs == [] for r in result.ranks), "no widget displayed by a rank"
    bars = [ln for ln in out.getvalue().splitlines() if "train" in ln]
    assert len(bars) == 1 and "200/200" in bars[0] and bars[0].startswith("[ranks 0-3] train: 100%")


def test_what_a_fast_cell_writes_to_stdout_and_stderr_is_shown_in_the_order_written(four):
    """A cell over before the watch could look (a few flushed prints): the watch hears every rank from its first
    message, so the lines come in the order the rank sent them, stdout and stderr interleaved, every time (not
    stdout, then stderr, as ipyparallel's stored output would give them). Flushed, because a rank's kernel sends
    each stream's buffer on its own clock otherwise (as any Jupyter kernel does). Run 15 times: a race would show."""
    code = "import sys\n" + "\n".join(
        f"print({word!r}, file=sys.{stream}, flush=True)"
        for word, stream in (("one", "stdout"), ("two", "stderr"), ("three", "stdout"), ("four", "stderr"))
    )
    for _ in range(15):
        with screen() as out:
            four.run(code, each=True).raise_for_error()
        for rank in range(4):
            mine = [ln.split("] ", 1)[1] for ln in out.getvalue().splitlines() if ln.startswith(f"[rank {rank}] ")]
            assert mine == ["one", "two", "three", "four"], out.getvalue()
