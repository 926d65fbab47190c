"""The dashboard without a kernel: decimation that keeps extremes, the headline numbers, the
step split, and a figure a person can read (one colour and one legend entry per rank, titles
with units, live updates that restyle instead of rebuilding)."""

from __future__ import annotations

import math
import random
import re

import pytest

from nbdist.widgets.dashboard import Dashboard, headline_parts, panels, traces
from nbdist.widgets.figure import LEGEND_ROW_PX, TITLE_CHARS, TITLE_LINE_PX, TOP_PAD_PX, wrap
from nbdist.widgets.store import MetricStore, Series


def test_series_keeps_every_spike_and_dip_of_a_long_run_in_bounded_points():
    rng = random.Random(0)
    s = Series(max_points=500)
    values = [1.0 + 0.01 * rng.random() for _ in range(100_000)]
    values[90_123] = 50.0  # one loss spike late in the run
    values[4_567] = -3.0  # one dip early
    for i, v in enumerate(values):
        s.add(i, v)
    xs, ys = s.points()
    assert len(xs) <= 502  # 250 buckets of two points, and the run's first and latest
    assert xs == sorted(xs) and xs[0] == 0 and xs[-1] >= 99_000  # the whole run, in order
    assert 50.0 in ys and xs[ys.index(50.0)] == 90_123  # the spike, at its own step
    assert -3.0 in ys and xs[ys.index(-3.0)] == 4_567
    # every drawn point is a real (step, value) pair of the run
    assert all(values[int(x)] == y for x, y in zip(xs, ys, strict=True))
    # each bucket's max is the max of the values it covers: nothing higher hides between points
    assert max(ys) == max(values) and min(ys) == min(values)


def test_a_short_series_is_drawn_point_for_point():
    s = Series(max_points=1000)
    for i in range(200):
        s.add(i, float(i % 7))
    xs, ys = s.points()
    assert xs == [float(i) for i in range(200)] and ys == [float(i % 7) for i in range(200)]


def _rows(step_s, rank, steps=30, data_s=None, **extra):
    rows = []
    for i in range(steps):
        row = {
            "step": i,
            "loss": 1.0 / (i + 1) + rank,
            "time/step_s": step_s,
            "comm/time_s": step_s / 4,
            "comm/exposed_s": step_s / 10,
            "comm/overhead(%)": 25.0,
            "comm/bytes": 2_000_000.0,
            "throughput/samples_per_s": 32 / step_s,
            **extra,
        }
        if data_s is not None:
            row["time/data_s"] = data_s
        rows.append(row)
    rows[-1]["memory/rss_MiB"] = 300.0 + rank
    return rows


def test_headline_answers_how_it_is_going():
    store = MetricStore()
    store.add(0, _rows(0.020, 0))
    store.add(1, _rows(0.025, 1))  # rank 1 is 25% slower
    h = store.headline()
    assert h["step"] == 29
    assert h["loss"] == ("loss", pytest.approx((1 / 30 + 1 / 30 + 1) / 2))
    assert h["samples_per_s"] == pytest.approx(32 / 0.020 + 32 / 0.025)
    assert h["comm_pct"] == pytest.approx(25.0)
    assert h["slowest"] == (1, pytest.approx(25.0))
    assert "ratio" not in h


def test_the_step_splits_into_compute_exposed_comm_and_data_wait():
    store = MetricStore()
    store.add(0, _rows(0.020, 0, data_s=0.005))
    store.add(1, _rows(0.020, 1))  # a loader that is not shard()'s: no data figure
    split = store.split()
    assert split[0] == pytest.approx({"compute": 13.0, "comm": 2.0, "data": 5.0})
    assert split[1] == pytest.approx({"compute": 18.0, "comm": 2.0, "data": 0.0})
    # FSDP logs only its time in collectives: that is the comm part then
    fsdp = MetricStore()
    fsdp.add(0, [{"step": 0, "time/step_s": 0.010, "comm/time_s": 0.004}])
    assert fsdp.split()[0] == pytest.approx({"compute": 6.0, "comm": 4.0, "data": 0.0})


def test_one_colour_and_one_legend_entry_per_rank_and_titles_with_units():
    board = Dashboard()
    board.update(0, _rows(0.02, 0, data_s=0.001, **{"acc": 0.5}))
    board.update(1, _rows(0.03, 1, data_s=0.001, **{"acc": 0.6}))
    fig = board.figure()
    titles = [a.text for a in fig.layout.annotations]
    assert titles[0] == "Loss" and titles[1] == "acc"
    assert "Samples/s per rank · total dotted" in titles
    assert "Communication, % of each step" in titles
    assert "Sent per step, MB" in titles
    assert "Memory per rank, MiB" in titles
    assert "Step time, ms: compute · comm ▨ · data ⋯" in titles
    legend = [t.name for t in fig.data if t.showlegend]
    assert legend == ["rank 0", "rank 1"]  # one short legend, whatever the number of panels
    colours = {}
    for t in fig.data:
        if t.name.startswith("rank "):
            colour = t.line.color if t.type == "scatter" else t.marker.color
            colours.setdefault(t.name, set()).add(colour)
    assert all(len(c) == 1 for c in colours.values()) and colours["rank 0"] != colours["rank 1"]
    total = [t for t in fig.data if t.name == "total"]
    assert len(total) == 1 and list(total[0].y)[-1] == pytest.approx(32 / 0.02 + 32 / 0.03)
    bytes_trace = next(t for t in fig.data if t.name == "rank 0" and t.y is not None and max(t.y) == 2.0)
    assert bytes_trace is not None  # 2,000,000 bytes drawn as 2 MB
    assert "step 29" in fig.layout.title.text and "samples/s, all ranks" in fig.layout.title.text


def test_compression_ratio_in_the_bytes_title_and_the_headline():
    store = MetricStore()
    for rank in (0, 1):
        store.add(rank, _rows(0.02, rank, **{"comm/ratio": 48.0}))
    assert "Sent per step, MB · compressed 48x" in [p.title for p in panels(store)]
    assert store.headline()["ratio"] == 48.0


def test_live_updates_restyle_the_traces_and_rebuild_only_when_a_rank_appears():
    board = Dashboard(refresh_s=0)
    board.store.add(0, _rows(0.02, 0, steps=10))
    board.show(display=lambda box, display_id: object())  # displayed without a frontend: builds the figure
    widget = board.live_figure
    assert board.rebuilds == 1
    for start in range(10, 50, 10):
        board.store.add(0, [dict(r, step=r["step"] + start) for r in _rows(0.02, 0, steps=10)])
        board.render()
    assert board.live_figure is widget and board.rebuilds == 1 and board.renders == 4
    loss = next(t for t in widget.data if t.name == "rank 0")
    assert len(loss.x) == 50 and loss.x[-1] == 49  # the new points arrived in the same trace
    assert 'data-name="step"' in board.headline_widget.value and ">49<" in board.headline_widget.value
    board.store.add(1, _rows(0.02, 1, steps=5))
    board.render()
    assert board.rebuilds == 2 and board.live_figure is not widget


def test_gpu_memory_is_dashed_beside_cpu_memory_and_a_cpu_rank_logs_none():
    from nbdist.engine import metrics

    store = MetricStore()
    for rank, mib in ((0, 100.0), (1, 300.0)):
        store.add(
            rank, [{"step": i, "loss": 1.0, "memory/gpu_MiB": mib + i, "memory/rss_MiB": 900.0} for i in range(3)]
        )
    layout = panels(store)
    assert [p.title for p in layout] == ["Loss", "Memory per rank, MiB · GPU dashed"]
    gpu = [t for t in traces(store, layout) if t.ident.startswith("1:memory/gpu_MiB")]
    assert [list(t.y) for t in gpu] == [[100.0, 101.0, 102.0], [300.0, 301.0, 302.0]]
    assert all(t.style["line"]["dash"] == "dash" for t in gpu)
    metrics.log(step=0, loss=1.0)  # this process never initialised CUDA: no GPU column
    metrics.flush()
    rows = metrics.local_rows()
    assert rows and "memory/gpu_MiB" not in rows[-1]
    assert 10 < rows[-1]["memory/rss_MiB"] < 100_000  # this process's resident memory, in MiB


def test_log_outside_an_engine_keeps_rows_locally():
    from nbdist.engine import metrics

    metrics.log(step=1, loss=0.5)
    metrics.flush()
    assert metrics.local_rows()[-1]["loss"] == 0.5


def test_bad_input_to_log_is_one_line_each_and_loses_nothing_else(capsys, monkeypatch):
    """A string as a value, NaN, a step that goes back, a new metric name every step: one line on stderr each,
    once per cell; the rows are kept with what is good in them, and the names stay bounded."""
    import math

    from nbdist.engine import metrics

    metrics.cell_over()
    monkeypatch.setattr(metrics.STATE, "names", set())
    for step in range(3):
        metrics.log(step=step, loss="high", acc=0.5, lr=float("nan"))
    metrics.log(step=1, loss=0.25)  # back
    for step in range(2 * metrics.MAX_NAMES):
        metrics.log(step=10 + step, **{f"loss_{step}": 1.0})
    metrics.log(step="ten", acc=0.75)
    metrics.flush()
    said = capsys.readouterr().err.splitlines()
    assert said == [
        "nbdist.log: loss='high' is not a number; it is left out of the row (and later rows). Log numbers: use "
        ".item() on a tensor.",
        "nbdist.log: step 1 comes after step 2 on this rank; kept, but the dashboard's x axis is the step, so its "
        "lines run back. Log a step that keeps counting (epoch * steps_per_epoch + i).",
        f"nbdist.log: 'loss_{metrics.MAX_NAMES - 3}' would be this rank's metric name {metrics.MAX_NAMES + 1}; it "
        "and later new names are left out. Log a fixed set of names (loss=..., not loss_{step}=...).",
        "nbdist.log: step='ten' is not a number; the row is kept without its step.",
    ], said
    rows = metrics.local_rows()
    first = rows[-(3 + 1 + 2 * metrics.MAX_NAMES + 1)]
    assert first["acc"] == 0.5 and "loss" not in first and math.isnan(first["lr"])
    assert len(metrics.STATE.names) == metrics.MAX_NAMES
    assert rows[-1]["step"] is None and rows[-1]["acc"] == 0.75
    metrics.cell_over()  # the next cell is told again
    metrics.log(step=0, loss="x")
    assert "is not a number" in capsys.readouterr().err


def test_state_strip_shows_each_rank_in_the_colour_of_the_one_vocabulary():
    from nbdist.results import STATE_COLOURS

    board = Dashboard(palette=STATE_COLOURS)
    board.set_state(1, "failed")
    board.set_state(0, "busy")
    html = board.strip_html()
    assert html.index("rank 0: busy") < html.index("rank 1: failed")
    assert f"background:{STATE_COLOURS['failed']}" in html and f"background:{STATE_COLOURS['busy']}" in html


def test_above_the_panels_grouping_size_the_chips_group_ranks_as_the_panel_does():
    from nbdist.results import GROUP_ABOVE, STATE_COLOURS, chips

    board = Dashboard(palette=STATE_COLOURS, chips=chips)
    for rank in range(GROUP_ABOVE):
        board.set_state(rank, "busy")
    assert [c[0] for c in chips(board.states)] == [f"rank {r}: busy" for r in range(GROUP_ABOVE)]
    for rank in range(GROUP_ABOVE, 16):
        board.set_state(rank, "busy")
    board.set_state(5, "dead")
    html = board.strip_html()
    labels = re.findall(r'<span class="nbdist-rank"[^>]*>([^<]*)</span>', html)
    assert labels == ["ranks 0-4,6-15: busy", "rank 5: dead"], labels  # the panel's words (results.grouped)
    assert html.count("white-space:nowrap") == 2 and f"background:{STATE_COLOURS['dead']}" in html


def test_one_vocabulary_for_a_ranks_state():
    """Word, colour, phrase and grouping are defined once (results.py); every state has a colour of its own, and
    no view keeps a palette or a phrase of its own (the panel's TypeScript draws what the server gives it)."""
    import pathlib

    from nbdist.results import GROUP_ABOVE, STATE_COLOURS, RankState, grouped, state_phrase

    assert set(STATE_COLOURS) == {state.value for state in RankState}
    assert len(set(STATE_COLOURS.values())) == len(STATE_COLOURS)
    assert state_phrase("busy", 7) == "busy at cell line 7" and state_phrase("dead", 7) == "dead"
    rows = [{"rank": r, "state": "busy", "line": 3, "host": "h", "device": "cpu"} for r in range(GROUP_ABOVE + 1)]
    assert grouped(rows) == [f"ranks 0-{GROUP_ABOVE}: busy at cell line 3 on h (cpu)"]
    root = pathlib.Path(__file__).resolve().parents[2]
    sources = [*root.joinpath("nbdist").rglob("*.py"), *root.joinpath("js", "src").glob("*.ts")]
    elsewhere = [
        f"{path.relative_to(root)}: {needle}"
        for path in sources
        if path.name != "results.py"
        for needle in ("at cell line ${", "#2e7d32", "#1565c0", "GROUP_ABOVE = ")
        if needle in path.read_text()
    ]
    assert not elsewhere, elsewhere


def test_rows_without_a_step_are_numbered_and_nan_free():
    store = MetricStore()
    store.add(0, [{"t": 0, "step": None, "x": 5.0}, {"t": 0, "step": None, "x": 6.0}])
    assert store.series[("x", 0)].points() == ([0.0, 1.0], [5.0, 6.0])
    assert not any(math.isnan(v) for v in store.series[("x", 0)].points()[1])


def test_the_live_figure_widget_can_be_built():
    """plotly's FigureWidget (the live dashboard) needs anywidget, which nbdist never imports
    itself: the dependency stays declared in pyproject.toml for this."""
    import plotly.graph_objects as go

    widget = go.FigureWidget()
    widget.add_scatter(x=[0, 1], y=[1.0, 0.5])
    assert len(widget.data) == 1


def _many(n: int, steps: int = 50):
    store = MetricStore()
    store.add_runs({r: _rows(0.02 + (0.01 if r == 13 else 0.0) + 0.0001 * r, r, steps=steps) for r in range(n)})
    return store


def test_above_eight_ranks_each_panel_is_the_spread_with_the_slowest_and_fastest_named():
    import numpy as np

    from nbdist.widgets.figure import named_ranks

    store = _many(16)
    assert named_ranks(store) == {13: "rank 13 (slowest)", 0: "rank 0 (fastest)"}
    layout = panels(store)
    items = traces(store, layout)
    names = {t.style.get("name") for t in items}
    assert {"min–max of 16 ranks", "median", "rank 13 (slowest)", "rank 0 (fastest)"} <= names
    assert not any(t.style.get("name") == "rank 5" for t in items), "the other ranks are in the band only"
    i = next(k for k, p in enumerate(layout) if p.key == "throughput/samples_per_s")
    band = {t.ident.rsplit(":", 1)[-1]: t.y for t in items if t.panel == i and t.ident.count(":") == 2}
    per_rank = np.array([store.series[("throughput/samples_per_s", r)].points()[1] for r in range(16)])
    np.testing.assert_allclose(band["low"], per_rank.min(axis=0))
    np.testing.assert_allclose(band["high"], per_rank.max(axis=0))
    np.testing.assert_allclose(band["median"], np.median(per_rank, axis=0))
    assert len(traces(_many(64), layout)) == len(items), "as many traces at 64 ranks as at 16"
    picked = {t.style.get("name") for t in traces(store, layout, picked=[5])}
    assert "rank 5 (picked)" in picked


def test_up_to_eight_ranks_every_rank_has_its_line():
    store = _many(8)
    names = {t.style.get("name") for t in traces(store, panels(store))}
    assert {f"rank {r}" for r in range(8)} <= names and "median" not in names


def test_the_spread_over_ranks_stays_bounded_keeps_extremes_and_does_not_wait_forever():
    from nbdist.widgets.spread import Spread

    spread = Spread(max_points=100)
    for step in range(100_000):
        for rank in range(4):
            spike = 50.0 if (step, rank) == (90_000, 2) else 0.0
            spread.add(float(step), 1.0 + rank + spike, rank, ranks=4)
    assert len(spread.x) <= 100 and max(spread.high) == 53.0 and min(spread.low) == 1.0
    assert spread.mid[0] == 2.5 and spread.sum[0] == 10.0

    store = MetricStore(ranks=2)
    for step in range(3):
        store.add(0, [{"step": step, "loss": 1.0, "only0": 5.0}])
        store.add(1, [{"step": step, "loss": 3.0}])
    assert store.spreads["loss"].mid == [2.0, 2.0, 2.0], "each step waits for both ranks"
    assert store.spreads["only0"].x[-2:] == [1.0, 2.0], "rank 0's own metric counts at once once rank 1 logs"

    stalled = Spread()
    for step in range(Spread.PENDING + 2):  # rank 1 died: its steps never come
        stalled.add(float(step), 1.0, 0, ranks=2)
    assert stalled.x[:2] == [0.0, 1.0], "a step waits at most PENDING later steps"


def test_a_metric_each_rank_samples_at_its_own_steps_is_banded_up_to_the_slowest_ranks_latest_sample():
    """Each rank's memory comes once a batch (engine/metrics.flush), at whatever step the rank is on, so no two
    ranks share a step. 16 ranks, each batch 7-13 steps long (rank 3's 5-10), memory
    growing by rank and step: the band goes on to the slowest rank's latest sample (it trailed the run by
    PENDING steps, with one rank's value in each), and at every step drawn its low, high, median and sum are
    those of each rank's latest value at or before that step (numpy, from every sample kept here)."""
    import numpy as np

    rng = random.Random(5)
    store = MetricStore(ranks=16)
    samples: dict[int, list[tuple[int, float]]] = {r: [] for r in range(16)}
    pos = dict.fromkeys(range(16), 0)
    for _ in range(25):
        for rank in rng.sample(range(16), 16):  # the batches arrive in no fixed order
            want = pos[rank] + (rng.randint(5, 10) if rank == 3 else rng.randint(7, 13))
            rows = [{"step": s, "loss": 1.0} for s in range(pos[rank] + 1, want + 1)]
            pos[rank] = want
            rows[-1]["memory/rss_MiB"] = 200.0 + rank + 0.1 * want
            samples[rank].append((want, rows[-1]["memory/rss_MiB"]))
            store.add(rank, rows)
    spread = store.spreads["memory/rss_MiB"]
    slowest = pos[3]
    assert spread.x[-1] >= slowest - 1, (spread.x[-1], slowest)  # it trailed the slowest rank
    assert len(spread.x) > 100
    for x, low, mid, high, total in list(zip(spread.x, spread.low, spread.mid, spread.high, spread.sum, strict=True))[::17]:
        latest = [max((s for s in samples[r] if s[0] <= x), default=None) for r in range(16)]
        values = np.array([v for _, v in filter(None, latest)])
        assert len(values) == 16 or x < 30, (x, len(values))  # from its first batch on, each rank counts
        np.testing.assert_allclose([low, mid, high, total],
                                   [values.min(), np.median(values), values.max(), values.sum()], rtol=1e-12)
    loss = store.spreads["loss"]  # a metric logged at every step is still counted step by step, by every rank
    assert loss.x[: slowest] == list(range(1, slowest + 1)) and set(loss.sum[: slowest]) == {16.0}


def test_a_metric_only_some_ranks_log_is_counted_as_soon_as_every_ranks_rows_pass_its_step():
    """16 ranks in batches of 7-13 steps (rank 12's 6-12) arriving in random order: every rank logs the loss, ranks
    0-7 a loss of their own (tensor-parallel rank 0 of each pair), rank 0 alone a validation figure every fifth
    step, and every rank an evaluation every tenth. Each is counted at every step it has, up to the step that the
    slowest rank's rows passed (its last batch holds neither of the first two), with the ranks that log it (numpy over the values logged there): the first
    evaluation with all 16 ranks, though each rank's first batch held none. (Those that only some ranks log waited for
    the others, who never log them, PENDING steps at every step, and trailed the run.)"""
    import numpy as np

    from nbdist.widgets.spread import Spread

    rng = random.Random(11)
    store = MetricStore(ranks=16)
    pos = dict.fromkeys(range(16), 0)
    logged: dict[str, dict[int, list[float]]] = {"tp0/loss": {}, "val": {}, "eval": {}}
    def batch(rank: int, want: int) -> None:
        rows = []
        for step in range(pos[rank] + 1, want + 1):
            row = {"step": step, "loss": 1.0 + 0.01 * rank}
            if rank < 8:
                row["tp0/loss"] = 2.0 + rank + 0.001 * step
            if rank == 0 and step % 5 == 0:
                row["val"] = 0.5 + 0.001 * step
            if step % 10 == 0:
                row["eval"] = 3.0 + rank * 0.1 + 0.001 * step
            for key in logged:
                if key in row:
                    logged[key].setdefault(step, []).append(row[key])
            rows.append(row)
        pos[rank] = want
        store.add(rank, rows)

    for _ in range(30):
        for rank in rng.sample(range(16), 16):
            batch(rank, pos[rank] + (rng.randint(6, 12) if rank == 12 else rng.randint(7, 13)))
    # the slowest rank, which logs neither rank 0's figure nor the tp0 loss, comes last, up to the others
    batch(12, min(p for r, p in pos.items() if r != 12))
    slowest = min(pos.values())
    # far enough that trailing by PENDING steps would show, and no rank so far ahead that PENDING counts without rank 5
    assert slowest > 3 * Spread.PENDING and max(pos.values()) - slowest < Spread.PENDING, pos
    for key, every, ranks in (("tp0/loss", 1, 8), ("val", 5, 1), ("eval", 10, 16), ("loss", 1, 16)):
        spread = store.spreads[key]
        assert spread.x == [float(x) for x in range(every, slowest + 1, every)], (key, spread.x[-3:], slowest)
        for x, low, mid, high, total in zip(spread.x, spread.low, spread.mid, spread.high, spread.sum, strict=True):
            values = np.array(logged.get(key, {}).get(int(x), [1.0 + 0.01 * r for r in range(16)]))
            assert len(values) == ranks, (key, x, len(values))
            np.testing.assert_allclose([low, mid, high, total],
                                       [values.min(), np.median(values), values.max(), values.sum()], rtol=1e-12)


def test_title_lines_fit_and_the_title_band_grows_with_them():
    """The headline is wrapped at ' · ' into lines of at most TITLE_CHARS; the states come under it,
    smaller; the top margin holds every line, the legend row and the panels' titles, and the legend
    starts below the title's last line (the browser test measures the drawn boxes)."""
    assert wrap(["a" * 10, "b" * 10, "c" * 60], width=25) == ["aaaaaaaaaa · bbbbbbbbbb", "c" * 60]
    board = Dashboard()
    board.update(0, _rows(0.02, 0, **{"comm/ratio": 48.0}))
    board.update(1, _rows(0.03, 1, **{"comm/ratio": 48.0}))
    plain = board.figure()
    fig = board.figure(states="ranks 0-14: idle · rank 15: failed")
    text = fig.layout.title.text
    lines = text.split("<br>")
    heads = wrap(headline_parts(board.store))
    assert len(heads) >= 2 and all(len(line) <= TITLE_CHARS for line in heads)  # 110+ characters in one line before
    assert lines[: len(heads)] == heads
    assert lines[-1] == "<span style='font-size:12px'>ranks 0-14: idle · rank 15: failed</span>"
    layout = fig.layout
    assert layout.title.yref == "container" and layout.title.yanchor == "top"
    title_px = TITLE_LINE_PX * len(lines)
    assert layout.margin.t >= TOP_PAD_PX + title_px + LEGEND_ROW_PX + 24  # 24: a panel's title
    legend_top_px = (1 - layout.legend.y) * layout.height
    assert legend_top_px >= TOP_PAD_PX + title_px  # under the title's last line
    assert layout.margin.t - plain.layout.margin.t == TITLE_LINE_PX  # one more line, one line's more room
    assert layout.height - layout.margin.t == plain.layout.height - plain.layout.margin.t  # the panels keep their size


def test_a_world_that_goes_on_with_fewer_ranks_keeps_the_lines_by_new_rank_and_marks_the_step():
    """Rank 1 lost at step 5: ranks 2 and 3 go on as 1 and 2; each later step waits for 3 ranks, not 4, and
    every panel over steps has a dotted line at step 5 saying '3 ranks'."""
    board = Dashboard(ranks=4)
    for step in range(6):
        for rank in range(4):
            board.update(rank, [{"step": step, "loss": 1.0 + rank, "throughput/samples_per_s": 100.0}])
    board.states = {0: "busy", 1: "dead", 2: "busy", 3: "busy"}
    board.resized({0: 0, 2: 1, 3: 2}, 5)
    for step in range(6, 9):
        for rank in range(3):
            board.update(rank, [{"step": step, "loss": 10.0 + rank, "throughput/samples_per_s": 100.0}])
    store = board.store
    assert store.ranks() == [0, 1, 2] and board.states == {0: "busy", 1: "busy", 2: "busy"}
    xs, ys = store.series[("loss", 1)].points()
    assert xs == [0, 1, 2, 3, 4, 5, 6, 7, 8] and ys[:6] == [3.0] * 6 and ys[6:] == [11.0] * 3  # old rank 2's line
    assert store.spreads["loss"].x[-1] == 8  # a step of the smaller world is counted once its 3 ranks logged
    xs, total = store.total("throughput/samples_per_s")
    assert (total[xs.index(5)], total[-1]) == (400.0, 300.0)  # the lost rank still counts where it was
    fig = board.figure()
    marks = [s for s in fig.layout.shapes if s.x0 == 5 and s.line.dash == "dot"]
    assert len(marks) == len([p for p in panels(store) if p.key != "split"]) >= 2
    assert all(a.text == "3 ranks" for a in fig.layout.annotations if a.x == 5)


def test_a_world_that_grows_waits_for_the_new_rank_each_step_and_marks_the_step():
    """3 ranks, then a grow at step 4 (each rank keeps its number, rank 3 joins): each later step is counted once
    the 4 ranks logged it, the new rank's line starts there, and every panel over steps says '4 ranks' at 4."""
    board = Dashboard(ranks=3)
    for step in range(4):
        for rank in range(3):
            board.update(rank, [{"step": step, "loss": 1.0 + rank, "throughput/samples_per_s": 100.0}])
    board.resized({r: r for r in range(4)}, 4)
    for step in range(4, 7):
        for rank in range(3):
            board.update(rank, [{"step": step, "loss": 1.0, "throughput/samples_per_s": 100.0}])
    store = board.store
    assert store.spreads["loss"].x[-1] == 3  # steps 4-6 wait for the fourth rank
    board.update(3, [{"step": s, "loss": 1.0, "throughput/samples_per_s": 100.0} for s in range(4, 7)])
    assert store.spreads["loss"].x[-1] == 6 and store.ranks() == [0, 1, 2, 3]
    assert store.series[("loss", 3)].points()[0] == [4, 5, 6]
    xs, total = store.total("throughput/samples_per_s")
    assert (total[xs.index(3)], total[-1]) == (300.0, 400.0)
    fig = board.figure()
    assert [a.text for a in fig.layout.annotations if a.x == 4] and all(
        a.text == "4 ranks" for a in fig.layout.annotations if a.x == 4
    )


def test_a_cells_kept_rows_stay_bounded_with_the_whole_run_and_the_last_steps_exact():
    from nbdist.cells.rows import EXACT_ROWS, KEPT_ROWS, KeptRows

    kept = KeptRows()
    for start in range(0, 1_000_000, 2_500):  # batches, as the ranks send them
        kept.add([{"step": s} for s in range(start, start + 2_500)])
        assert len(kept) <= KEPT_ROWS
    steps = [r["step"] for r in kept.rows()]
    assert steps[0] == 0 and steps[-EXACT_ROWS:] == list(range(1_000_000 - EXACT_ROWS, 1_000_000))
    older = steps[:-EXACT_ROWS]
    gaps = [b - a for a, b in zip(older, older[1:], strict=False)]
    # evenly thinned on a stride (the rows aged since the last thinning not yet), no hole wider than it
    assert set(gaps[: len(gaps) // 3]) == {kept.stride} and max(gaps) <= kept.stride
    assert len(older) > (KEPT_ROWS - EXACT_ROWS) // 2 and kept.stride <= 2 * 1_000_000 / ((KEPT_ROWS - EXACT_ROWS) // 2)
    short = KeptRows()
    short.add([{"t": 1.5, "step": s, "loss": 1.0 / (s + 1)} for s in range(KEPT_ROWS - 1)])
    short.add([{"t": 2.5, "step": None, "acc": 0.5}])
    rows = short.rows()  # a short cell keeps every row, as it came
    assert rows[:-1] == [{"t": 1.5, "step": s, "loss": 1.0 / (s + 1)} for s in range(KEPT_ROWS - 1)]
    assert rows[-1] == {"t": 2.5, "step": None, "acc": 0.5} and isinstance(rows[5]["step"], int)


def test_a_batch_a_rank_sends_is_bounded_with_its_last_rows_exact():
    from nbdist.engine.metrics import BATCH_EXACT, BATCH_ROWS, thinned

    few = [{"step": s} for s in range(BATCH_ROWS)]
    assert thinned(few) is few  # a loop at training speed: every row
    many = [{"step": s} for s in range(23_000)]  # a tight loop's 0.4 s
    sent = [r["step"] for r in thinned(many)]
    assert len(sent) <= BATCH_ROWS and sent[0] == 0 and sent[-BATCH_EXACT:] == list(range(22_000, 23_000))
    assert len({b - a for a, b in zip(sent[:-BATCH_EXACT], sent[1:-BATCH_EXACT], strict=False)}) == 1  # evenly


def test_memory_is_drawn_on_a_span_where_noise_is_not_growth_and_an_empty_panel_says_it_waits():
    """#51: a rank's memory moving by 1 MiB filled the whole panel (it looked like a leak); and before the first
    step the panels showed empty -1..1 axes."""
    from nbdist.widgets.figure import MEMORY_SPAN_MIB

    board = Dashboard()
    for rank, base in ((0, 199.6), (1, 200.4)):
        board.store.add(rank, [{"step": s, "memory/rss_MiB": base + s * 0.01} for s in range(20)])
    fig = board.figure()
    memory = next(a for a in fig.layout if a.startswith("yaxis") and fig.layout[a].range is not None)
    low, high = fig.layout[memory].range
    assert high - low == MEMORY_SPAN_MIB and low < 199.6 and high > 200.6, (low, high)

    empty = Dashboard().figure()
    texts = [a.text for a in empty.layout.annotations]
    assert "waiting for the first step" in texts, texts
    assert empty.layout.xaxis.visible is False and empty.layout.yaxis.visible is False


def test_nbdist_headline_is_the_dashboards_title_with_each_ranks_share():
    """``nbdist.headline(result)`` (notebook 06 prints it) says what the final figure's title says: each rank's
    share is the mean of its last RECENT steps, the world's the mean of the ranks'."""
    from types import SimpleNamespace

    import nbdist
    from nbdist.widgets.dashboard import headline_parts
    from nbdist.widgets.store import RECENT, MetricStore

    runs = {
        r: [{"step": s, "comm/overhead(%)": 90.0 if s < 10 else 40.0 + 10 * r, "time/step_s": 0.01} for s in range(50)]
        for r in range(2)
    }
    h = nbdist.headline(SimpleNamespace(metrics=runs))
    assert h["comm_pct_per_rank"] == {0: 40.0, 1: 50.0} and h["comm_pct"] == 45.0 and h["recent"] == RECENT == 20
    store = MetricStore(ranks=2)
    store.add_runs(runs)
    assert "45.0% of each step in communication" in headline_parts(store)


@pytest.mark.parametrize("sent, unit, drawn", [(2_000_000, "MB", 2.0), (3_200, "KB", 3.2), (96, "bytes", 96.0)])
def test_bytes_per_step_are_drawn_in_a_unit_that_shows_them(sent, unit, drawn):
    """A small model sends kilobytes a step: in MB its line lies flat on 0.00."""
    board = Dashboard()
    board.update(0, [{"step": s, "comm/bytes": float(sent), "time/step_s": 0.01} for s in range(5)])
    fig = board.figure()
    assert f"Sent per step, {unit}" in [a.text for a in fig.layout.annotations]
    assert any(t.y is not None and len(t.y) and max(t.y) == pytest.approx(drawn) for t in fig.data)


def test_a_step_splits_labels_lie_flat_or_are_hidden_never_turned_on_end():
    """A thin 'exposed comm' bar turned its label vertical, unreadable (#51): labels stay horizontal, and one that
    does not fit at the figure's smallest text size is hidden (layout.uniformtext)."""
    board = Dashboard()
    board.update(0, _rows(0.02, 0, data_s=0.001))
    fig = board.figure()
    bars = [t for t in fig.data if t.type == "bar"]
    assert bars and all(b.textangle == 0 and b.textposition == "inside" for b in bars)
    assert fig.layout.uniformtext.mode == "hide"


def test_a_step_over_its_forecast_is_said_and_the_forecast_is_drawn():
    """%%dist_fit --watch gives the dashboard the forecast by world size: a dashed line at the forecast step on the
    step split (and at the forecast peak where the memory panel shows the GPU's tensors), and the headline says when
    the slowest rank's step is more than 15% over it."""
    expect = {2: {"label": "fsdp", "step_s": 0.016, "peak_MiB": 150.0}}
    board = Dashboard(expect=expect)
    board.update(0, _rows(0.020, 0, **{"memory/gpu_MiB": 140.0}))
    board.update(1, _rows(0.020, 1, **{"memory/gpu_MiB": 145.0}))
    ratio, want = board.store.headline()["forecast"]
    assert ratio == pytest.approx(1.25) and want["label"] == "fsdp"
    assert "1.25x the forecast step (16 ms, fsdp)" in headline_parts(board.store)
    fig = board.figure()
    lines = {(s.type if hasattr(s, "type") else None, s.x0, s.y0) for s in fig.layout.shapes if s.line.dash == "dash"}
    assert any(x0 == pytest.approx(16.0) for _, x0, _ in lines), lines  # the step split: x is ms
    assert any(y0 == pytest.approx(150.0) for _, _, y0 in lines), lines  # the GPU memory panel
    near = MetricStore(expect={2: {"label": "ddp", "step_s": 0.019, "peak_MiB": None}})
    near.add(0, _rows(0.020, 0))
    near.add(1, _rows(0.020, 1))
    assert "forecast" not in near.headline()  # within 15%: nothing to say
    other = MetricStore(expect={4: {"label": "ddp", "step_s": 0.001, "peak_MiB": None}})
    other.add(0, _rows(0.020, 0))
    other.add(1, _rows(0.020, 1))
    assert "forecast" not in other.headline()  # a forecast for 4 ranks says nothing of a world of 2
