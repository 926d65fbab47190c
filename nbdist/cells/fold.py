"""Output folded across ranks: what several ranks print alike is shown once, tagged with the ranks.

``Folder`` is pure (the caller passes the clock): it takes each rank's raw text as it arrives and
gives back the lines to show now, each as ``(stream, text)``:

* a line is complete at ``\\n``; a carriage return overwrites (``\\r``-only updates, a progress
  bar's, are the rank's *live line*, never printed as they come; the line shows once it ends, as ordinary
  output even when it came on stderr, as tqdm's does);
* the oldest waiting line is shown together with the same line at the head of each other rank's
  queue, once every running rank has one there, or no rank has sent it for ``hold`` seconds, or
  ``MOST`` holds have passed since the first did (streaming stays live: nothing waits longer);
  beyond ``MANY`` ranks the hold grows with the world; a rank's own lines keep their order;
* lines alike are one line: ``[ranks 0-15] epoch 1 done``; lines that differ only in their numbers
  are one line from ``compact`` ranks on, each number that differs shown as ``low…high``
  (``[ranks 0-15] loss 0.512…0.634``, ``(low rank 4, high rank 9)`` when one number differs);
  below that, for lines that name their own rank (``rank 3: row 1``), and for lines that differ
  otherwise, one line per rank, grouped;
* a rich output (``display``, the cell's value) waits and folds the same way: one for the ranks whose
  data are the same, tagged with them;
* ``fold=False`` shows every rank's lines as they are (``%%distributed --each``).

Nothing is lost: the caller keeps every rank's full text (``cluster.last``).
"""

from __future__ import annotations

import json
import re
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..doctor import ranks_text

NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
HOLD = 0.5  # seconds a line waits for the same line from the other ranks, counted from the last rank that sent it
# ... and at most this many holds from the first. Both grow with the world past ``MANY`` ranks: where many ranks
# share few cores their lines reach the notebook spread over a second or more (64 ranks on 2 cores in CI: one
# print shown as two lines, 31 ranks more than 0.5 s behind the others)
MOST = 4
MANY = 16
PROGRESS = re.compile(r"(\d+)/(\d+)")  # tqdm's "n/total"
Shown = tuple[str, str, "dict[str, Any] | None"]  # (stream or "display", text or tag, a display's content)


@dataclass(slots=True)
class _Line:
    rank: int
    name: str  # "stdout", "stderr", or "display" (a rich output; ``text`` is its data as JSON)
    text: str
    at: float
    content: dict[str, Any] | None = None  # a display's message content
    label: str = ""  # a display's tag after the ranks: "" or "Out:"
    # what lines alike share, made once: ``ready`` compares each rank's waiting line with the first at every look
    alike: str = field(init=False)

    def __post_init__(self) -> None:
        self.alike = f"{self.label}\0{self.text}" if self.name == "display" else shape(self.text)


def visible(line: str) -> str:
    """What a terminal shows of a line with carriage returns: the last text written after one, without
    the spaces a progress bar pads an update with to cover a longer one before (so two ranks' last
    states fold whatever they printed before)."""
    if "\r" not in line:
        return line
    parts = [p for p in line.split("\r") if p]
    return parts[-1].rstrip(" ") if parts else ""


def shown_on(name: str, line: str) -> str:
    """The stream a line is shown on: a line written with carriage returns (a progress bar: tqdm writes to stderr)
    is ordinary output, never a problem's pink box under a cell that went well."""
    return "stdout" if "\r" in line else name


def shape(text: str) -> str:
    """The line with its numbers masked: lines of one shape differ only in their numbers."""
    return NUMBER.sub("#", text)


class Folder:
    def __init__(self, ranks: list[int], *, hold: float = HOLD, fold: bool = True, compact: int = 3) -> None:
        self.ranks, self.fold, self.compact = list(ranks), fold, compact
        self.hold = hold * max(1.0, len(self.ranks) / MANY)
        self.queues: dict[int, deque[_Line]] = {r: deque() for r in ranks}
        self.partial: dict[tuple[int, str], str] = {}
        self.live: dict[int, str] = {}  # each rank's progress line (carriage-return updates), unfinished
        self.live_on: dict[int, str] = {}  # the stream it is on
        self.done: set[int] = set()
        self.ended: set[tuple[int, str]] = set()  # streams whose finished bar was shown before its newline came

    # ------------------------------------------------------------------ input

    def feed(self, rank: int, name: str, text: str, now: float) -> None:
        """More raw text on a rank's stdout or stderr."""
        key = (rank, name)
        if key in self.ended and text.startswith("\n"):
            text = text[1:]  # the end of a bar already shown as ended (below)
        self.ended.discard(key)
        *lines, rest = (self.partial.get(key, "") + text).split("\n")
        if lines or text.strip():
            self._end_finished_bar(rank, "stderr" if name == "stdout" else "stdout", now)
        for line in lines:
            self.queues.setdefault(rank, deque()).append(_Line(rank, shown_on(name, line), visible(line), now))
        if lines and self.live_on.get(rank) == name:
            self.live.pop(rank, None)
        if "\r" in rest:  # an update in place: only its last state matters
            rest = rest[rest.rindex("\r") :]
            shown = visible(rest)
            if shown.strip():
                self.live[rank], self.live_on[rank] = shown, name
        self.partial[key] = rest

    def _end_finished_bar(self, rank: int, name: str, now: float) -> None:
        """A rank writes on one stream while its bar on the other stands at n/n: the loop is over, and the
        bar's closing newline is only held in that stream's buffer on the rank (each stream flushes on its
        own). The bar's line ends here, so it shows before what the rank printed after the loop."""
        rest = self.partial.get((rank, name), "")
        found = PROGRESS.findall(visible(rest)) if "\r" in rest else []
        if found and found[-1][0] == found[-1][1]:
            self.queues.setdefault(rank, deque()).append(_Line(rank, shown_on(name, rest), visible(rest), now))
            self.partial[(rank, name)] = ""
            self.live.pop(rank, None)
            self.ended.add((rank, name))

    def display(self, rank: int, content: dict[str, Any], now: float, label: str = "") -> None:
        """A rich output (``display(...)``, or the cell's value with ``label`` 'Out:'): held and folded like a
        line, in its place among the rank's lines; alike when its data are the same."""
        key = json.dumps(content.get("data", {}), sort_keys=True, default=str)
        self.queues.setdefault(rank, deque()).append(_Line(rank, "display", key, now, content, label))

    def finished(self, rank: int) -> None:
        """This rank's cell is over: no line of it is worth waiting for."""
        self.done.add(rank)

    # ------------------------------------------------------------------ output

    def ready(self, now: float) -> list[Shown]:
        """What to show now, in order: (stream, text, None) for lines, ("display", tag, content) for rich ones."""
        out: list[Shown] = []
        while True:
            heads = {r: q[0] for r, q in self.queues.items() if q}
            if not heads:
                return out
            first = min(heads.values(), key=lambda line: (line.at, line.rank))
            if not self.fold:
                out += self._take([first])
                continue
            alike = [h for h in heads.values() if h.name == first.name and _alike(h, first)]
            waiting = [r for r in self.ranks if r not in heads and r not in self.done]
            last = max(h.at for h in alike)
            if waiting and now - last < self.hold and now - first.at < MOST * self.hold:
                return out
            out += self._take(sorted(alike, key=lambda line: line.rank))

    def finish(self) -> list[Shown]:
        """Everything still held: the queued lines, then each rank's unfinished line (a bar's last state)."""
        for (rank, name), rest in sorted(self.partial.items()):
            last = visible(rest)
            if last.strip():
                self.queues.setdefault(rank, deque()).append(_Line(rank, shown_on(name, rest), last, float("inf")))
        self.partial.clear()
        self.live.clear()
        self.done.update(self.queues)
        return self.ready(float("inf"))

    def world_progress(self) -> str:
        """One line for many live bars: the slowest rank's bar, the spread, and who is slowest and fastest."""
        if not self.live:
            return ""
        where = {}
        for rank, text in self.live.items():
            found = PROGRESS.findall(text)
            if found:
                where[rank] = int(found[-1][0]), int(found[-1][1])
        if not where:
            rank = min(self.live)
            return f"[{ranks_text(sorted(self.live))}] {self.live[rank]}"
        slow = min(where, key=lambda r: (where[r][0], r))
        fast = max(where, key=lambda r: (where[r][0], -r))
        total = where[slow][1]
        spread = f"slowest rank {slow} at {where[slow][0]}/{total}, fastest rank {fast} at {where[fast][0]}/{total}"
        return f"[{ranks_text(sorted(self.live))}] {self.live[slow]}  ({spread})"

    # ------------------------------------------------------------------ rendering

    def _take(self, lines: list[_Line]) -> list[Shown]:
        for line in lines:
            self.queues[line.rank].popleft()
        name = lines[0].name
        if name == "display":  # alike only when the same: one for all
            tag = f"[{ranks_text([line.rank for line in lines])}]" + (f" {lines[0].label}" if lines[0].label else "")
            return [(name, tag, lines[0].content)]
        texts = {line.text for line in lines}
        if len(texts) == 1:
            return [(name, f"[{ranks_text([line.rank for line in lines])}] {lines[0].text}\n", None)]
        if len(lines) < self.compact or _names_its_rank(lines):
            return [(name, f"[rank {line.rank}] {line.text}\n", None) for line in lines]
        return [(name, f"[{ranks_text([line.rank for line in lines])}] {_compact(lines)}\n", None)]


def _alike(a: _Line, b: _Line) -> bool:
    return a.alike == b.alike


def _names_its_rank(lines: list[_Line]) -> bool:
    """Whether a number that differs is each line's own rank ('rank 3: row 1 of the mesh'): such lines say
    which rank is where, which low…high would hide, so they show one per rank."""
    columns = zip(*(NUMBER.findall(line.text) for line in lines), strict=False)
    ranks = [float(line.rank) for line in lines]
    return any(len(set(col)) > 1 and [float(v) for v in col] == ranks for col in columns)


def _compact(lines: list[_Line]) -> str:
    """One line for lines alike but for their numbers: each differing number as low…high."""
    numbers = [NUMBER.findall(line.text) for line in lines]
    pieces = NUMBER.split(lines[0].text)
    out, varying = [pieces[0]], []
    for i in range(len(numbers[0])):
        column = [row[i] for row in numbers]
        if len(set(column)) == 1:
            out.append(column[0])
        else:
            values = [float(v) for v in column]
            low, high = values.index(min(values)), values.index(max(values))
            out.append(f"{column[low]}…{column[high]}")
            varying.append((lines[low].rank, lines[high].rank))
        out.append(pieces[i + 1])
    text = "".join(out)
    if len(varying) == 1:
        low_rank, high_rank = varying[0]
        text += f"  (low rank {low_rank}, high rank {high_rank})"
    return text
