"""The dashboard's figure, as pure functions of a ``MetricStore``: which panels, which traces, one
plotly figure. ``dashboard.py`` draws it live and keeps it up to date.

Up to ``BAND_ABOVE`` ranks, one colour and one legend entry per rank in every panel. Above, a
panel of 64 lines reads as noise: it shows the spread over ranks (a min-max band and the median)
with the slowest and the fastest rank (by step time) and any ranks picked drawn one by one; the
step split shows those ranks only. The traces sent stay as many at 64 ranks as at 9.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .store import TIMED, MetricStore

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
BAND_ABOVE = 8  # ranks: up to this many, one line per rank; above, the spread and the ranks that stand out
BAND_COLOUR = "rgba(99, 110, 250, 0.18)"
MEDIAN_COLOUR = "#3949ab"
AUTO_PREFIXES = ("comm/", "time/", "throughput/", "memory/", TIMED)  # not the user's: no panel of their own
MAX_USER_PANELS = 3  # the user's own metrics (loss first); the automatic panels come after
MEMORY_SPAN_MIB = 64  # the memory panel shows at least this range: a rank's few MiB of noise is not growth
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
        unit, scale = _bytes_unit(max((v for (k, _), v in store.last.items() if k == "comm/bytes"), default=0.0))
        title = f"Sent per step, {unit}" + (f" · compressed {shrink:.0f}x" if shrink > 1.5 else "")
        out.append(Panel("comm/bytes", title, scale=scale))
    if "memory/rss_MiB" in keys or "memory/gpu_MiB" in keys:
        both = "memory/rss_MiB" in keys and "memory/gpu_MiB" in keys
        what = "Memory per rank, MiB" if "memory/rss_MiB" in keys else "GPU memory per rank, MiB"
        out.append(Panel("memory", what + (" · GPU dashed" if both else "")))
    return out or [Panel("loss", "Loss")]


def _bytes_unit(most: float) -> tuple[str, float]:
    """The unit a person reads bytes per step in: a small model's 3 KB is not a flat line at 0.00 MB."""
    for unit, size in (("MB", 1e6), ("KB", 1e3)):
        if most >= size:
            return unit, 1 / size
    return "bytes", 1.0


def named_ranks(store: MetricStore, picked: Sequence[int] = ()) -> dict[int, str]:
    """The ranks drawn one by one above BAND_ABOVE ranks: the slowest and the fastest (by step time),
    then the ranks picked, each with its label."""
    out: dict[int, str] = {}
    step = store.per_rank("time/step_s")
    if len(step) > 1:
        out[max(step, key=lambda r: (step[r], -r))] = "slowest"
        out.setdefault(min(step, key=lambda r: (step[r], r)), "fastest")
    for rank in picked:
        out.setdefault(rank, "picked")
    return {rank: f"rank {rank} ({why})" for rank, why in out.items() if rank in store.ranks()}


def _spread(store: MetricStore, key: str) -> tuple[Any, Any, Any, Any] | None:
    """x, and the lowest, median and highest value over ranks at each x (``MetricStore.spreads``, kept
    as the rows arrived: drawing it does not grow with the number of ranks); None when nothing is counted."""
    import numpy as np

    spread = store.spreads.get(key)
    if spread is None or not spread.x:
        return None
    return np.asarray(spread.x), np.asarray(spread.low), np.asarray(spread.mid), np.asarray(spread.high)


def traces(store: MetricStore, layout: list[Panel], picked: Sequence[int] = ()) -> list[Trace]:
    """Every trace of the figure, in a stable order; the first of each rank carries its legend entry.
    Above BAND_ABOVE ranks each line panel is the spread over ranks (min-max band and median) with the
    slowest, the fastest and the picked ranks drawn one by one; the step split shows those ranks only."""
    import numpy as np

    out: list[Trace] = []
    ranks = store.ranks()
    band = len(ranks) > BAND_ABOVE
    named = named_ranks(store, picked) if band else {}
    drawn = list(named) if band else ranks
    legend_done: set[Any] = set()

    def style(rank: Any, **extra: Any) -> dict[str, Any]:
        shown = rank not in legend_done
        legend_done.add(rank)
        name = named.get(rank, f"rank {rank}") if isinstance(rank, int) else str(rank)
        return {"name": name, "legendgroup": name, "showlegend": shown, **extra}

    for i, panel in enumerate(layout):
        if panel.key == "split":
            split = store.split()
            for rank in drawn:
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
                        textangle=0,  # a thin bar hides its label (uniformtext), never turns it on end
                    )
                    out.append(Trace(i, f"{i}:{rank}:{part}", "bar", np.array([value]), [f"rank {rank}"], look))
            continue
        keys = ["memory/rss_MiB", "memory/gpu_MiB"] if panel.key == "memory" else [panel.key]
        for key in keys:
            dash = "dash" if key == "memory/gpu_MiB" and panel.key == "memory" else None
            if band:
                out += _band(i, key, store, panel.scale, style, dash)
            for rank in drawn:
                s = store.series.get((key, rank))
                if s is None:
                    continue
                xs, ys = s.points()
                line = {"color": rank_colour(rank), "width": 1.5, **({"dash": dash} if dash else {})}
                look = style(rank, line=line, mode="lines", hovertemplate=f"rank {rank}: %{{y:.4g}}<extra></extra>")
                y = np.asarray(ys, dtype=float) * panel.scale
                out.append(Trace(i, f"{i}:{key}:{rank}", "line", np.asarray(xs, dtype=float), y, look))
        if panel.total:
            xs, ys = store.total(panel.key) if not band else _spread_total(store, panel.key)
            look = {
                "name": "total",
                "showlegend": False,
                "mode": "lines",
                "line": {"color": TOTAL_COLOUR, "dash": "dot", "width": 1.5},
                "hovertemplate": "all ranks: %{y:.4g}<extra></extra>",
            }
            out.append(Trace(i, f"{i}:total", "line", np.asarray(xs, dtype=float), np.asarray(ys, dtype=float), look))
    return out


def _spread_total(store: MetricStore, key: str) -> tuple[Any, Any]:
    spread = store.spreads.get(key)
    return (spread.x, spread.sum) if spread is not None else ([], [])


def _band(
    i: int, key: str, store: MetricStore, scale: float, style: Callable[..., dict[str, Any]], dash: str | None
) -> list[Trace]:
    """The spread of one metric over every rank: a min-max band and the median line."""
    found = _spread(store, key)
    if found is None:
        return []
    x, low, median, high = found
    n = len(store.ranks())
    edge = {"color": "rgba(0,0,0,0)", "width": 0}
    hi_look = style(
        f"min–max of {n} ranks", line=edge, mode="lines", fill="tonexty", fillcolor=BAND_COLOUR, hoverinfo="skip"
    )
    med_line = {"color": MEDIAN_COLOUR, "width": 1.5, **({"dash": dash} if dash else {})}
    return [
        Trace(i, f"{i}:{key}:low", "line", x, low * scale, {"showlegend": False, "line": edge, "mode": "lines",
                                                             "hoverinfo": "skip", "name": "min"}),
        Trace(i, f"{i}:{key}:high", "line", x, high * scale, hi_look),
        Trace(i, f"{i}:{key}:median", "line", x, median * scale, style(
            "median", line=med_line, mode="lines", hovertemplate="median of ranks: %{y:.4g}<extra></extra>")),
    ]


TITLE_FONT_PX = 15
TITLE_LINE_PX = 20  # plotly spaces a title's lines at 1.3 times its font size
TITLE_CHARS = 72  # a line of the title, about 540 px: it fits the narrowest notebook output (Notebook 7 at 1024 px)
TOP_PAD_PX = 8
LEGEND_ROW_PX = 24
SUBPLOT_TITLE_PX = 30


def _title_overshoot_px(lines: int) -> int:
    """How far above its anchor plotly (6, measured in Chromium by tests/browser) draws the top of a
    title anchored at its top: a few pixels for one line, about a font size more for several (it
    anchors the first line as if it were the middle of a two-line block)."""
    return 4 if lines == 1 else TITLE_FONT_PX + 1


def wrap(parts: Sequence[str], width: int = TITLE_CHARS, sep: str = " · ") -> list[str]:
    """Parts joined by ``sep`` into lines of at most ``width`` characters (a part longer than that
    is a line of its own); a part is never split."""
    lines: list[str] = []
    for part in parts:
        if lines and len(lines[-1]) + len(sep) + len(part) <= width:
            lines[-1] += sep + part
        else:
            lines.append(part)
    return lines


def build_figure(
    layout: list[Panel],
    items: list[Trace],
    widget: bool,
    title: Sequence[str] = (),
    small: int = 0,
    marks: Sequence[tuple[float | None, int]] = (),
    expect: dict[str, Any] | None = None,
) -> Any:
    """The figure; ``title``: its lines, from the top (the last ``small`` of them in a smaller font);
    ``marks``: (step, ranks) where the world's size changed, a dotted line on each panel over steps. ``expect``: what
    %%dist_fit forecast for this world (label, step_s, peak_MiB): a dashed line at the step's time on the step split
    and, where the panel shows what tensors hold on the GPU, at the peak on the memory panel.
    The title and the legend get a band of their own above the panels, sized by the number of lines,
    so that neither is cut off by the figure's top nor covers the other."""
    import html

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
        points = [t.x if t.kind == "bar" else t.y for t in items if t.panel == i]  # bars lie: their lengths are x
        values = [float(v) for p in points if p is not None for v in p if isinstance(v, numbers.Real) and v == v]
        if not values:  # before the first step: no empty -1..1 axes, a word instead
            fig.update_xaxes(visible=False, row=row, col=col)
            fig.update_yaxes(visible=False, row=row, col=col)
            fig.add_annotation(
                text="waiting for the first step", showarrow=False, font={"color": "#888", "size": 12},
                xref=f"x{i + 1 if i else ''} domain", yref=f"y{i + 1 if i else ''} domain", x=0.5, y=0.5,
            )
            continue
        if panel.key == "memory" and max(values) - min(values) < MEMORY_SPAN_MIB:
            middle = (max(values) + min(values)) / 2
            fig.update_yaxes(range=[middle - MEMORY_SPAN_MIB / 2, middle + MEMORY_SPAN_MIB / 2], row=row, col=col)
        if expect and panel.key == "split" and expect.get("step_s"):
            fig.add_vline(
                x=1e3 * expect["step_s"], line_dash="dash", line_color="#444", row=row, col=col,
                annotation_text=f"forecast {1e3 * expect['step_s']:.0f} ms ({expect['label']})", annotation_font_size=10,
                annotation_position="bottom right",
            )
        if expect and panel.key == "memory" and expect.get("peak_MiB") and "GPU" in panel.title:
            fig.add_hline(
                y=expect["peak_MiB"], line_dash="dash", line_color="#444", row=row, col=col,
                annotation_text=f"forecast peak ({expect['label']})", annotation_font_size=10,
            )
        if panel.key == "split":
            fig.update_yaxes(autorange="reversed", row=row, col=col)
        else:
            fig.update_xaxes(title_text="step", title_standoff=2, row=row, col=col)
            for step, ranks in marks:
                if step is not None:
                    fig.add_vline(
                        x=step, line_dash="dot", line_color="#888", annotation_text=f"{ranks} ranks",
                        annotation_font_size=10, row=row, col=col,
                    )
    fig.update_annotations(font_size=13)
    title_px = TITLE_LINE_PX * len(title) + (6 if title else 0)
    top = TOP_PAD_PX + title_px + LEGEND_ROW_PX + SUBPLOT_TITLE_PX
    height = 250 * rows + 30 + top
    fig.update_layout(
        height=height,
        margin={"t": top, "b": 30, "l": 50, "r": 20},
        barmode="stack",
        uniformtext={"mode": "hide", "minsize": 9},
        legend={
            "orientation": "h",
            "x": 1.0,
            "xanchor": "right",
            "y": 1 - (TOP_PAD_PX + title_px) / height,
            "yanchor": "top",
            "yref": "container",
        },
        hovermode="closest",
        template="plotly_white",
    )
    if title:
        lines = [html.escape(line) for line in title]
        big, little = lines[: len(lines) - small], lines[len(lines) - small :]
        text = "<br>".join(big + [f"<span style='font-size:12px'>{line}</span>" for line in little])
        fig.update_layout(
            title={
                "text": text,
                "font": {"size": TITLE_FONT_PX},
                "x": 0.01,
                "xanchor": "left",
                "y": 1 - (TOP_PAD_PX + _title_overshoot_px(len(lines))) / height,
                "yanchor": "top",
                "yref": "container",
            }
        )
    return go.FigureWidget(fig) if widget else fig


def plain(v: Any) -> Any:
    return v.item() if hasattr(v, "item") else v


def identity(layout: list[Panel], items: list[Trace]) -> tuple:
    return tuple(p.title.split(" · compressed")[0] for p in layout), tuple(t.ident for t in items)
