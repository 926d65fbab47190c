"""Dashboard refresh cost on a long run: 2 ranks x 100k steps of apply_ddp's metrics and a loss.

nbdist: the live FigureWidget is built once; each refresh restyles its traces with the
decimated points (min/max buckets, at most ~1000 per series) as numpy arrays.
Alternatives measured in the same run, on the same store:
- rebuild: a new figure every refresh (make_subplots + every trace), from the same
  decimated points (what the dashboard did before: it built a whole figure to compare);
  ten new steps per rank arrive (untimed) before each timed restyle, as in a running cell;
- naive: a new figure every refresh with every logged point (no decimation).
Reported: milliseconds per refresh (median of N) and what one refresh hands to the
frontend (MB of point data), at 1k, 10k and 100k steps. JSON under results/.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from _common import save

STEPS = (1_000, 10_000, 100_000)


def rows_for(rank: int, start: int, stop: int, rng: np.random.Generator) -> list[dict]:
    out = []
    for i in range(start, stop):
        step_s = 0.02 + 0.002 * rng.random() + 0.002 * rank
        out.append(
            {
                "t": 0.0,
                "step": i,
                "loss": 2.0 / (1 + i / 1000) + 0.05 * rng.random(),
                "time/step_s": step_s,
                "time/data_s": 0.001,
                "comm/time_s": step_s / 4,
                "comm/exposed_s": step_s / 10,
                "comm/overhead(%)": 25.0,
                "comm/bytes": 546_856.0,
                "throughput/samples_per_s": 64 / step_s,
                **({"memory/rss_MiB": 340.0 + rank} if i % 10 == 9 else {}),
            }
        )
    return out


def timed(fn, reps: int, before=None) -> float:
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


class Arrivals:
    """What arrives between two refreshes of a running cell: ten steps per rank (not timed)."""

    def __init__(self, board, start: int, rng: np.random.Generator) -> None:
        self.board, self.next, self.rng = board, start, rng

    def __call__(self) -> None:
        for rank in self.board.store.ranks():
            self.board.store.add(rank, rows_for(rank, self.next, self.next + 10, self.rng))
        self.next += 10


def naive_figure(raw: dict[int, list[dict]]):
    """Every logged point, a new figure."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    keys = ["loss", "throughput/samples_per_s", "comm/overhead(%)", "comm/bytes", "memory/rss_MiB"]
    fig = make_subplots(rows=2, cols=3, subplot_titles=keys)
    for i, key in enumerate(keys):
        for rows in raw.values():
            pts = [(r["step"], r[key]) for r in rows if key in r]
            xs, ys = zip(*pts, strict=True)
            fig.add_scatter(x=np.array(xs, float), y=np.array(ys), row=i // 3 + 1, col=i % 3 + 1)
    return go.FigureWidget(fig)


def payload_mb(fig) -> float:
    return sum(np.asarray(t.x).nbytes + np.asarray(t.y).nbytes for t in fig.data if t.x is not None) / 1e6


def main() -> None:
    from nbdist.widgets.dashboard import Dashboard, panels, traces
    from nbdist.widgets.figure import build_figure

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("-n", "--reps", type=int, default=7)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    board = Dashboard()
    raw: dict[int, list[dict]] = {0: [], 1: []}
    done = 0
    out: dict[str, dict] = {}
    for steps in STEPS:
        tic = time.perf_counter()
        for rank in (0, 1):
            new = rows_for(rank, done, steps, rng)
            raw[rank].extend(new)
            board.store.add(rank, new)
        ingest_us = (time.perf_counter() - tic) / (2 * (steps - done)) * 1e6
        done = steps
        board.refresh()  # the first (building) refresh is not what a running cell pays
        restyle = timed(board.refresh, args.reps, before=Arrivals(board, steps, rng))
        points_mb = payload_mb(board.live_figure)

        def rebuild() -> None:
            layout = panels(board.store)
            build_figure(layout, traces(board.store, layout), widget=True)

        rebuild_s = timed(rebuild, args.reps)
        naive_s = timed(lambda: naive_figure(raw), max(1, args.reps // 3))
        naive_mb = payload_mb(naive_figure(raw))
        longest = max(len(t.x) for t in board.live_figure.data if t.x is not None)
        out[str(steps)] = {
            "restyle_ms": restyle * 1e3,
            "rebuild_ms": rebuild_s * 1e3,
            "naive_ms": naive_s * 1e3,
            "restyle_payload_MB": points_mb,
            "naive_payload_MB": naive_mb,
            "longest_trace_points": longest,
            "ingest_us_per_row": ingest_us,
        }
        print(
            f"{steps:>7,} steps: refresh {restyle * 1e3:6.1f} ms (restyle, {points_mb:.2f} MB, <= {longest} points "
            f"per trace) | rebuild {rebuild_s * 1e3:6.1f} ms | naive every point {naive_s * 1e3:7.1f} ms "
            f"({naive_mb:.1f} MB) | ingest {ingest_us:.1f} us/row",
            flush=True,
        )
    print(
        "at 100k steps the refresh costs "
        f"{out['100000']['restyle_ms']:.1f} ms, {out['100000']['naive_ms'] / out['100000']['restyle_ms']:.0f}x less "
        "than redrawing every point"
    )
    by_ranks = ranks_sweep(args.reps, rng)
    save("dashboard", {"steps": out, "ranks": by_ranks, "reps": args.reps})


def ranks_sweep(reps: int, rng: np.random.Generator, steps: int = 10_000) -> dict[str, dict]:
    """The refresh at 2, 16 and 64 ranks of synthetic metrics (10k steps each): above 8 ranks a panel
    draws the spread and the ranks that stand out, so what a refresh sends stays flat. Measured beside
    it: the same store drawn one line per rank (what the dashboard did at every size before)."""
    from nbdist.widgets import figure
    from nbdist.widgets.dashboard import Dashboard

    out = {}
    for n in (2, 16, 64):
        board = Dashboard(ranks=n)
        board.store.add_runs({rank: rows_for(rank, 0, steps, rng) for rank in range(n)})
        board.refresh()
        restyle = timed(board.refresh, reps, before=Arrivals(board, steps, rng))
        sent = payload_mb(board.live_figure)
        traces_n = len(board.live_figure.data)
        band_above, figure.BAND_ABOVE = figure.BAND_ABOVE, 10**9  # every rank its own line
        try:
            flat = Dashboard()
            flat.store = board.store
            flat.refresh()
            per_rank = timed(flat.refresh, reps, before=Arrivals(flat, steps + 10 * reps, rng))
            per_rank_sent, per_rank_traces = payload_mb(flat.live_figure), len(flat.live_figure.data)
        finally:
            figure.BAND_ABOVE = band_above
        out[str(n)] = {
            "refresh_ms": restyle * 1e3,
            "payload_MB": sent,
            "traces": traces_n,
            "one_line_per_rank_refresh_ms": per_rank * 1e3,
            "one_line_per_rank_payload_MB": per_rank_sent,
            "one_line_per_rank_traces": per_rank_traces,
        }
        print(
            f"{n:>2} ranks: refresh {restyle * 1e3:6.1f} ms, {sent:.2f} MB, {traces_n} traces | one line per rank: "
            f"{per_rank * 1e3:6.1f} ms, {per_rank_sent:.2f} MB, {per_rank_traces} traces",
            flush=True,
        )
    return out


if __name__ == "__main__":
    main()
