"""The preemption flags' exchange (engine/preempt.py): what each rank says at a step boundary, read by every rank
alike at a later one.

Each rank says whether it was sent SIGTERM, its time per step since the last exchange, and whether the world was
asked to change size. Where nbdist formed the world (``STATE.forming``), the exchange goes over the world's own store,
under the forming's keys: a count of the ranks that said their part, the sum of their times per step, and a line
naming the ranks signalled and any resize, written only when there is one. A rank's part is two requests to the
store, a read one (the count and the sum together; two where there is news); nothing is made first. Before, the exchange was an all-reduce on a gloo group of every rank,
made at a world's first step boundary by every rank at once: at 64 ranks on 2 cores that was 0.3-0.4 s of a rebuilt
world's first step, and 63 more connections on every rank. A world nbdist did not form (no store of its own) still
gets that group (``control.control_group("preempt")``).

A read waits in Python, looking at the count (1 to 20 ms apart), so the release's interrupt reaches the waiting
rank at once, and the wait ends with an error once the world breaks (``STATE.aborted``) or its timeout passes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from .state import STATE

POLL_S = 0.02  # the longest a read waits between two looks at the count
NEWS = 1 << 24  # the count of ranks with news, kept in the same key as the count of ranks (up to 16,777,215 ranks)


@dataclass(frozen=True, slots=True)
class Said:
    """What the ranks said at one exchange, as every rank reads it."""

    signalled: list[int]  # the ranks sent SIGTERM
    per_step: float  # seconds per step since the exchange before: the ranks' mean (store), the slowest's (group)
    resize: bool  # the world was asked to change size (%dist_grow beside a running loop)


class OverStore:
    """One exchange on the world's store: ``index`` counts the exchanges of the forming ``prefix``."""

    __slots__ = ("index", "prefix", "rank", "size", "store", "timeout")

    def __init__(self, store: Any, prefix: str, timeout: float, index: int, rank: int, size: int) -> None:
        self.store, self.prefix, self.timeout = store, prefix, timeout
        self.index, self.rank, self.size = index, rank, size

    def key(self, name: str, index: int | None = None) -> str:
        return f"{self.prefix}flags/{self.index if index is None else index}/{name}"

    def say(self, asked: bool, per_step_us: int, resize: bool) -> None:
        news = (f"s{self.rank}," if asked else "") + ("r," if resize else "")
        if news:
            self.store.append(self.key("news"), news)
        self.store.add(self.key("time"), per_step_us)
        # last, and counting the ranks with news above NEWS: a rank that reads the count whole reads every part before it
        self.store.add(self.key("count"), 1 + (NEWS if news else 0))

    def read(self) -> Said:
        deadline, pause = time.monotonic() + self.timeout, 0.001
        keys = [self.key("count"), self.key("time")]  # both there: this rank said its part (one request for both)
        while (came := (count := int((got := self.store.multi_get(keys))[0])) % NEWS) < self.size:
            if STATE.aborted or STATE.forming is None or STATE.forming[0] != self.prefix:
                raise RuntimeError(
                    f"nbdist: the world broke while rank {self.rank} waited for the preemption flags "
                    f"({came} of {self.size} ranks had said theirs)"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"rank {self.rank}: {came} of {self.size} ranks came to the preemption flags' exchange "
                    f"{self.index} within {self.timeout:.0f} s"
                )
            time.sleep(pause)  # a signal reaches this thread here: the release's interrupt stops the wait
            pause = min(POLL_S, pause * 2)
        total = int(got[1])  # read with a whole count: every rank's time was added before its count
        news = self.store.get(self.key("news")).decode() if count >= NEWS else ""
        if self.rank == self.index % self.size and self.index:  # a rank a turn (the store's load spread); every
            for name in ("count", "time", "news"):  # rank read the exchange before: each said this one after it
                self.store.delete_key(self.key(name, self.index - 1))
        parts = [p for p in news.split(",") if p]
        signalled = sorted({int(p[1:]) for p in parts if p.startswith("s")})
        return Said(signalled, total / self.size / 1e6, "r" in parts)


class OverGroup:
    """One exchange as an all-reduce (MAX) on a gloo group of every rank, for a world nbdist did not form."""

    __slots__ = ("buf", "size", "work")

    def __init__(self, group: Any, rank: int, size: int, asked: bool, per_step_us: int, resize: bool) -> None:
        import torch

        from . import control

        self.size = size
        self.buf = torch.zeros(size + 2, dtype=torch.int64)
        self.buf[rank] = int(asked)
        self.buf[size] = per_step_us
        self.buf[size + 1] = int(resize)
        self.work = control.start_max(group, self.buf)

    def read(self) -> Said:
        from . import control

        control.wait(self.work)  # a signal still reaches this thread: gloo's own wait can outlast a broken world
        values = self.buf.tolist()
        return Said([r for r, f in enumerate(values[: self.size]) if f], values[self.size] / 1e6, bool(values[-1]))


def world() -> Any:
    """What names this rank's world for the exchanges: the forming (its prefix and its groups' timeout), or the
    preemption flags' group (made here on first use, by every rank at the same point)."""
    if STATE.store is not None and STATE.forming is not None:
        return STATE.forming
    from . import control

    return control.control_group("preempt")


def start(of: Any, index: int, asked: bool, per_step_us: int, resize: bool) -> OverStore | OverGroup:
    """Say this rank's part of exchange ``index`` of world ``of`` (``world()``); read it with ``.read()``."""
    import torch.distributed as dist

    rank, size = dist.get_rank(), dist.get_world_size()
    if isinstance(of, tuple):
        exchange = OverStore(STATE.store, of[0], of[1], index, rank, size)
        exchange.say(asked, per_step_us, resize)
        return exchange
    return OverGroup(of, rank, size, asked, per_step_us, resize)
