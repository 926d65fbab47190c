"""Where a running cell's output goes: the ``Sink`` interface and the default ``TaggedPrinter``.

``run`` calls a sink's methods as output arrives from the ranks; a sink never talks to
the ranks. Every method is optional: subclass ``Sink`` and override what you need (the
tests and benchmarks record into their own sinks).
"""

from __future__ import annotations

import sys
from typing import Any

from ..results import RankState

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

    def state(self, rank: int, state: RankState) -> None:
        """This rank's state changed (busy, idle, failed, dead)."""

    def progress(self, done: int, total: int) -> None:
        """Ranks finished so far, for cells that run longer than a moment."""

    def flush(self) -> None:
        """The cell is over: show whatever is still held back."""


class TaggedPrinter(Sink):
    """Default sink: prints each complete line as ``[rank N] ...``; shows displays per rank,
    a progress bar for long cells and, once a rank logs metrics, the live dashboard."""

    def __init__(self, quiet_ranks: set[int] | None = None, limit: int = SHOW_LIMIT) -> None:
        self.quiet_ranks = quiet_ranks or set()
        self.limit = limit
        self._partial: dict[tuple[int, str], str] = {}
        self._shown: dict[tuple[int, str], int] = {}
        self.dashboard: Any = None
        self._states: dict[int, RankState] = {}
        self._bar: Any = None

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
        *lines, rest = (self._partial.get(key, "") + text).split("\n")
        self._partial[key] = rest
        if lines:
            _write(name, "".join(f"[rank {rank}] {line}\n" for line in lines))

    def display(self, rank: int, content: dict[str, Any]) -> None:
        if rank not in self.quiet_ranks:
            show(content.get("data", {}), content.get("metadata", {}), prefix=f"[rank {rank}]")

    def result(self, rank: int, content: dict[str, Any]) -> None:
        if rank not in self.quiet_ranks:
            show(content.get("data", {}), content.get("metadata", {}), prefix=f"[rank {rank}] Out:")

    def state(self, rank: int, state: RankState) -> None:
        self._states[rank] = state
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

    def metrics(self, rank: int, rows: list[dict[str, Any]]) -> None:
        """Plotted live in a notebook: the dashboard appears with the first rows."""
        if self.dashboard is None:
            if not in_kernel():
                return
            from ..widgets.dashboard import Dashboard

            self.dashboard = Dashboard()
            self.dashboard.states.update(self._states)
            self.dashboard.show()
        self.dashboard.update(rank, rows)

    def flush(self) -> None:
        if self._bar is not None:
            self._bar.n = self._bar.total  # every rank has finished by now (or failed, which the cell reports)
            self._bar.refresh()
            self._bar.close()  # leave=False: the bar goes away
            self._bar = None
        if self.dashboard is not None:
            self.dashboard.close()  # the final state, as a static figure
        for (rank, name), rest in sorted(self._partial.items()):
            if rest:
                _write(name, f"[rank {rank}] {rest}\n")
        self._partial.clear()


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
