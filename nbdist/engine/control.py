"""nbdist's own process groups on a rank: gloo groups beside the training's, one per purpose.

``world`` records the connections of the groups it forms so the watcher can shut them down
(``group.abort_world``); the groups made here join that list (``connections``). Nothing here imports the
rest of the engine but its state, so ``preempt`` and ``parallel.checkpoint`` can use it from below.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .connections import added, tcp_connections
from .state import STATE


def control_group(purpose: str) -> Any:
    """A gloo group of every rank for one of nbdist's own uses (``"preempt"``: the preemption flags;
    ``"checkpoint"``: checkpoint writes in the background): its collectives never pair with the
    training's, run beside them, and never touch a GPU.

    One group per purpose, because each is used from one thread: collectives on one group must come
    in the same order on every rank, which two threads sharing a group cannot promise. Made on first
    use, once per world; like any ``new_group``, every rank must ask at the same point of its program
    (the first preemption point, the first asynchronous save). Its connections join those the
    watcher shuts down to release a blocked rank (``abort_world``)."""
    import torch.distributed as dist

    return _kept(purpose, lambda: dist.new_group(backend="gloo"))


@dataclass(frozen=True, slots=True)
class Pair:
    """One side of an exchange between two ranks: its group, and the other rank's number in that group."""

    group: Any
    other: int


def pair_groups(purpose: str, to: int, source: int) -> tuple[Pair, Pair]:
    """Two-rank gloo groups for one of nbdist's own uses in which a rank talks to two others only (``"peer"``: its
    part to its buddy, its source's part to it): (this rank with ``to``, ``source`` with this rank), one group when
    the two are the same rank. A group of every rank (``control_group``) connects each rank to all the others: at 64
    ranks on 2 cores, 0.37-0.56 s of a rebuilt world's first step; a pair connects two.

    Made on first use, once per world, by every rank at the same point (its buddy and its source are each making
    theirs). Made directly on the store of the world nbdist formed, under keys of that forming, rather than with
    ``new_group(ranks, use_local_synchronization=True)``: torch names such a group by the ranks and by how many groups
    the process has, which a fresh rank and a living one do not share. Both pairs are made at once, on a thread
    each: one after the other, the pairs around a ring wait on each other for ever (each rank's first is its
    neighbour's second). A world nbdist did not form (no store of its own) gets one group of every rank instead, as
    both pairs. Their connections join those the watcher shuts down (``abort_world``)."""
    return _kept(purpose, lambda: _pairs(purpose, to, source))


def _pairs(purpose: str, to: int, source: int) -> tuple[Pair, Pair]:
    import datetime

    import torch.distributed as dist

    rank = dist.get_rank()
    if STATE.store is None or STATE.forming is None:
        group = dist.new_group(backend="gloo")
        return Pair(group, to), Pair(group, source)
    prefix, timeout = STATE.forming
    made: dict[int, Any] = {}
    failed: list[BaseException] = []
    shared = polled(dist.group.WORLD, timeout)

    def make(other: int) -> None:
        low, high = sorted((rank, other))
        store = dist.PrefixStore(f"{prefix}{purpose}/{low}-{high}/", shared)
        try:
            made[other] = dist.ProcessGroupGloo(store, int(rank == high), 2, datetime.timedelta(seconds=timeout))
        except BaseException as exc:  # noqa: BLE001 - raised below, on the asking thread
            failed.append(exc)

    threads = [threading.Thread(target=make, args=(other,), name="nbdist-pair", daemon=True) for other in {to, source}]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failed:
        raise failed[0]
    return Pair(made[to], int(to > rank)), Pair(made[source], int(source > rank))


def pair_max(pairs: tuple[Pair, Pair], value: int) -> tuple[int, int]:
    """For each of ``pairs``, the larger of ``value`` and the other rank's: both asked at once, since each other rank
    may be asking its own other pair first (one answer, twice, where the two pairs are one group)."""
    import torch

    asked = {id(pair.group): (pair.group, torch.tensor([value], dtype=torch.int64)) for pair in pairs}
    for work in [start_max(group, tensor) for group, tensor in asked.values()]:
        work.wait()
    first, second = (int(asked[id(pair.group)][1].item()) for pair in pairs)
    return first, second


def start_max(group: Any, tensor: Any) -> Any:
    """Start an all-reduce (MAX) of ``tensor`` in place on ``group``, without waiting: its work. Called on the group
    itself, which works for a group torch registered (``new_group``) and for one made directly (``pair_groups``),
    which ``dist.all_reduce`` refuses."""
    import torch.distributed as dist

    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp(dist.ReduceOp.MAX)
    return group.allreduce([tensor], opts)


def _kept(purpose: str, make: Callable[[], Any]) -> Any:
    """This world's groups for ``purpose``, made (``make``) on first use; their connections recorded for the watcher."""
    import torch.distributed as dist

    groups = STATE.control if STATE.control_of is dist.group.WORLD else {}
    if purpose not in groups:
        before = tcp_connections()
        groups[purpose] = make()
        STATE.update(control=groups, control_of=dist.group.WORLD)
        STATE.pg_fds = {**STATE.pg_fds, **added(before, tcp_connections())}
    return groups[purpose]


POLL_S = 0.02  # the longest a polled store waits between two looks for a key


def polled(world: Any, timeout: float) -> Any:
    """The world's store (``STATE.store``) for making groups on threads (``pair_groups``): its waits look for the keys (``check``)
    again and again instead of waiting for them, and give up once ``world`` is left or broken. A torch store client
    serves one request at a time, and a wait holds it until its keys come or its timeout passes: a thread waiting
    there for a rank that died would hold every other use of the store on this rank (the next forming's included)
    for the group's timeout, 30 minutes by default; and the two pairs ``pair_groups`` makes at once, on one client,
    could hold each other, each thread's wait holding the client the other needs to publish its address, which the
    other rank of its pair waits for. Looked at, it is held one round trip at a time.

    One per world and store, kept while they are this rank's: torch calls a store written in Python for as long as
    the Python object lives, and a group keeps only torch's side of it."""
    inner = STATE.store
    if not (_POLLED and _POLLED[0] is world and _POLLED[1] is inner):
        _POLLED[:] = [world, inner, _polled_type()(inner, world, timeout)]
    return _POLLED[2]


def _polled_type() -> type:
    """The class of ``polled``'s stores, made once torch is imported (a class made per call would be freed only by
    the garbage collector, with the connection it holds)."""
    if _POLLED_TYPE:
        return _POLLED_TYPE[0]
    import datetime

    import torch.distributed as dist

    class Polled(dist.Store):  # type: ignore[misc]
        def __init__(self, inner: Any, world: Any, timeout: float) -> None:
            super().__init__()
            self.inner, self.world, self.patience = inner, world, timeout
            self.came: set[str] = set()  # keys found (gloo waits for a key, then gets it: one look, not two)

        def set(self, key: str, value: Any) -> None:
            self.inner.set(key, value)

        def get(self, key: str) -> Any:
            if key not in self.came:
                self.wait([key])
            return self.inner.get(key)

        def add(self, key: str, value: int) -> int:
            return int(self.inner.add(key, value))

        def check(self, keys: list[str]) -> bool:
            return bool(self.inner.check(keys))

        def wait(self, keys: list[str], wait_s: datetime.timedelta | None = None) -> None:
            end = time.monotonic() + (self.patience if wait_s is None else wait_s.total_seconds())
            pause = 0.001
            while not self.inner.check(keys):
                if self.world is not dist.group.WORLD or STATE.aborted:
                    raise RuntimeError("nbdist: the world was left or broken while one of its groups was being made")
                if time.monotonic() > end:
                    raise TimeoutError(f"nbdist: store keys {keys} did not come within {self.patience:.0f} s")
                time.sleep(pause)
                pause = min(POLL_S, pause * 2)
            self.came.update(keys)  # only ever added to: a key is set once (a forming's prefix is its own)

    _POLLED_TYPE.append(Polled)
    return Polled


def forget() -> None:
    """This rank left its world (``group.leave_world``): the world's polled store goes with it."""
    _POLLED.clear()


_POLLED: list[Any] = []  # [world, store, the polled store over it] (``polled``)
_POLLED_TYPE: list[type] = []


def wait(work: Any) -> None:
    """Wait, on the main thread, for a collective of nbdist's own groups started with ``async_op`` (the preemption
    flags): as ``work.wait()``, but a signal still reaches the thread. gloo's wait is C++ that no signal
    interrupts, and it can last the group's timeout (30 minutes by default) where the world broke while this rank
    was sending (cells/release.py): a rank there could not stop at the release's interrupt, and nbdist ended it, 6 s
    later (64 ranks on 2 cores: 1 recovery in 4). A work not yet complete is therefore waited for on a thread of its
    own (``aside``); the main thread waits for that thread, which a KeyboardInterrupt ends."""
    if work.is_completed():
        work.wait()  # at once, or the collective's error
        return
    done, failed = aside(work)
    done.wait()
    if failed:
        raise failed[0]


def aside(*works: Any) -> tuple[threading.Event, list[BaseException]]:
    """Wait for ``works``, in turn, on a thread of its own: an event set when the wait ends, and the error it raised,
    if any. A caller that stops waiting (an interrupt, its world replaced) leaves the thread waiting until the old
    group's connections break or its timeout passes; a gloo send or receive is waited for once only, so the thread's
    wait is the only one."""
    done, failed = threading.Event(), []

    def run() -> None:
        try:
            for work in works:
                work.wait()
        except BaseException as exc:  # noqa: BLE001 - said by the waiting caller
            failed.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, name="nbdist-wait", daemon=True).start()
    return done, failed
