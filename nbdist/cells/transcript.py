"""What a distributed cell showed, kept on disk in its world's 0700 directory, so that a page opened
later (the tab was closed, another browser) can show it: the lines, the displays, the metric rows
the dashboard draws, the ranks' states, and the cell's end.

A browser tab is one Jupyter session; the server keeps a kernel's messages only for the session
that asked, and a running cell keeps its kernel from answering anything else. So the kernel writes
here as it shows, and nbdist's server extension (server/) reads it for the page.

One file per cell, ``<world>/transcript/<n>.jsonl``, one JSON object per line:
``{"cell": {id, count, code, started}}`` first, then ``{"out": <an nbformat output>}``,
``{"metrics": [rank, rows]}``, ``{"states": {rank: state}}``, and ``{"end": time}`` last (then
``{"resume": time}`` if the same run of the notebook cell sends more to the ranks).

Bounded: a cell keeps at most ``MAX_OUTPUT_BYTES`` of output (then one line says how much more was
shown and not kept) and ``MAX_METRIC_ROWS`` metric rows per rank (then every second row, then every
fourth: the dashboard decimates anyway); a world keeps its last ``MAX_CELLS`` transcripts. Written
through a buffer, flushed at most every ``FLUSH_S``, and never in a rank's way: only the kernel
writes, after the output reached it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import pointers

DIR = "transcript"
MAX_OUTPUT_BYTES = 8 * 2**20
MAX_METRIC_ROWS = 20_000
MAX_CELLS = 50
FLUSH_S = 0.25


def directory(workdir: str) -> str:
    return os.path.join(workdir, DIR)


@dataclass
class Transcript:
    """The writer for one cell. ``open`` makes the file; the sink calls the rest."""

    path: str
    _fh: Any = None
    _pending: list[str] = field(default_factory=list)
    _flushed: float = 0.0
    _kept: int = 0
    _dropped: int = 0
    _rows: dict[int, int] = field(default_factory=dict)
    _seen: dict[int, int] = field(default_factory=dict)
    _head: dict[str, Any] = field(default_factory=dict)  # the header line, to begin the file again if it is deleted

    @classmethod
    def open(cls, workdir: str, cell: dict[str, Any]) -> Transcript:
        """A new transcript for a cell (``cell``: id, count, code) in this world's directory; or the last
        one again when it is this same run of the same notebook cell (a cell that runs on the ranks more
        than once: recovery running it again, a magic's several runs), so a page shows all of it."""
        where = directory(workdir)
        os.makedirs(where, mode=0o700, exist_ok=True)
        names = sorted(n for n in os.listdir(where) if n.endswith(".jsonl"))
        last = os.path.join(where, names[-1]) if names else ""
        if last and cell.get("id") and header(last) == (cell["id"], cell.get("count")):
            t = cls(last, open(last, "a", encoding="utf-8"), _head={"cell": _first(last)})  # noqa: SIM115 (closed by end)
            t._kept = os.path.getsize(last)  # the bound holds for the whole run of the cell
            t._line({"resume": time.time()})
            t.flush()
            return t
        number = int(names[-1].split(".")[0]) + 1 if names else 0
        for old in names[: max(0, len(names) - MAX_CELLS + 1)]:
            os.unlink(os.path.join(where, old))
        path = os.path.join(where, f"{number:06d}.jsonl")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        t = cls(path, os.fdopen(fd, "w", encoding="utf-8"), _head={"cell": {**cell, "started": time.time()}})
        t._line(t._head)
        t.flush()
        return t

    def output(self, out: dict[str, Any]) -> None:
        """An nbformat output the cell showed (a stream's text, a display)."""
        if self._fh is None:
            return
        line = json.dumps({"out": out}, default=str)
        if self._kept + len(line) > MAX_OUTPUT_BYTES:
            self._dropped += len(out.get("text", "")) or 1
            return
        self._kept += len(line)
        self._pending.append(line)

    def metrics(self, rank: int, rows: list[dict[str, Any]]) -> None:
        if self._fh is None:
            return
        kept = []
        for row in rows:
            seen = self._seen[rank] = self._seen.get(rank, 0) + 1
            stride = 1 << max(0, self._rows.get(rank, 0) // MAX_METRIC_ROWS)
            if seen % stride == 0:
                kept.append(row)
        if kept:
            self._rows[rank] = self._rows.get(rank, 0) + len(kept)
            self._line({"metrics": [rank, kept]})

    def states(self, states: dict[int, Any]) -> None:
        if self._fh is not None:
            self._line({"states": {str(r): str(s) for r, s in states.items()}})

    def tick(self, now: float | None = None) -> None:
        """Flush if the last flush is more than FLUSH_S old."""
        now = time.monotonic() if now is None else now
        if self._pending and now - self._flushed >= FLUSH_S:
            self.flush(now)

    def flush(self, now: float | None = None) -> None:
        if self._fh is None or not self._pending:
            return
        try:
            if not os.path.exists(self.path):  # an open file that was deleted takes writes into the void
                self._again()
            self._fh.write("\n".join(self._pending) + "\n")
            self._fh.flush()
        except (OSError, ValueError):  # the world's directory went away, or its disk is full
            self._fh = None
            print(
                f"nbdist: cannot write {self.path}; this cell's output is no longer kept for pages opened later",
                file=sys.stderr,
            )
        self._pending.clear()
        self._flushed = time.monotonic() if now is None else now

    def _again(self) -> None:
        """The file was deleted while the cell ran: begin it again in the world's directory (FileNotFoundError when
        that is gone too), its header and a line saying what went missing, and say so once."""
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        self._fh.close()
        self._fh = os.fdopen(fd, "w", encoding="utf-8")
        gap = f"... nbdist: this cell's transcript was deleted at {time.strftime('%H:%M:%S')}; what it showed before is gone\n"
        self._pending[:0] = [
            json.dumps(self._head or {"cell": {}}, default=str),
            json.dumps({"out": {"output_type": "stream", "name": "stderr", "text": gap}}),
        ]
        self._kept = sum(map(len, self._pending))
        print(
            f"nbdist: {self.path} (this cell's transcript) was deleted while the cell ran; kept again from here, "
            "so a page opened later shows what the cell shows from now on",
            file=sys.stderr,
        )

    def end(self, result: Any = None) -> None:
        """The cell is over (``result``: its RunResult): its error as the magic raises it, what was not
        kept, and close."""
        if self._fh is None:
            return
        try:
            if result is not None:
                result.raise_for_error()
        except Exception as exc:  # the cell failed: the page shows the error the magic raises
            name = type(exc).__name__
            self._line(
                {"out": {"output_type": "error", "ename": name, "evalue": str(exc), "traceback": [f"{name}: {exc}"]}}
            )
        if self._dropped:
            text = f"\n... {self._dropped:,} more characters were shown than this transcript keeps\n"
            self._pending.append(json.dumps({"out": {"output_type": "stream", "name": "stderr", "text": text}}))
        self._line({"end": time.time()})
        self.flush()
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def _line(self, obj: dict[str, Any]) -> None:
        self._pending.append(json.dumps(obj, default=str))


DASHBOARD = {"output_type": "nbdist-dashboard"}  # in Cell.outputs: the dashboard goes here (server/ draws it)


@dataclass
class Cell:
    """One transcript as read back: what a page shows for the cell."""

    id: str
    count: int | None
    code: str  # as the cell ran it: a page whose cells have other ids finds the cell by its source
    running: bool
    outputs: list[dict[str, Any]]
    metrics: dict[int, list[dict[str, Any]]]
    states: dict[int, str]
    size: int  # bytes read: changes whenever the transcript grew


class Reader:
    """Reads a transcript as it grows: each ``update`` parses only the complete lines appended since the
    last, so a page that looks every second costs what was added, not the whole file. Metric rows go to
    ``on_metrics(rank, rows)`` when given (the server feeds its dashboard), else into ``cell.metrics``."""

    def __init__(self, path: str, on_metrics: Callable[[int, list[dict[str, Any]]], None] | None = None) -> None:
        self.path = path
        self.offset = 0
        self.on_metrics = on_metrics
        self.header: dict[str, Any] | None = None
        self.cell = Cell(id="", count=None, code="", running=True, outputs=[], metrics={}, states={}, size=0)
        self._dashboard = False

    def update(self) -> bool:
        """Read what was appended; True if anything was."""
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except OSError:
            return False
        complete = data[: data.rfind(b"\n") + 1]  # a last line cut in the middle of a write waits
        if not complete:
            return False
        self.offset += len(complete)
        for line in complete.splitlines():
            try:
                self._apply(json.loads(line))
            except (ValueError, TypeError, KeyError):
                continue  # a damaged line costs that line only
        self.cell.size = self.offset
        return True

    def _apply(self, item: dict[str, Any]) -> None:
        cell = self.cell
        if "cell" in item:
            self.header = head = item["cell"]
            cell.id, cell.count, cell.code = str(head.get("id") or ""), head.get("count"), str(head.get("code", ""))
        elif "out" in item:
            _add_output(cell.outputs, item["out"])
        elif "metrics" in item:
            rank, rows = int(item["metrics"][0]), item["metrics"][1]
            if not self._dashboard:  # where the dashboard appeared, with the first rows
                cell.outputs.append(dict(DASHBOARD))
                self._dashboard = True
            if self.on_metrics is not None:
                self.on_metrics(rank, rows)
            else:
                cell.metrics.setdefault(rank, []).extend(rows)
        elif "states" in item:
            cell.states.update({int(r): s for r, s in item["states"].items()})
        elif "end" in item:
            cell.running = False
        elif "resume" in item:  # the same cell runs on the ranks again (transcript.open)
            cell.running = True


def read(path: str) -> Cell | None:
    """A transcript, streams merged as a page merges them; None if it has no header (being created,
    or not a transcript). A last line cut in the middle of a write is left for the next read."""
    reader = Reader(path)
    reader.update()
    return reader.cell if reader.header is not None else None


def _first(path: str) -> dict[str, Any]:
    """A transcript's header: its cell (id, count, code, started); {} when it has none."""
    try:
        with open(path, encoding="utf-8") as fh:
            head = json.loads(fh.readline())["cell"]
        return head if isinstance(head, dict) else {}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def header(path: str) -> tuple[str, Any] | None:
    """(cell id, count) of a transcript, from its first line."""
    head = _first(path)
    return (str(head.get("id") or ""), head.get("count")) if head else None


def _add_output(outputs: list[dict[str, Any]], out: dict[str, Any]) -> None:
    last = outputs[-1] if outputs else None
    if (
        last is not None
        and out.get("output_type") == "stream"
        and last.get("output_type") == "stream"
        and last.get("name") == out.get("name")
    ):
        last["text"] += out.get("text", "")
    else:
        outputs.append(dict(out))


def cells(workdir: str) -> list[str]:
    """The transcripts of a world, oldest first."""
    where = directory(workdir)
    try:
        names = sorted(n for n in os.listdir(where) if n.endswith(".jsonl"))
    except OSError:
        return []
    return [os.path.join(where, n) for n in names]


def start(workdir: str) -> Transcript | None:
    """A transcript for the cell this kernel runs now, and the pointer from this kernel to its world;
    None outside a Jupyter kernel or when nothing can be written (the cell runs as before)."""
    kernel_id, cell = pointers.this_kernel()
    if not kernel_id:
        return None
    try:
        transcript = Transcript.open(workdir, cell)
    except OSError:
        return None
    pointers.point(workdir, kernel_id)
    return transcript
