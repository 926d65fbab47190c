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
from collections.abc import Callable, Sequence
from typing import Any

from .figure import Panel, build_figure, identity, panels, plain, rank_colour, traces, wrap
from .store import Expect, Judge, MetricStore, Series

__all__ = ["Dashboard", "MetricStore", "Series", "Panel", "panels", "traces"]


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
    if "why" in h:  # %dist_why's verdict, where the ranks' steps were timed (engine/why.py)
        verdict = h["why"]
        ranks = verdict.figures.get("ranks")
        if verdict.cause == "balanced":
            out.append(("why", "balanced", "no rank holds the others"))
        else:
            who = ("rank " + ",".join(map(str, ranks))) if ranks else "every rank"
            out.append(("why", who, verdict.text.split(":")[0].split(" on ")[0]))
    if "forecast" in h:  # the step is slower than %%dist_fit said
        ratio, want = h["forecast"]
        out.append(("forecast", f"{ratio:.2f}x", f"the forecast step ({1e3 * want['step_s']:.0f} ms, {want['label']})"))
    if "ratio" in h and h["ratio"] > 1.5:
        out.append(("ratio", f"{h['ratio']:.0f}x", "fewer bytes (compression)"))
    return out


def headline_text(store: MetricStore) -> str:
    """The headline as one line (the static figure's text, where no figure is drawn)."""
    return " · ".join(headline_parts(store))


def headline_parts(store: MetricStore) -> list[str]:
    """The headline's items as a reader says them: 'step 299', 'loss (mean of ranks) 0.8377',
    '2,815 samples/s, all ranks', '6.8% of each step in communication', 'rank 1 slowest, +20%'."""
    out = []
    for name, value, label in headline_items(store):
        if name in ("step", "loss"):
            out.append(f"{label} {value}")
        elif value == "even":
            out.append(label)
        elif name == "why":
            out.append(f"{value}: {label}" if value != "balanced" else f"balanced: {label}")
        else:
            out.append(f"{value} {label}")
    return out


def final_bundle(fig: Any, headline: str, states: str) -> dict[str, Any]:
    """The static figure as a display bundle: plotly's own mime type (JupyterLab and Notebook 7 draw it
    from the saved notebook, no kernel needed) and, for renderers without plotly's (``nbconvert --to
    html``, GitHub), HTML with the headline and the figure drawn by plotly.js from its CDN. A raw bundle:
    a plotly Figure's own display would add a new output instead of replacing the live one; through
    plotly's JSON, which encodes the numpy arrays."""
    head = f"<p><b>{html.escape(headline)}</b><br><small>{html.escape(states)}</small></p>"
    return {
        "application/vnd.plotly.v1+json": json.loads(fig.to_json()),
        "text/html": head + fig.to_html(full_html=False, include_plotlyjs="cdn"),
        "text/plain": f"nbdist dashboard: {headline}" + (f"\n{states}" if states else ""),
    }


class Dashboard:
    """Plots what the ranks log, live. Feed it with ``update(rank, rows)``."""

    def __init__(
        self,
        max_points: int = 1000,
        refresh_s: float = 0.3,
        picked: Sequence[int] = (),
        ranks: int = 0,
        palette: dict[str, str] | None = None,
        judge: Judge | None = None,
        chips: Callable[[dict[int, str]], list[tuple[str, str, int | None]]] | None = None,
        expect: Expect | None = None,
    ) -> None:
        self.store = MetricStore(max_points, ranks=ranks, judge=judge, expect=expect)
        self.palette = dict(palette or {})  # a rank state's word -> its colour (results.STATE_COLOURS: given, not known)
        self.picked = list(picked)  # above figure.BAND_ABOVE ranks: ranks drawn one by one beside the spread
        self.refresh_s = refresh_s
        self.renders = 0
        self.rebuilds = 0
        self.render_s = 0.0  # the last refresh's cost: refreshes are spaced to keep the kernel free
        self.states: dict[int, str] = {}
        self.chips = chips  # states -> the badges (label, state, rank or None): results.chips (given, not known)
        self._last = 0.0
        self._shape: tuple = ()
        self._titles: list[str] = []
        self._handle: Any = None
        self._widget: Any = None
        self._box: Any = None
        self._head: Any = None

    def pick(self, ranks: Sequence[int]) -> None:
        """Draw these ranks one by one beside the spread (above figure.BAND_ABOVE ranks); redraws at once."""
        self.picked = list(ranks)
        if self._handle is not None:
            self.render()

    def set_state(self, rank: int, state: str) -> None:  # a RankState
        """idle / busy / failed / dead for one rank, shown in the headline."""
        self.states[rank] = state
        if self._head is not None:
            self._head.value = self.headline_html()

    def resized(self, new: dict[int, int], step: float | None) -> None:
        """The world went on with other ranks from ``step`` (old rank -> new; a grow's new ranks map to themselves):
        the ranks' lines go on under their new numbers, the figure marks the step; drawn again at once."""
        self.store.renumber(new, step)
        self.states = {new[r]: st for r, st in self.states.items() if r in new}
        self.render()

    def strip_html(self) -> str:
        """The ranks' states as badges in their state's colour (a rank's own badge edged in its line's colour), as
        ``chips`` gives them (one per rank, or ranks grouped), each kept on one line."""
        mine = sorted(self.states.items())
        chips = self.chips(self.states) if self.chips else [(f"rank {r}: {s}", str(s), r) for r, s in mine]
        badges = []
        for label, state, rank in chips:
            edge = f"border-left:6px solid {rank_colour(rank)};" if rank is not None else ""
            badges.append(
                f'<span class="nbdist-rank" style="{edge}background:{self.palette.get(state, "#555")};color:white;'
                f'padding:1px 8px;margin:0 6px 3px 0;border-radius:3px;display:inline-block;white-space:nowrap">'
                f"{html.escape(label)}</span>"
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

    def figure(self, states: str = "") -> Any:
        """A static plotly figure of everything so far, its title the headline (wrapped to fit the
        narrowest notebook) and under it ``states``, smaller. Plain lists, not numpy arrays: every
        renderer of a saved notebook reads them."""
        layout = panels(self.store)
        items = traces(self.store, layout, self.picked)
        for t in items:
            t.x, t.y = list(map(plain, t.x)), list(map(plain, t.y))
        below = wrap(states.split(" · ")) if states else []
        title = wrap(headline_parts(self.store)) + below
        return build_figure(
            layout, items, widget=False, title=title, small=len(below), marks=self.store.resizes,
            expect=self.store.expected(),
        )

    def states_text(self) -> str:
        """Each rank's state, one part per rank ('rank 0: idle · rank 1: failed'); the caller may
        pass a shorter one to ``close`` (ranks grouped)."""
        return " · ".join(f"rank {r}: {st}" for r, st in sorted(self.states.items()))

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
        items = traces(self.store, layout, self.picked)
        shape = identity(layout, items)
        shape += tuple(self.store.resizes)
        if self._widget is None or shape != self._shape:
            self._shape = shape
            self._widget = build_figure(layout, items, widget=True, marks=self.store.resizes, expect=self.store.expected())
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

    def close(self, states: str | None = None) -> None:
        """Replace the live widget by a static figure of the final state, titled with the headline
        and ``states`` (default ``states_text()``)."""
        if self._handle is not None:
            states = self.states_text() if states is None else states
            fig = self.figure(states)
            self._handle.update(final_bundle(fig, headline_text(self.store), states), raw=True)
            self._handle = None
            self._widget = self._box = self._head = None
