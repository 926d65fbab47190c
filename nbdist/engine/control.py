"""nbdist's own process groups on a rank: gloo groups beside the training's, one per purpose.

``world`` records the connections of the groups it forms so the watcher can shut them down
(``group.abort_world``); the groups made here join that list. Nothing here imports the rest of
the engine but its state, so ``preempt`` and ``parallel.checkpoint`` can use it from below.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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

    def make(other: int) -> None:
        low, high = sorted((rank, other))
        store = dist.PrefixStore(f"{prefix}{purpose}/{low}-{high}/", STATE.store)
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
    import torch.distributed as dist

    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp(dist.ReduceOp.MAX)
    asked = {id(pair.group): (pair.group, torch.tensor([value], dtype=torch.int64)) for pair in pairs}
    for work in [group.allreduce([tensor], opts) for group, tensor in asked.values()]:
        work.wait()
    first, second = (int(asked[id(pair.group)][1].item()) for pair in pairs)
    return first, second


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


def aside(work: Any) -> tuple[threading.Event, list[BaseException]]:
    """Wait for ``work`` on a thread of its own: an event set when the wait ends, and the error it raised, if any.
    A caller that stops waiting (an interrupt, its world replaced) leaves the thread waiting until the old group's
    connections break or its timeout passes; a gloo send or receive is waited for once only, so the thread's wait
    is the only one."""
    done, failed = threading.Event(), []

    def run() -> None:
        try:
            work.wait()
        except BaseException as exc:  # noqa: BLE001 - said by the waiting caller
            failed.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, name="nbdist-wait", daemon=True).start()
    return done, failed


Ends = tuple[tuple[str, int], tuple[str, int]]  # a TCP connection's local and remote (address, port)


def tcp_connections() -> dict[int, Ends]:
    """This process's connected TCP sockets: file descriptor -> its two ends, asked of each socket among its own file
    descriptors. (psutil reads the host's whole table, /proc/net/tcp, to find a process's own: 74 ms against 3 ms
    for a rank's 130 sockets among 4,000 on the host, and at 64 ranks every rank reads it at once, three times in a
    recovery.)"""
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:  # no /proc (not Linux)
        return _from_psutil()
    found = {}
    for fd in fds:
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
        except OSError:  # closed since
            continue
        ends = ends_of(fd)
        if ends is not None:
            found[fd] = ends
    return found


def ends_of(fd: int) -> Ends | None:
    """The two ends of the connected TCP socket ``fd``; None when ``fd`` is no such socket (closed, another kind)."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        return _ends(sock)
    finally:
        sock.detach()  # the fd stays open: it is the group's


def shut(fd: int, ends: Ends) -> bool:
    """Shut both ways the TCP connection ``fd`` if it still has these ends (else the number was closed and given to
    another socket since: not the group's any more); whether it was shut."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return False
    try:
        if _ends(sock) != ends:
            return False
        sock.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        sock.detach()


def _ends(sock: socket.socket) -> Ends | None:
    if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    try:
        return tuple(sock.getsockname()[:2]), tuple(sock.getpeername()[:2])  # type: ignore[return-value]
    except OSError:  # not connected
        return None


def _from_psutil() -> dict[int, Ends]:
    import psutil

    return {
        c.fd: (tuple(c.laddr), tuple(c.raddr))  # type: ignore[misc]
        for c in psutil.Process().net_connections("tcp")
        if c.status == psutil.CONN_ESTABLISHED and c.fd >= 0 and c.raddr
    }


def added(before: dict[int, Ends], after: dict[int, Ends]) -> dict[int, Ends]:
    """The connections a process group made: new since ``before``, and not to a peer this process was connected to
    already. The engine's own sockets (ipyparallel's, through zmq's I/O thread) can connect again at any moment, to
    the controller's ports they had before; one that did so while a group formed is not the group's, and shutting
    it would lose the rank's reply to the cell (it happened: 'its cell over, no reply sent'). On the rank that serves
    the rendezvous store, the ranks' connections to it come while the group forms; they are the store's, which
    outlives the group (group.join_world), and shutting them would break every rank's next forming."""
    known = {ends[1] for ends in before.values()}
    served = STATE.store_at[1] if STATE.store_at is not None and STATE.store_at[2] else None
    return {
        fd: ends
        for fd, ends in after.items()
        # new: a number an earlier socket had (closed while the group formed) counts by its ends
        if before.get(fd) != ends and ends[1] not in known and ends[0][1] != served  # nor the store's: outlives it
    }
