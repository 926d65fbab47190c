"""Dashboard arithmetic without a kernel: aggregation, decimation, overhead."""

from __future__ import annotations

import pytest

from nbdist.widgets.dashboard import Dashboard, MetricStore, Series


def test_series_decimates_to_a_bounded_size_and_keeps_the_whole_span():
    s = Series(max_points=100)
    for i in range(100_000):
        s.add(i, float(i))
    assert 50 <= len(s) <= 100
    assert s.xs[0] == 0 and s.xs[-1] > 99_000  # still spans the run
    gaps = {b - a for a, b in zip(s.xs, s.xs[1:], strict=False)}
    assert len(gaps) == 1  # evenly thinned


def test_store_keeps_series_per_rank_and_means_across_ranks():
    store = MetricStore()
    store.add(0, [{"t": 0, "step": i, "loss": 1.0 * i} for i in range(5)])
    store.add(1, [{"t": 0, "step": i, "loss": 3.0 * i, "lr": 0.1} for i in range(4)])
    assert store.keys() == ["loss", "lr"] and store.ranks() == [0, 1]
    xs, ys = store.mean("loss")
    assert xs == [0, 1, 2, 3] and ys == [0.0, 2.0, 4.0, 6.0]  # only steps both ranks logged
    assert store.last[("loss", 0)] == 4.0


def test_rows_without_a_step_are_numbered():
    store = MetricStore()
    store.add(0, [{"t": 0, "step": None, "x": 5.0}, {"t": 0, "step": None, "x": 6.0}])
    assert store.series[("x", 0)].xs == [0.0, 1.0]


def test_static_figure_has_a_trace_per_rank_and_the_mean():
    board = Dashboard()
    board.update(0, [{"t": 0, "step": i, "loss": 1.0} for i in range(3)])
    board.update(1, [{"t": 0, "step": i, "loss": 2.0} for i in range(3)])
    fig = board.figure()
    names = [t.name for t in fig.data]
    assert names == ["loss rank 0", "loss rank 1", "loss mean"]
    assert list(fig.data[2].y) == [1.5, 1.5, 1.5]


def test_log_outside_an_engine_keeps_rows_locally():
    from nbdist.engine import metrics

    metrics.log(step=1, loss=0.5)
    metrics.flush()
    assert metrics.local_rows()[-1]["loss"] == 0.5
    with pytest.raises(TypeError, match="is not a number"):
        metrics.log(step=2, loss="high")


def test_state_strip_shows_each_rank():
    board = Dashboard()
    board.set_state(1, "failed")
    board.set_state(0, "busy")
    html = board.strip_html()
    assert html.index("rank 0: busy") < html.index("rank 1: failed")
    assert "#c62828" in html  # failed is red


def test_panels_show_loss_throughput_overhead_and_bytes_with_the_compression_ratio():
    from nbdist.widgets.dashboard import panel_keys

    row = {
        "time/step_s": 0.02,
        "comm/time_s": 0.01,
        "comm/exposed_s": 0.01,
        "comm/overhead(%)": 50.0,
        "comm/bytes": 100.0,
        "comm/bytes_raw": 5000.0,
        "comm/ratio": 50.0,
        "throughput/samples_per_s": 3200.0,
    }
    store = MetricStore()
    for rank in (0, 1):
        store.add(rank, [{"step": i, "acc": 0.5, "loss": 1.0 / (i + 1), **row} for i in range(3)])
    keys = panel_keys(store.keys())
    assert keys == ["loss", "acc", "throughput/samples_per_s", "comm/overhead(%)", "comm/bytes"]
    # many user metrics: the automatic panels keep their places, the user's loss stays first
    many = panel_keys([f"m{i}" for i in range(9)] + ["val_loss", *row])
    assert many[0] == "val_loss" and many[-3:] == ["throughput/samples_per_s", "comm/overhead(%)", "comm/bytes"]
    assert len(many) == 6
    fig = Dashboard()
    fig.update(0, [])  # no rows yet: nothing breaks
    fig.store = store
    titles = [a.text for a in fig.figure().layout.annotations]
    assert "comm/bytes (compressed 50x)" in titles and titles[0] == "loss"


def test_gpu_memory_gets_a_panel_per_rank_and_a_cpu_rank_logs_none():
    from nbdist.engine import metrics
    from nbdist.widgets.dashboard import panel_keys

    store = MetricStore()
    for rank, mib in ((0, 100.0), (1, 300.0)):
        store.add(rank, [{"step": i, "loss": 1.0, "memory/gpu_MiB": mib + i} for i in range(3)])
    assert panel_keys(store.keys()) == ["loss", "memory/gpu_MiB"]
    board = Dashboard()
    board.store = store
    traces = {t.name: list(t.y) for t in board.figure().data}
    assert traces["memory/gpu_MiB rank 1"] == [300.0, 301.0, 302.0]
    assert traces["memory/gpu_MiB mean"] == [200.0, 201.0, 202.0]
    metrics.log(step=0, loss=1.0)  # this process never initialised CUDA: no GPU column
    metrics.flush()
    rows = metrics.local_rows()
    assert rows and "memory/gpu_MiB" not in rows[-1]


def test_the_live_figure_widget_can_be_built():
    """plotly's FigureWidget (the live dashboard) needs anywidget, which nbdist never imports
    itself: the dependency stays declared in pyproject.toml for this."""
    import plotly.graph_objects as go

    widget = go.FigureWidget()
    widget.add_scatter(x=[0, 1], y=[1.0, 0.5])
    assert len(widget.data) == 1
