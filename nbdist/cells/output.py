"""Where a running cell's output goes: the ``Sink`` interface and the default ``TaggedPrinter``.

``run`` calls a sink's methods as output arrives from the ranks; a sink never talks to
the ranks. Every method is optional: subclass ``Sink`` and override what you need (the
tests and benchmarks record into their own sinks).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from ..results import STATE_COLOURS, RankState, chips, ranks_text, state_groups
from ..stragglers import slow
from .fold import Folder, Shown
from .transcript import Transcript

SHOW_LIMIT = 100_000  # characters shown per rank and stream in one cell (docs/faults.md, row 9)


class Sink:
    """Receives a cell's output as it arrives. The default methods do nothing."""

    def stream(self, rank: int, name: str, text: str) -> None:
        """More text on ``name`` ('stdout' or 'stderr') of this rank."""

    def display(self, rank: int, content: dict[str, Any]) -> None:
        """A rich display (``display(...)``) from this rank: ``data`` and ``metadata`` by MIME type."""

    def result(self, rank: int, content: dict[str, Any]) -> None:
        """The value of the cell's last expression on this rank."""

    def metrics(self, rank: int, rows: list[dict[str, Any]]) -> None:
        """Rows this rank logged with ``nbdist.log``."""

    def logged(self, rank: int, rows: list[dict[str, Any]]) -> None:
        """Rows this rank logged while the cell's output is not shown (``wait(show=False)``): kept, not drawn."""

    def state(self, rank: int, state: RankState) -> None:
        """This rank's state changed (busy, idle, failed, dead)."""

    def progress(self, done: int, total: int) -> None:
        """Ranks finished so far, for cells that run longer than a moment."""

    def finished(self, rank: int) -> None:
        """Everything this rank will show in this cell has been handed over."""

    def tick(self) -> None:
        """Called every few tens of milliseconds while the cell runs: show what is due."""

    def resized(self, new: dict[int, int], step: int | None, joined: list[int] | None = None) -> None:
        """The world went on with other ranks (``new``: each remaining rank's old number -> its new one; ``joined``:
        the ranks a grow added) from loop step ``step``, and the cell runs again on them."""

    def settle(self) -> None:
        """A rank's debugger is about to talk: show the complete lines held back for folding now."""

    def flush(self) -> None:
        """The cell is over: show whatever is still held back."""


class TaggedPrinter(Sink):
    """Default sink: prints each complete line tagged with its rank, folded across ranks (fold.py:
    ``[ranks 0-15] epoch 1 done``); keeps each rank's progress bar live in place while the cell runs;
    shows displays per rank, a progress bar of ranks finished for long cells and, once a rank logs
    metrics, the live dashboard. ``fold=False`` prints every rank's lines as they are.

    What comes in (``stream``, ``display``, ``result``) is shown at the next ``tick`` (the watch ticks after each
    batch it hands over): a look at every rank's waiting line after each rank's text cost a cell in which 256 ranks
    print a line about 33,000 comparisons."""

    LIVE_EVERY = 0.25  # seconds between two redraws of the live progress bars
    LIVE_PER_RANK = 4  # up to this many bars, one line per rank; above, one line for the world

    def __init__(
        self,
        quiet_ranks: set[int] | None = None,
        limit: int = SHOW_LIMIT,
        ranks: list[int] | None = None,
        fold: bool = True,
        clock: Callable[[], float] = time.monotonic,
        transcript: Transcript | None = None,
        expect: dict[int, dict[str, Any]] | None = None,
        listener: Any = None,
    ) -> None:
        self.quiet_ranks = quiet_ranks or set()
        self.listener = listener  # what else hears the metric rows (a tracked run: tracking/tracker.py)
        self.expect = expect  # what %%dist_fit forecast (the dashboard draws it and says a miss)
        self.transcript = transcript  # what is shown is also kept there, for a page opened later
        self.limit = limit
        self.clock = clock
        self.folder = Folder([r for r in ranks or [] if r not in self.quiet_ranks], fold=fold)
        self._shown: dict[tuple[int, str], int] = {}
        self.dashboard: Any = None
        self._states: dict[int, RankState] = {}
        self._bar: Any = None
        self._live: Any = None  # the display that holds the live progress bars
        self._live_at = float("-inf")
        self._live_text = ""

    def stream(self, rank: int, name: str, text: str) -> None:
        if rank in self.quiet_ranks:
            return
        key = (rank, name)
        shown = self._shown.get(key, 0)
        if shown >= self.limit:
            return
        if shown + len(text) > self.limit:
            text = text[: self.limit - shown]
            text += (
                f"\n... {name} of rank {rank} cut at {self.limit:,} characters; "
                "the whole text is in the RunResult (cluster.last)\n"
            )
        self._shown[key] = shown + len(text)
        self.folder.feed(rank, name, text, self.clock())

    def finished(self, rank: int) -> None:
        """This rank's output is all here (its reply can come before its output): lines need not wait for it.
        The watch ticks right after."""
        self.folder.finished(rank)

    def tick(self, now: float | None = None) -> None:
        """Show the lines no longer worth holding, and redraw the live bars (at most every LIVE_EVERY s)."""
        now = self.clock() if now is None else now
        self._write_all(self.folder.ready(now))
        if now - self._live_at >= self.LIVE_EVERY:
            self._draw_live(now)
        if self.transcript is not None:
            self.transcript.tick()

    def live_text(self) -> str:
        """The live progress bars as they would be drawn now: one line per rank, or one for the world."""
        live = self.folder.live
        if len(live) > self.LIVE_PER_RANK:
            return self.folder.world_progress()
        return "\n".join(f"[rank {rank}] {live[rank]}" for rank in sorted(live))

    def _draw_live(self, now: float) -> None:
        text = self.live_text()
        if text == self._live_text or not in_kernel():
            return
        self._live_at, self._live_text = now, text
        bundle = {"text/plain": text}
        if self._live is None:
            from IPython.display import display

            self._live = display(bundle, raw=True, display_id=True)
        else:
            self._live.update(bundle, raw=True)

    def display(self, rank: int, content: dict[str, Any]) -> None:
        if rank not in self.quiet_ranks:
            self.folder.display(rank, content, self.clock())

    def result(self, rank: int, content: dict[str, Any]) -> None:
        if rank not in self.quiet_ranks:
            self.folder.display(rank, content, self.clock(), label="Out:")

    def state(self, rank: int, state: RankState) -> None:
        self._states[rank] = state
        if self.transcript is not None:
            self.transcript.states({rank: state})
        if self.dashboard is not None:
            self.dashboard.set_state(rank, state)

    def progress(self, done: int, total: int) -> None:
        if self._bar is None:
            if not in_kernel():
                return
            from tqdm.notebook import tqdm

            self._bar = tqdm(total=total, desc="ranks finished", leave=False)
        self._bar.n = done
        self._bar.refresh()

    def logged(self, rank: int, rows: list[dict[str, Any]]) -> None:
        if self.listener is not None:  # a tracked run has every row, shown or not
            self.listener.metrics(rank, rows)

    def metrics(self, rank: int, rows: list[dict[str, Any]]) -> None:
        """Plotted live in a notebook: the dashboard appears with the first rows."""
        if self.listener is not None:
            self.listener.metrics(rank, rows)
        if self.transcript is not None:
            self.transcript.metrics(rank, rows)
        if self.dashboard is None:
            if not in_kernel():
                return
            from ..widgets.dashboard import Dashboard

            self.dashboard = Dashboard(
                ranks=len(self.folder.ranks), palette=STATE_COLOURS, judge=slow, chips=chips, expect=self.expect
            )
            self.dashboard.states.update(self._states)
            self.dashboard.show()
        self.dashboard.update(rank, rows)

    def resized(self, new: dict[int, int], step: int | None, joined: list[int] | None = None) -> None:
        self._write_all(self.folder.ready(float("inf")))  # what the old world printed, before its ranks move
        self.folder.ranks = [new[r] for r in self.folder.ranks if r in new] + list(joined or [])
        self.quiet_ranks = {new[r] for r in self.quiet_ranks if r in new}
        self._states = {new[r]: st for r, st in self._states.items() if r in new}
        self._shown = {(new[r], name): n for (r, name), n in self._shown.items() if r in new}
        if self.dashboard is not None:
            self.dashboard.resized(new, step)

    def settle(self) -> None:
        self._write_all(self.folder.ready(float("inf")))

    def flush(self) -> None:
        if self._bar is not None:
            self._bar.n = self._bar.total  # every rank has finished by now (or failed, which the cell reports)
            self._bar.refresh()
            self._bar.close()  # leave=False: the bar goes away
            self._bar = None
        if self.dashboard is not None:
            self.dashboard.close(states_line(self._states))  # the final state, as a static figure
        if self._live is not None:  # the bars' last states are printed below, as lines
            self._live.update({"text/plain": ""}, raw=True)
            self._live = None
        self._write_all(self.folder.finish())
        if self.transcript is not None:
            self.transcript.flush()

    def _write_all(self, items: list[Shown]) -> None:
        _write_all(items, self.transcript.output if self.transcript is not None else None)


def states_line(states: dict[int, Any]) -> str:
    """The ranks' states, ranks alike grouped: 'ranks 0-14: idle · rank 15: failed'."""
    return " · ".join(f"{ranks_text(ranks)}: {state}" for ranks, state in state_groups(states))


def _write_all(items: list[Shown], record: Callable[[dict[str, Any]], None] | None = None) -> None:
    """Write lines and show displays in order, one write per run of lines on the same stream;
    ``record`` gets each as the nbformat output a page shows."""
    i = 0
    while i < len(items):
        name, text, content = items[i]
        if name == "display":
            data, metadata = (content or {}).get("data", {}), (content or {}).get("metadata", {})
            show(data, metadata, prefix=text)
            if record is not None:
                record({"output_type": "stream", "name": "stdout", "text": text + "\n"})
                record({"output_type": "display_data", "data": data, "metadata": metadata})
            i += 1
            continue
        j = i
        while j < len(items) and items[j][0] == name:
            j += 1
        joined = "".join(item[1] for item in items[i:j])
        _write(name, joined)
        if record is not None:
            record({"output_type": "stream", "name": name, "text": joined})
        i = j


def _write(name: str, text: str) -> None:
    out = sys.stderr if name == "stderr" else sys.stdout
    out.write(text)
    out.flush()


def _shell() -> Any:
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover
        return None
    return get_ipython()


def in_kernel() -> bool:
    """Is this a Jupyter kernel (where widgets and rich output render)?"""
    return getattr(_shell(), "kernel", None) is not None


def show(data: dict[str, Any], metadata: dict[str, Any], prefix: str) -> None:
    """Show a display or result: rich in a kernel, its text/plain form elsewhere."""
    text = data.get("text/plain", "")
    rich = {k: v for k, v in data.items() if k != "text/plain"}
    if rich and in_kernel():
        from IPython.display import publish_display_data

        print(prefix, flush=True)
        publish_display_data(data, metadata)
        return
    if "\n" in text:
        print(prefix)
        print(text, flush=True)
    else:
        print(f"{prefix} {text}", flush=True)
