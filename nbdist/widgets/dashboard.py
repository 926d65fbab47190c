"""Live metrics while a distributed cell runs: per-rank series, decimated, plotted with plotly.

``MetricStore`` is plain Python (aggregation, decimation, overhead arithmetic) and is what
the tests check. ``Dashboard`` draws it in a plotly ``FigureWidget`` at most ``refresh_s``
apart and, when the cell ends, replaces itself with a static figure, so a notebook
saved or converted without a live kernel still shows the final state and carries no
widget state. Widgets read results; they never import torch.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

SKIP = {"t", "step"}


class Series:
    """(x, y) points that keep at most ``max_points``: past that, every other point is
    dropped and later points are thinned at the same stride, so a 100k-step run stays
    small and still spans the whole run."""

    __slots__ = ("xs", "ys", "max_points", "stride", "_skipped")

    def __init__(self, max_points: int = 2000) -> None:
        self.xs: list[float] = []
        self.ys: list[float] = []
        self.max_points = max_points
        self.stride = 1
        self._skipped = 0

    def add(self, x: float, y: float) -> None:
        if self._skipped < self.stride - 1:
            self._skipped += 1
            return
        self._skipped = 0
        self.xs.append(x)
        self.ys.append(y)
        if len(self.xs) > self.max_points:
            self.xs, self.ys = self.xs[::2], self.ys[::2]
            self.stride *= 2

    def __len__(self) -> int:
        return len(self.xs)


class MetricStore:
    """Every metric logged by every rank, as series keyed by (metric, rank)."""

    def __init__(self, max_points: int = 2000) -> None:
        self.max_points = max_points
        self.series: dict[tuple[str, int], Series] = {}
        self.last: dict[tuple[str, int], float] = {}
        self.counts: dict[int, int] = {}

    def add(self, rank: int, rows: Iterable[dict[str, Any]]) -> None:
        for row in rows:
            n = self.counts.get(rank, 0)
            self.counts[rank] = n + 1
            x = float(row["step"]) if row.get("step") is not None else float(n)
            for key, value in row.items():
                if key in SKIP:
                    continue
                s = self.series.get((key, rank))
                if s is None:
                    s = self.series[(key, rank)] = Series(self.max_points)
                s.add(x, float(value))
                self.last[(key, rank)] = float(value)

    def keys(self) -> list[str]:
        return sorted({k for k, _ in self.series})

    def ranks(self) -> list[int]:
        return sorted({r for _, r in self.series})

    def mean(self, key: str) -> tuple[list[float], list[float]]:
        """The mean over ranks at every x that all ranks have logged."""
        per = [self.series[(key, r)] for r in self.ranks() if (key, r) in self.series]
        if not per:
            return [], []
        common = set(per[0].xs)
        for s in per[1:]:
            common &= set(s.xs)
        xs = sorted(common)
        maps = [dict(zip(s.xs, s.ys, strict=True)) for s in per]
        return xs, [sum(m[x] for m in maps) / len(maps) for x in xs]


# Metrics that apply_ddp logs by itself: three get a panel, the rest are in RunResult.metrics.
AUTO_PANELS = ("throughput/samples_per_s", "comm/overhead(%)", "comm/bytes", "memory/gpu_MiB")
AUTO_PREFIXES = ("comm/", "time/", "throughput/", "memory/")
MAX_PANELS = 6


def panel_keys(keys: list[str]) -> list[str]:
    """Which metrics get a panel: the user's own (loss first), then throughput,
    communication overhead, bytes per step and GPU memory per rank; at most MAX_PANELS."""
    auto = [k for k in AUTO_PANELS if k in keys]
    user = sorted((k for k in keys if not k.startswith(AUTO_PREFIXES)), key=lambda k: ("loss" not in k, k))
    return user[: MAX_PANELS - len(auto)] + auto


def _title(store: MetricStore, key: str) -> str:
    if key == "comm/bytes" and any(k == "comm/ratio" for k, _ in store.last):
        ratios = [v for (k, _), v in store.last.items() if k == "comm/ratio"]
        return f"comm/bytes (compressed {sum(ratios) / len(ratios):.0f}x)"
    return key


def _figure(store: MetricStore, widget: bool) -> Any:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    keys = panel_keys(store.keys()) or ["loss"]
    cols = 2 if len(keys) == 4 else min(3, len(keys))
    rows = -(-len(keys) // cols)
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=[_title(store, k) for k in keys])
    for i, key in enumerate(keys):
        row, col = i // cols + 1, i % cols + 1
        for rank in store.ranks():
            s = store.series.get((key, rank))
            if s is not None:
                fig.add_scatter(x=s.xs, y=s.ys, name=f"{key} rank {rank}", mode="lines", row=row, col=col)
        if len(store.ranks()) > 1:
            xs, ys = store.mean(key)
            fig.add_scatter(x=xs, y=ys, name=f"{key} mean", mode="lines", line={"dash": "dot"}, row=row, col=col)
    fig.update_layout(height=300 * rows, margin={"t": 80, "b": 30}, showlegend=True)
    return go.FigureWidget(fig) if widget else fig


class Dashboard:
    """Plots what the ranks log, live. Feed it with ``update(rank, rows)``."""

    def __init__(self, max_points: int = 2000, refresh_s: float = 0.2) -> None:
        self.store = MetricStore(max_points)
        self.refresh_s = refresh_s
        self.renders = 0
        self.states: dict[int, str] = {}
        self._last = 0.0
        self._handle: Any = None
        self._widget: Any = None
        self._box: Any = None
        self._strip: Any = None

    def set_state(self, rank: int, state: str) -> None:  # a RankState
        """idle / busy / failed / dead for one rank, shown in the strip above the plots."""
        self.states[rank] = state
        if self._strip is not None:
            self._strip.value = self.strip_html()

    def strip_html(self) -> str:
        from . import STATE_COLOURS

        badges = []
        for rank in sorted(self.states):
            state = self.states[rank]
            colour = STATE_COLOURS.get(state, "#555")
            badges.append(
                f'<span style="background:{colour};color:white;padding:2px 8px;margin-right:6px;'
                f'border-radius:4px">rank {rank}: {state}</span>'
            )
        return '<div class="nbdist-ranks">' + "".join(badges) + "</div>"

    def update(self, rank: int, rows: list[dict[str, Any]]) -> None:
        self.store.add(rank, rows)
        now = time.monotonic()
        if now - self._last >= self.refresh_s:
            self._last = now
            self.render()

    def figure(self) -> Any:
        """A static plotly figure of everything so far."""
        return _figure(self.store, widget=False)

    def render(self) -> None:
        if self._handle is None:
            return
        fig = _figure(self.store, widget=False)
        if self._widget is None or len(self._widget.data) != len(fig.data):
            self._widget = _figure(self.store, widget=True)
            self._box.children = (self._strip, self._widget)
        else:
            with self._widget.batch_update():
                for live, new in zip(self._widget.data, fig.data, strict=True):
                    live.x, live.y = new.x, new.y
        self.renders += 1

    def show(self) -> None:
        """Display in the notebook (live while the cell runs)."""
        import ipywidgets
        from IPython.display import display

        self._widget = _figure(self.store, widget=True)
        self._strip = ipywidgets.HTML(self.strip_html())
        self._box = ipywidgets.VBox([self._strip, self._widget])
        self._handle = display(self._box, display_id=True)

    def close(self) -> None:
        """Replace the live widget by a static figure of the final state."""
        if self._handle is not None:
            fig = self.figure()
            if self.states:
                fig.update_layout(title=" · ".join(f"rank {r}: {st}" for r, st in sorted(self.states.items())))
            # a raw bundle: a plotly Figure's own display would add a new output instead of replacing
            bundle = {"application/vnd.plotly.v1+json": fig.to_plotly_json(), "text/plain": "nbdist dashboard"}
            self._handle.update(bundle, raw=True)
            self._handle = None
            self._widget = self._box = self._strip = None
