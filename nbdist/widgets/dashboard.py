"""The live dashboard under a distributed cell: a headline of current numbers, then panels.

What someone watching a run wants, at a glance: one colour per rank in every panel and one
legend entry per rank; titles in words with units; a headline row (step, loss, samples/s in
total, communication share, the slowest rank and by how much, the compression ratio); each
rank's step split into compute, exposed communication and data wait, so a straggler or an
input-bound run shows; memory per rank.

``panels`` and ``traces`` are pure functions of a ``MetricStore`` (store.py): the static
figure (``Dashboard.figure``, ``%dist_dashboard``) and the live one are built from the same
trace list. Live, the plotly ``FigureWidget`` is built once and then only restyled with the
new points (numpy arrays, sent as binary buffers), rebuilt only when a panel or a rank
appears; every series is decimated to a bounded size (min/max per bucket), so a refresh
costs the same at step 100 and at step 100,000. When the cell ends the widget is replaced
by a static figure whose title carries the headline, so a saved notebook shows the final
state without widget state. Widgets read results; they never import torch.
"""

from __future__ import annotations

import html
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .store import MetricStore, Series

__all__ = ["Dashboard", "MetricStore", "Series", "Panel", "panels", "traces"]

# One colour per rank, the same in every panel (plotly's default sequence, then Dark24's first).
PALETTE = (
    "#636efa",
    "#ef553b",
    "#00cc96",
    "#ab63fa",
    "#ffa15a",
    "#19d3f3",
    "#ff6692",
    "#b6e880",
    "#ff97ff",
    "#fecb52",
    "#2e91e5",
    "#e15f99",
)
TOTAL_COLOUR = "#333333"
AUTO_PREFIXES = ("comm/", "time/", "throughput/", "memory/")
MAX_USER_PANELS = 3  # the user's own metrics (loss first); the automatic panels come after
PARTS = (("compute", ""), ("exposed comm", "/"), ("data wait", "."))  # the step split: name, bar pattern


def rank_colour(rank: int) -> str:
    return PALETTE[rank % len(PALETTE)]


@dataclass(frozen=True)
class Panel:
    """One subplot: what it draws (a metric key, or 'split' for the step bars) and how."""

    key: str
    title: str
    scale: float = 1.0  # multiply values by this (bytes -> MB)
    total: bool = False  # also draw the sum over ranks, dotted


@dataclass
class Trace:
    """One line or bar of the figure; ``ident`` stays the same while only its points change."""

    panel: int
    ident: str
    kind: str  # "line" or "bar"
    x: Any
    y: Any
    style: dict[str, Any] = field(default_factory=dict)


def _user_title(key: str) -> str:
    return "Loss" if key == "loss" else key


def panels(store: MetricStore) -> list[Panel]:
    """The panels this store fills: the user's metrics (loss first), then samples/s,
    communication share, the step split, bytes per step and memory, each when logged."""
    keys = set(store.keys())
    user = sorted((k for k in keys if not k.startswith(AUTO_PREFIXES)), key=lambda k: ("loss" not in k, k))
    out = [Panel(k, _user_title(k)) for k in user[:MAX_USER_PANELS]]
    if "throughput/samples_per_s" in keys:
        many = len(store.ranks()) > 1
        out.append(
            Panel("throughput/samples_per_s", "Samples/s per rank" + (" · total dotted" if many else ""), total=many)
        )
    if "comm/overhead(%)" in keys:
        out.append(Panel("comm/overhead(%)", "Communication, % of each step"))
    if "time/step_s" in keys:
        parts = "compute · comm ▨ · data ⋯" if "time/data_s" in keys else "compute · comm ▨"
        out.append(Panel("split", f"Step time, ms: {parts}"))
    if "comm/bytes" in keys:
        ratio = store.per_rank("comm/ratio")
        shrink = sum(ratio.values()) / len(ratio) if ratio else 1.0
        title = "Sent per step, MB" + (f" · compressed {shrink:.0f}x" if shrink > 1.5 else "")
        out.append(Panel("comm/bytes", title, scale=1e-6))
    if "memory/rss_MiB" in keys or "memory/gpu_MiB" in keys:
        both = "memory/rss_MiB" in keys and "memory/gpu_MiB" in keys
        what = "Memory per rank, MiB" if "memory/rss_MiB" in keys else "GPU memory per rank, MiB"
        out.append(Panel("memory", what + (" · GPU dashed" if both else "")))
    return out or [Panel("loss", "Loss")]


def traces(store: MetricStore, layout: list[Panel]) -> list[Trace]:
    """Every trace of the figure, in a stable order; the first of each rank carries its legend entry."""
    import numpy as np

    out: list[Trace] = []
    ranks = store.ranks()
    legend_done: set[int] = set()

    def style(rank: int, **extra: Any) -> dict[str, Any]:
        shown = rank not in legend_done
        legend_done.add(rank)
        return {"name": f"rank {rank}", "legendgroup": f"rank {rank}", "showlegend": shown, **extra}

    for i, panel in enumerate(layout):
        if panel.key == "split":
            split = store.split()
            for rank in ranks:
                parts = split.get(rank)
                if parts is None:
                    continue
                for (part, pattern), value in zip(PARTS, parts.values(), strict=True):
                    if part == "data wait" and "time/data_s" not in store.keys():
                        continue
                    look = style(rank, marker={"color": rank_colour(rank), "pattern": {"shape": pattern}})
                    look.update(
                        orientation="h",
                        hovertemplate=f"rank {rank} {part}: %{{x:.1f}} ms<extra></extra>",
                        texttemplate=f"{part} %{{x:.1f}}",
                        textposition="inside",
                    )
                    out.append(Trace(i, f"{i}:{rank}:{part}", "bar", np.array([value]), [f"rank {rank}"], look))
            continue
        keys = ["memory/rss_MiB", "memory/gpu_MiB"] if panel.key == "memory" else [panel.key]
        for key in keys:
            dash = "dash" if key == "memory/gpu_MiB" and panel.key == "memory" else None
            for rank in ranks:
                s = store.series.get((key, rank))
                if s is None:
                    continue
                xs, ys = s.points()
                line = {"color": rank_colour(rank), "width": 1.5, **({"dash": dash} if dash else {})}
                look = style(rank, line=line, mode="lines", hovertemplate=f"rank {rank}: %{{y:.4g}}<extra></extra>")
                y = np.asarray(ys, dtype=float) * panel.scale
                out.append(Trace(i, f"{i}:{key}:{rank}", "line", np.asarray(xs, dtype=float), y, look))
        if panel.total:
            xs, ys = store.total(panel.key)
            look = {
                "name": "total",
                "showlegend": False,
                "mode": "lines",
                "line": {"color": TOTAL_COLOUR, "dash": "dot", "width": 1.5},
                "hovertemplate": "all ranks: %{y:.4g}<extra></extra>",
            }
            out.append(Trace(i, f"{i}:total", "line", np.asarray(xs, dtype=float), np.asarray(ys, dtype=float), look))
    return out


def headline_items(store: MetricStore) -> list[tuple[str, str, str]]:
    """(name, value, label) for the headline row, in reading order."""
    h = store.headline()
    out = []
    if "step" in h:
        out.append(("step", f"{h['step']:,}", "step"))
    if "loss" in h:
        key, value = h["loss"]
        out.append(("loss", f"{value:.4g}", key if key != "loss" else "loss (mean of ranks)"))
    if "samples_per_s" in h:
        out.append(("samples_per_s", f"{h['samples_per_s']:,.0f}", "samples/s, all ranks"))
    if "comm_pct" in h:
        out.append(("comm_pct", f"{h['comm_pct']:.1f}%", "of each step in communication"))
    if "slowest" in h:
        rank, pct = h["slowest"]
        value, label = (
            ("even", "ranks within 3% of each other") if pct < 3 else (f"rank {rank}", f"slowest, +{pct:.0f}%")
        )
        out.append(("slowest", value, label))
    if "ratio" in h and h["ratio"] > 1.5:
        out.append(("ratio", f"{h['ratio']:.0f}x", "fewer bytes (compression)"))
    return out


def headline_text(store: MetricStore) -> str:
    """The headline as one line (the static figure's title)."""
    return " · ".join(f"{label} {value}" for _, value, label in headline_items(store))


def _figure(layout: list[Panel], items: list[Trace], widget: bool, title: str = "") -> Any:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    cols = 1 if len(layout) == 1 else 2 if len(layout) in (2, 4) else 3
    rows = -(-len(layout) // cols)
    fig = make_subplots(
        rows=rows, cols=cols, subplot_titles=[p.title for p in layout], vertical_spacing=0.16 if rows > 1 else 0.1
    )
    for t in items:
        row, col = t.panel // cols + 1, t.panel % cols + 1
        if t.kind == "bar":
            fig.add_trace(go.Bar(x=t.x, y=t.y, **t.style), row=row, col=col)
        else:
            fig.add_trace(go.Scatter(x=t.x, y=t.y, **t.style), row=row, col=col)
    for i, panel in enumerate(layout):
        row, col = i // cols + 1, i % cols + 1
        if panel.key == "split":
            fig.update_yaxes(autorange="reversed", row=row, col=col)
        else:
            fig.update_xaxes(title_text="step", title_standoff=2, row=row, col=col)
    fig.update_annotations(font_size=13)
    fig.update_layout(
        height=250 * rows + 60,
        margin={"t": 70, "b": 30, "l": 50, "r": 20},
        barmode="stack",
        uniformtext={"mode": "hide", "minsize": 9},
        legend={"orientation": "h", "x": 1.0, "xanchor": "right", "y": 1.0, "yanchor": "top", "yref": "container"},
        hovermode="closest",
        template="plotly_white",
    )
    if title:
        fig.update_layout(title={"text": title, "font": {"size": 15}, "x": 0.01, "y": 0.99, "yanchor": "top"})
    return go.FigureWidget(fig) if widget else fig


def _plain(v: Any) -> Any:
    return v.item() if hasattr(v, "item") else v


def _identity(layout: list[Panel], items: list[Trace]) -> tuple:
    return tuple(p.title.split(" · compressed")[0] for p in layout), tuple(t.ident for t in items)


class Dashboard:
    """Plots what the ranks log, live. Feed it with ``update(rank, rows)``."""

    def __init__(self, max_points: int = 1000, refresh_s: float = 0.3) -> None:
        self.store = MetricStore(max_points)
        self.refresh_s = refresh_s
        self.renders = 0
        self.rebuilds = 0
        self.render_s = 0.0  # the last refresh's cost: refreshes are spaced to keep the kernel free
        self.states: dict[int, str] = {}
        self._last = 0.0
        self._shape: tuple = ()
        self._titles: list[str] = []
        self._handle: Any = None
        self._widget: Any = None
        self._box: Any = None
        self._head: Any = None

    def set_state(self, rank: int, state: str) -> None:  # a RankState
        """idle / busy / failed / dead for one rank, shown in the headline."""
        self.states[rank] = state
        if self._head is not None:
            self._head.value = self.headline_html()

    def strip_html(self) -> str:
        """Each rank's state as a badge in its colour's row."""
        from . import STATE_COLOURS

        badges = []
        for rank in sorted(self.states):
            state = self.states[rank]
            colour = STATE_COLOURS.get(state, "#555")
            badges.append(
                f'<span class="nbdist-rank" style="border-left:6px solid {rank_colour(rank)};background:{colour};'
                f'color:white;padding:1px 8px;margin-right:6px;border-radius:3px">rank {rank}: {state}</span>'
            )
        return '<div class="nbdist-ranks" style="margin-top:4px">' + "".join(badges) + "</div>"

    def headline_html(self) -> str:
        cards = "".join(
            f'<div class="nbdist-stat" data-name="{name}" style="min-width:90px">'
            f'<div class="nbdist-value" style="font-size:20px;font-weight:600;line-height:1.2">{html.escape(value)}</div>'
            f'<div style="font-size:11px;color:#666">{html.escape(label)}</div></div>'
            for name, value, label in headline_items(self.store)
        )
        row = f'<div class="nbdist-headline" style="display:flex;gap:22px;flex-wrap:wrap">{cards}</div>'
        return row + self.strip_html()

    def update(self, rank: int, rows: list[dict[str, Any]]) -> None:
        self.store.add(rank, rows)
        now = time.monotonic()
        # at most every refresh_s, and no more than a tenth of the time on drawing (up to 2 s apart)
        if now - self._last >= max(self.refresh_s, min(10 * self.render_s, 2.0)):
            self._last = now
            self.render()

    def figure(self) -> Any:
        """A static plotly figure of everything so far, its title the headline. Plain lists, not
        numpy arrays: every renderer of a saved notebook reads them."""
        layout = panels(self.store)
        items = traces(self.store, layout)
        for t in items:
            t.x, t.y = list(map(_plain, t.x)), list(map(_plain, t.y))
        return _figure(layout, items, widget=False, title=headline_text(self.store))

    def render(self) -> None:
        """Bring the live view up to date: new points into the existing traces; a rebuild only
        when a panel or a trace appeared."""
        if self._handle is None:
            return
        tic = time.perf_counter()
        self.refresh()
        self._head.value = self.headline_html()
        self.renders += 1
        self.render_s = time.perf_counter() - tic

    def refresh(self) -> None:
        """The figure part of ``render`` (the benchmark times it on its own)."""
        layout = panels(self.store)
        items = traces(self.store, layout)
        shape = _identity(layout, items)
        if self._widget is None or shape != self._shape:
            self._shape = shape
            self._widget = _figure(layout, items, widget=True)
            self._titles = [p.title for p in layout]
            self.rebuilds += 1
            if self._box is not None:
                self._box.children = (self._head, self._widget)
            return
        with self._widget.batch_update():
            for live, new in zip(self._widget.data, items, strict=True):
                live.x, live.y = new.x, new.y
            titles = [p.title for p in layout]
            if titles != self._titles:  # the compression ratio moved
                for note, text in zip(self._widget.layout.annotations, titles, strict=False):
                    note.text = text
                self._titles = titles

    @property
    def live_figure(self) -> Any:
        """The live plotly FigureWidget (None before the first refresh and after ``close``)."""
        return self._widget

    @property
    def headline_widget(self) -> Any:
        """The live headline (an ipywidgets.HTML) while shown, else None."""
        return self._head

    def show(self, display: Callable[..., Any] | None = None) -> None:
        """Display in the notebook (live while the cell runs); ``display``: IPython's, unless given."""
        import ipywidgets
        from IPython.display import display as ipython_display

        self._head = ipywidgets.HTML(self.headline_html())
        self.refresh()
        self._box = ipywidgets.VBox([self._head, self._widget])
        self._handle = (display or ipython_display)(self._box, display_id=True)

    def close(self) -> None:
        """Replace the live widget by a static figure of the final state."""
        if self._handle is not None:
            fig = self.figure()
            if self.states:
                states = " · ".join(f"rank {r}: {st}" for r, st in sorted(self.states.items()))
                fig.update_layout(
                    title_text=f"{fig.layout.title.text or ''}<br><span style='font-size:12px'>{states}</span>"
                )
            # a raw bundle: a plotly Figure's own display would add a new output instead of replacing;
            # through plotly's JSON, which encodes the numpy arrays
            bundle = {"application/vnd.plotly.v1+json": json.loads(fig.to_json()), "text/plain": "nbdist dashboard"}
            self._handle.update(bundle, raw=True)
            self._handle = None
            self._widget = self._box = self._head = None
