"""Output folded across ranks and progress bars, on the pure Folder and the TaggedPrinter (clock injected)."""

from __future__ import annotations

import re

import pytest

from nbdist.cells.fold import MOST, Folder, visible
from nbdist.cells.output import TaggedPrinter
from nbdist.results import ranks_text


def _texts(lines):
    return [item[1].rstrip("\n") for item in lines]


def test_ranks_are_named_as_ranges():
    assert ranks_text([3]) == "rank 3"
    assert ranks_text([1, 0]) == "ranks 0,1"
    assert ranks_text(list(range(16))) == "ranks 0-15"
    assert ranks_text([0, 2, 4, 5, 6, 7, 9]) == "ranks 0,2,4-7,9"


def test_a_carriage_return_overwrites_as_a_terminal_shows_it():
    assert visible("train:   0%|  | 0/100\rtrain: 100%|##| 100/100") == "train: 100%|##| 100/100"
    assert visible("done\r") == "done"
    assert visible("plain") == "plain"


def test_the_same_line_on_every_rank_is_shown_once_with_the_ranks():
    f = Folder(list(range(16)))
    for rank in range(16):
        f.feed(rank, "stdout", "epoch 1 done\n", now=0.0)
    assert _texts(f.ready(0.0)) == ["[ranks 0-15] epoch 1 done"]
    assert f.finish() == []


def test_lines_that_differ_in_numbers_fold_into_one_with_the_spread():
    f = Folder(list(range(4)))
    for rank, loss in enumerate([0.61, 0.52, 0.58, 0.55]):
        f.feed(rank, "stdout", f"epoch 3 loss {loss:.2f}\n", now=0.0)
    assert _texts(f.ready(0.0)) == ["[ranks 0-3] epoch 3 loss 0.52…0.61  (low rank 1, high rank 0)"]


def test_lines_that_name_their_own_rank_stay_one_per_rank():
    f = Folder(list(range(4)))
    for rank in range(4):
        f.feed(rank, "stdout", f"rank {rank}: row {rank // 2} of the mesh\n", now=0.0)
    assert _texts(f.ready(0.0)) == [f"[rank {r}] rank {r}: row {r // 2} of the mesh" for r in range(4)]


def test_two_ranks_that_differ_show_one_line_each_grouped():
    f = Folder([0, 1])
    f.feed(1, "stdout", "loss 0.5\n", now=0.0)
    f.feed(0, "stdout", "loss 0.7\n", now=0.0)
    assert _texts(f.ready(0.0)) == ["[rank 0] loss 0.7", "[rank 1] loss 0.5"]


def test_a_line_waits_for_the_other_ranks_only_a_moment():
    f = Folder([0, 1], hold=0.25)
    f.feed(0, "stdout", "saving\n", now=0.0)
    assert f.ready(0.1) == [], "rank 1 may still print the same line"
    assert _texts(f.ready(0.3)) == ["[rank 0] saving"], "held no longer than hold"


def test_a_line_waits_while_more_ranks_send_it_and_longer_in_a_large_world():
    f = Folder([0, 1, 2], hold=0.25)
    f.feed(0, "stdout", "saving\n", now=0.0)
    f.feed(1, "stdout", "saving\n", now=0.2)
    assert f.ready(0.4) == [], "rank 1 sent it 0.2 s ago: rank 2 may still"
    assert _texts(f.ready(0.46)) == ["[ranks 0,1] saving"], "no rank sent it for a hold"
    # ranks that keep coming are waited for at most MOST holds from the first
    trickle = Folder(list(range(10)), hold=0.25)
    for rank in range(5):
        trickle.feed(rank, "stdout", "step\n", now=0.2 * rank)
        assert trickle.ready(0.2 * rank + 0.19) == []
    trickle.feed(5, "stdout", "step\n", now=1.0)
    assert _texts(trickle.ready(MOST * 0.25 + 0.01)) == ["[ranks 0-5] step"]
    # 64 ranks on 2 cores (CI): 33 ranks' line, and 0.6 s later the 31 others': one line (the hold is 2 s there)
    many = Folder(list(range(64)))
    for rank in range(33):
        many.feed(rank, "stdout", "sum 64.0\n", now=0.0)
    assert many.ready(0.6) == []
    for rank in range(33, 64):
        many.feed(rank, "stdout", "sum 64.0\n", now=0.6)
    assert _texts(many.ready(0.6)) == ["[ranks 0-63] sum 64.0"]


def test_a_finished_rank_is_not_waited_for():
    f = Folder([0, 1], hold=10.0)
    f.finished(1)
    f.feed(0, "stdout", "only rank 0\n", now=0.0)
    assert _texts(f.ready(0.0)) == ["[rank 0] only rank 0"]


def test_each_ranks_lines_keep_their_order_and_nothing_is_lost():
    f = Folder([0, 1, 2])
    f.feed(0, "stdout", "a\nb\nc\n", now=0.0)
    f.feed(1, "stdout", "a\nx\n", now=0.1)
    f.feed(2, "stdout", "a\nb\n", now=0.2)
    shown = _texts(f.finish())
    assert shown == ["[ranks 0-2] a", "[ranks 0,2] b", "[rank 0] c", "[rank 1] x"]
    assert shown.index("[ranks 0,2] b") < shown.index("[rank 0] c")


def test_unfolded_shows_every_rank_as_it_came():
    f = Folder([0, 1], fold=False)
    f.feed(0, "stdout", "same\n", now=0.0)
    f.feed(1, "stdout", "same\n", now=0.1)
    assert _texts(f.ready(0.2)) == ["[rank 0] same", "[rank 1] same"]


def test_a_progress_bar_is_a_live_line_until_it_ends():
    f = Folder([0, 1])
    f.feed(0, "stderr", "\rtrain:   0%|  | 0/100", now=0.0)
    f.feed(0, "stderr", "\rtrain:  50%|# | 50/100", now=0.1)
    assert f.live == {0: "train:  50%|# | 50/100"} and f.ready(0.1) == []
    f.feed(1, "stderr", "\rtrain:  20%|  | 20/100", now=0.1)
    assert "slowest rank 1 at 20/100, fastest rank 0 at 50/100" in f.world_progress()
    for rank in (0, 1):
        f.feed(rank, "stderr", f"\rtrain: 100%|##| 100/100 [00:01<00:00, 6{rank}.0it/s]\n", now=0.2)
        f.feed(rank, "stdout", "after\n", now=0.3)
    assert f.live == {}
    out = f.ready(1.0)
    assert [item[0] for item in out] == ["stdout", "stdout", "stdout"]  # a bar is ordinary output, also from stderr
    assert _texts(out) == [
        "[rank 0] train: 100%|##| 100/100 [00:01<00:00, 60.0it/s]",
        "[rank 1] train: 100%|##| 100/100 [00:01<00:00, 61.0it/s]",
        "[ranks 0,1] after",
    ]


def test_finished_bars_fold_whatever_padding_their_last_update_carried():
    # tqdm pads an update with spaces when the one before was longer: rank 1's last state ends in blanks
    f = Folder([0, 1, 2])
    f.feed(0, "stderr", "\rtrain: 100%|##| 9/9 [00:00<00:00, 7455.88it/s]\n", now=0.0)
    f.feed(
        1,
        "stderr",
        "\rtrain:  89%|# | 8/9 [00:00<00:00, 10000.00it/s]\rtrain: 100%|##| 9/9 [00:00<00:00, 8179.70it/s]  \n",
        now=0.0,
    )
    f.feed(2, "stderr", "\rtrain: 100%|##| 9/9 [00:00<00:00, 9000.00it/s]\n", now=0.0)
    assert _texts(f.ready(1.0)) == [
        "[ranks 0-2] train: 100%|##| 9/9 [00:00<00:00, 7455.88…9000.00it/s]  (low rank 0, high rank 2)"
    ]


def test_a_bar_that_never_ended_shows_its_last_state_when_the_cell_ends():
    f = Folder([0])
    f.feed(0, "stderr", "\r 10%|#  | 10/100\r 40%|#  | 40/100", now=0.0)
    assert _texts(f.finish()) == ["[rank 0]  40%|#  | 40/100"]


@pytest.fixture()
def clock():
    now = [0.0]
    return now


def test_the_printer_folds_streams_and_keeps_stdout_and_stderr_in_order(capsys, clock):
    p = TaggedPrinter(ranks=[0, 1], clock=lambda: clock[0])
    p.stream(0, "stderr", "\r 50%|#  | 1/2")
    p.stream(1, "stderr", "\r 50%|#  | 1/2")
    assert capsys.readouterr() == ("", ""), "a bar's update is not a line"
    for rank in (0, 1):
        p.stream(rank, "stderr", "\r100%|###| 2/2\n")
        p.stream(rank, "stderr", "a warning\n")
        p.stream(rank, "stdout", "after\n")
        p.finished(rank)
    clock[0] = 0.01
    p.tick()
    p.flush()
    out, err = capsys.readouterr()
    assert err == "[ranks 0,1] a warning\n" and out == "[ranks 0,1] 100%|###| 2/2\n[ranks 0,1] after\n"


def test_the_live_view_draws_one_line_per_rank_or_one_for_the_world():
    p = TaggedPrinter(ranks=list(range(8)))
    for rank in range(3):
        p.stream(rank, "stderr", f"\rstep {rank + 1}/10")
    assert p.live_text().splitlines() == ["[rank 0] step 1/10", "[rank 1] step 2/10", "[rank 2] step 3/10"]
    for rank in range(8):
        p.stream(rank, "stderr", f"\rstep {rank + 3}/10")
    assert p.live_text() == "[ranks 0-7] step 3/10  (slowest rank 0 at 3/10, fastest rank 7 at 10/10)"


def test_a_failure_at_16_ranks_names_the_cause_then_one_line_for_the_released():
    from nbdist.errors import RankError
    from nbdist.results import RankResult, RunResult

    bad = RankResult(rank=7, engine_id=7, status="error", error={"ename": "ValueError", "evalue": "boom", "line": 3})
    released = [
        RankResult(
            rank=r, engine_id=r, status="interrupted", error={"ename": "KeyboardInterrupt", "evalue": "", "line": 5}
        )
        for r in range(16)
        if r != 7
    ]
    reports = {r: {"busy": True, "cell_line": 5, "function": "all_reduce", "in_collective": True} for r in range(16)}
    reports.pop(7)
    result = RunResult(ranks=[bad, *released], released="failure", reports=reports)
    result.explain()
    with pytest.raises(RankError) as info:
        result.raise_for_error()
    assert str(info.value).splitlines() == [
        "rank 7 raised ValueError in cell line 3: boom",
        "ranks 0-6,8-15 were interrupted in cell line 5",
    ]
    assert len(info.value.failures) == 16, "every rank's failure is kept"
    waited = [n for n in result.notes if "when released" in n]
    assert waited == [
        "ranks 0-6,8-15 were at cell line 5, in all_reduce (inside torch.distributed), "
        "when released because a rank failed."
    ], result.notes


def test_status_at_16_ranks_is_one_line_per_kind_of_rank():
    from nbdist.results import grouped as summary

    rows = [
        {
            "rank": r,
            "host": f"node{1 + r // 8}",
            "device": "cpu",
            "backend": "gloo",
            "gpu": "",
            "state": "busy" if r == 14 else "idle",
        }
        for r in range(16)
    ]
    assert summary(rows) == ["ranks 0-13,15: idle on node1, node2 (cpu, gloo)", "rank 14: busy on node2 (cpu, gloo)"]


def test_where_at_many_ranks_groups_the_ranks_at_the_same_place():
    from nbdist.doctor import render

    def waiting(seconds, count=812):
        return {
            "busy": True,
            "cell_line": 5,
            "function": "all_reduce",
            "in_collective": True,
            "collective": {
                "op": "all_reduce",
                "shapes": ["[1] float32"],
                "count": count,
                "done": False,
                "seconds": seconds,
            },
        }

    reports = {r: waiting(31.0 + r / 10) for r in range(16)}
    reports[14] = {
        "busy": True,
        "cell_line": 3,
        "function": "<module>",
        "in_collective": False,
        "collective": {"op": "all_reduce", "shapes": ["[1] float32"], "count": 811, "done": True},
    }
    hosts = {r: f"node{1 + r // 8}" for r in range(16)}
    lines = render(reports, hosts=hosts)
    heads = [ln for ln in lines if not ln.startswith(" ")]
    assert heads[0] == "ranks 0-13,15 on node1, node2: at cell line 5, in all_reduce (inside torch.distributed)"
    assert heads[1].startswith("rank 14 on node2: at cell line 3, in <module>   <-- behind")
    assert len(heads) == 2
    assert len(render(reports)) > 16, "ungrouped: one entry per rank"


def test_a_display_every_rank_makes_alike_is_shown_once_in_its_place(capsys):
    f = Folder([0, 1, 2, 3])
    png = {"data": {"image/png": "iVBOR...", "text/plain": "<Figure>"}, "metadata": {}}
    for rank in range(4):
        f.feed(rank, "stdout", "before\n", now=0.0)
        f.display(rank, png, now=0.0)
        f.feed(rank, "stdout", "after\n", now=0.0)
    out = f.ready(0.0)
    assert [(name, text) for name, text, _ in out] == [
        ("stdout", "[ranks 0-3] before\n"),
        ("display", "[ranks 0-3]"),
        ("stdout", "[ranks 0-3] after\n"),
    ]
    assert out[1][2] is png
    g = Folder([0, 1])
    g.display(0, {"data": {"text/plain": "1"}}, now=0.0)
    g.display(1, {"data": {"text/plain": "2"}}, now=0.0)
    assert [text for _, text, _ in g.finish()] == ["[rank 0]", "[rank 1]"], "different data: one per rank"

    p = TaggedPrinter(ranks=[0, 1])
    for rank in (0, 1):
        p.result(rank, {"data": {"text/plain": "5"}})
    p.flush()
    assert capsys.readouterr().out == "[ranks 0,1] Out: 5\n"


def test_a_finished_bar_ends_before_what_the_rank_printed_after_its_loop():
    """On a rank, stdout and stderr flush apart: tqdm's closing newline can arrive after the next print."""
    f = Folder([0])
    f.feed(0, "stderr", "train:   0%|   | 0/5", now=0.0)
    f.feed(0, "stderr", "\rtrain: 100%|###| 5/5", now=0.1)
    f.feed(0, "stdout", "after\n", now=0.2)
    f.feed(0, "stderr", "\n", now=0.3)
    assert _texts(f.finish()) == ["[rank 0] train: 100%|###| 5/5", "[rank 0] after"]
    g = Folder([0])  # a bar still running when the rank prints: it stays live, nothing is printed twice
    g.feed(0, "stderr", "\rtrain:  40%|#  | 2/5", now=0.0)
    g.feed(0, "stdout", "loss 0.5\n", now=0.1)
    assert _texts(g.ready(1.0)) == ["[rank 0] loss 0.5"] and g.live == {0: "train:  40%|#  | 2/5"}


def test_in_a_kernel_the_bars_are_one_display_updated_in_place_at_most_four_times_a_second(monkeypatch):
    import IPython.display

    from nbdist.cells import output

    drawn: list[str] = []

    class Handle:
        def update(self, bundle, raw):
            drawn.append(bundle["text/plain"])

    def display(bundle, raw, display_id):
        drawn.append(bundle["text/plain"])
        return Handle()

    monkeypatch.setattr(output, "in_kernel", lambda: True)
    monkeypatch.setattr(IPython.display, "display", display)
    now = [0.0]
    p = TaggedPrinter(ranks=[0, 1], clock=lambda: now[0])
    for step in range(1, 101):  # 100 updates per rank in 1 s
        now[0] = step / 100
        for rank in (0, 1):
            p.stream(rank, "stderr", f"\rtrain: {step}/100")
        p.tick()  # the watch ticks after each batch it hands over
    assert 3 <= len(drawn) <= 6, f"{len(drawn)} draws for 200 updates in 1 s"
    assert re.fullmatch(r"\[rank 0\] train: \d+/100\n\[rank 1\] train: \d+/100", drawn[-1]), drawn[-1]
    p.flush()
    assert drawn[-1] == "", "the live view is emptied; the bars' last states are printed as lines"


def test_a_progress_bar_on_stderr_is_shown_as_ordinary_output_and_a_warning_stays_on_stderr(capsys):
    """tqdm writes to stderr: its finished bar under a cell that went well is not a problem's pink box."""
    f = Folder([0])
    f.feed(0, "stderr", "\rtrain:   0%|   | 0/5", now=0.0)
    f.feed(0, "stderr", "\rtrain: 100%|###| 5/5\n", now=0.1)
    f.feed(0, "stderr", "UserWarning: something to look at\n", now=0.2)
    f.feed(0, "stderr", "\reval: 100%|###| 2/2", now=0.3)  # a bar whose newline never came
    shown = f.ready(1.0) + f.finish()
    assert [(name, text.rstrip("\n")) for name, text, _ in shown] == [
        ("stdout", "[rank 0] train: 100%|###| 5/5"),
        ("stderr", "[rank 0] UserWarning: something to look at"),
        ("stdout", "[rank 0] eval: 100%|###| 2/2"),
    ]


def test_a_batch_of_every_ranks_text_is_one_look_and_each_lines_shape_is_made_once(monkeypatch, capsys):
    """256 ranks each print a line: the watch hands the batch over, then ticks. The printer looks at what is due once
    for the batch (not after each rank's text: 256 looks at 256 waiting lines each), and a line's numbers are masked
    once, not at every look (fold.shape)."""
    from nbdist.cells import fold

    masked, looks = [0], [0]
    real_shape, real_ready = fold.shape, Folder.ready

    def counted_shape(text):
        masked[0] += 1
        return real_shape(text)

    def counted_ready(self, now):
        looks[0] += 1
        return real_ready(self, now)

    monkeypatch.setattr(fold, "shape", counted_shape)
    monkeypatch.setattr(Folder, "ready", counted_ready)
    p = TaggedPrinter(ranks=list(range(256)), clock=lambda: 0.0)
    for rank in range(256):
        p.stream(rank, "stdout", "epoch 1 done\n")
    p.tick()
    assert looks[0] == 1, f"{looks[0]} looks at the ranks' waiting lines for one batch"
    for _ in range(20):  # the watch's later looks while the line is shown
        p.tick()
    assert masked[0] == 256, f"{masked[0]} maskings of 256 lines"
    assert capsys.readouterr().out == "[ranks 0-255] epoch 1 done\n"


def test_a_line_held_past_its_time_folds_with_the_same_line_that_comes_in_the_same_batch(capsys, clock):
    """Rank 1's line comes late, in the batch in which rank 0 prints its next: the look after the batch sees both
    ranks' first lines and shows them as one (a look after rank 0's text alone showed rank 0's first line alone)."""
    p = TaggedPrinter(ranks=[0, 1], clock=lambda: clock[0])
    p.stream(0, "stdout", "epoch 1 done\n")
    p.tick()
    clock[0] = 10.0  # past every hold
    p.stream(0, "stdout", "epoch 2 done\n")
    p.stream(1, "stdout", "epoch 1 done\n")
    p.tick()
    assert capsys.readouterr().out == "[ranks 0,1] epoch 1 done\n"
