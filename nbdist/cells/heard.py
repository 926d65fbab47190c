"""What the ranks send while a cell runs, in the order they sent it, handed to the sink: each rank's stdout,
stderr and displays (message by message), its result and its metric rows; a rank debugger's messages go
aside, to the watch's relay (``pdb``).

Each rank's messages are heard from its request's making on (``hear``, called as ipyparallel makes the request's
future, before it is sent), so nothing is lost, reordered or printed twice; the iopub callback only records the
message and wakes the watch.
"""

from __future__ import annotations

import functools
import queue
from collections import deque
from typing import Any

from .. import wire
from . import replies
from .output import Sink
from .rows import KeptRows

_SHOWN_TYPES = ("stream", "display_data", "execute_result", "error", "data_message")


class Heard:
    """One cell's output from its ranks (``children``: ipyparallel's per-engine results, in rank order)."""

    def __init__(self, ranks: list[int], sink: Sink, wake: queue.SimpleQueue[int]) -> None:
        self.children: list[Any] = []  # ipyparallel's per-engine results, once the requests are made
        self.ranks, self.sink, self.wake = ranks, sink, wake
        self.seen = [_Seen() for _ in ranks]
        self.metrics: dict[int, KeptRows] = {r: KeptRows() for r in ranks}  # bounded, however long the cell
        # What each rank wrote and displayed, message by message, in order (ipyparallel keeps each stream's
        # text and the displays apart): (stream, text) or ("display", content), appended by its IO thread.
        self.order: list[deque[tuple[str, Any]]] = [deque() for _ in ranks]
        self.pdb: queue.SimpleQueue[tuple[int, dict[str, Any]]] = queue.SimpleQueue()  # (child, what its pdb said)
        # The children that sent something to show since the last emit, appended by the IO thread once ipyparallel
        # stored it: an emit looks at those alone, not at every rank (at 256 ranks, a cell's looks were about a quarter
        # of the notebook's main thread in it).
        self.news: deque[int] = deque()
        self.heard = [functools.partial(self._poke, i) for i in range(len(ranks))]

    def hear(self, i: int, future: Any) -> None:
        """The i-th rank's request is being made (compat.execute_heard): hear every message of its reply."""
        future.iopub_callbacks.append(self.heard[i])

    def _poke(self, i: int, msg: Any) -> None:
        # Wake the watching thread only for what it shows; bookkeeping messages would just
        # make it compete with ipyparallel's IO thread for the GIL.
        kind = msg.get("header", {}).get("msg_type")
        if kind == "stream":
            content = msg.get("content", {})
            self.order[i].append((content.get("name", "stdout"), content.get("text", "")))
        elif kind == "display_data":
            self._heard_display(i, msg.get("content", {}))
        if kind in _SHOWN_TYPES:
            self.news.append(i)
            self.wake.put(1)

    def _heard_display(self, i: int, content: dict[str, Any]) -> None:
        said = (content.get("data") or {}).get(wire.PDB)
        if said is None:
            self.order[i].append(("display", content))
        else:
            self.pdb.put((i, said))

    def emit(self, last: bool = False) -> None:
        """Hand the sink what each rank produced since the last call (``last``: the cell is over, and each rank's store
        is looked at)."""
        for i in self._new(every=last):
            md, rank, seen = self.children[i].output.metadata, self.ranks[i], self.seen[i]
            self._emit_streams(i, md, rank, seen, last)
            if md.get("execute_result") and not seen.result:
                seen.result = True
                self.sink.result(rank, md["execute_result"])
            self._emit_rows(md, rank, "metrics")

    def emit_rows(self, last: bool = False) -> None:
        """Only the metric rows, while nothing is shown (``wait(show=False)``): kept for the result and handed to the
        sink's ``logged`` (a tracked run hears them), not drawn."""
        for i in self._new(every=last):
            self._emit_rows(self.children[i].output.metadata, self.ranks[i], "logged")

    def _new(self, every: bool = False) -> list[int]:
        """The children with something new to hand on, in rank order (``every``: all)."""
        news = taken(self.news)
        return list(range(len(self.children))) if every else sorted(news)

    def _emit_rows(self, md: dict[str, Any], rank: int, method: str) -> None:
        data = md.get("data") or {}
        # each batch once, then out of ipyparallel's store, which would keep every row of the cell; list(): the IO
        # thread adds batches meanwhile
        for key in sorted(k for k in list(data) if k.startswith(wire.METRICS)):
            rows = data.pop(key).get("rows", [])
            self.metrics[rank].add(rows)
            call_sink(self.sink, method, rank, rows)

    def _emit_streams(self, i: int, md: dict[str, Any], rank: int, seen: _Seen, last: bool = False) -> None:
        """A rank's new stdout, stderr and displays in the order they were made, from the messages heard
        (ipyparallel's stored text is rewritten at each carriage return, so it cannot be sliced by length);
        ``last``: what no message was heard of (made before the watch listened) comes from the store."""
        order = self.order[i]
        while order:
            name, item = order.popleft()
            if name == "display":
                seen.outputs += 1
                self.sink.display(rank, item)
            else:
                seen.chars[name] += len(item)
                self.sink.stream(rank, name, item)
        if last:
            for name in ("stdout", "stderr"):
                stored = md.get(name) or ""
                if stored and not seen.chars[name]:
                    seen.chars[name] = len(stored)
                    self.sink.stream(rank, name, stored)
            outputs = replies.shown(md.get("outputs"))
            for content in outputs[seen.outputs :]:
                self.sink.display(rank, content)
            seen.outputs = len(outputs)

    def stop(self) -> None:
        """Hear no more of these ranks' messages (the cell is over)."""
        for child, heard in zip(self.children, self.heard, strict=True):
            try:
                child.iopub_callbacks.remove(heard)
            except ValueError:
                pass


class _Seen:
    """How much of one rank's output has been handed to the sink."""

    __slots__ = ("chars", "outputs", "result")

    def __init__(self) -> None:
        self.chars = {"stdout": 0, "stderr": 0}
        self.outputs = 0
        self.result = False


def taken(items: deque[int]) -> set[int]:
    """What another thread appended, taken out."""
    out = set()
    while items:
        out.add(items.popleft())
    return out


def call_sink(sink: Any, method: str, *args: Any) -> None:
    """Call an optional sink method (a sink that does not subclass Sink may lack it)."""
    fn = getattr(sink, method, None)
    if fn is not None:
        fn(*args)
