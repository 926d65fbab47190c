"""The process group on one rank: the rendezvous store, joining, leaving and breaking it.

The client calls these through ipyparallel's apply (rendezvous.py); the watcher
(runtime.py) calls ``abort_world`` to free a rank blocked in a gloo collective.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from .. import compat
from ..launch import net
from . import collectives, connections, control, gpu, hosted, launched, preempt
from .state import STATE


def open_store(host: str, timeout: float) -> int:
    """On rank 0: start the rendezvous store on ``host`` (MASTER_ADDR), on a port the OS picks; return it.

    torch's own TCPStore listens on every interface whatever ``host`` says; the store gets a
    socket bound to ``host`` alone instead (``master_listen_fd``, as torch's elastic agent
    does): 127.0.0.1 for a world on this host, the interface the nodes share for several.
    Binding port 0 here, in the process that keeps the socket, leaves no window in which
    another program can take the port (docs/faults.md, row 6).
    """
    from torch.distributed import TCPStore

    if STATE.store is not None and STATE.store_at is not None and STATE.store_at[0] == host and STATE.store_at[2]:
        return STATE.store_at[1]  # the store this rank serves already: a world formed again uses a new prefix in it
    listener = net.listen_on(host)
    port = int(listener.getsockname()[1])
    store = TCPStore(
        host,
        port,
        STATE.world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout),
        master_listen_fd=listener.detach(),  # the store's server owns and closes it
    )
    STATE.update(store=store, store_at=(host, port, True))
    return port


def join_world(
    *,
    master_addr: str,
    port: int,
    backend: str,
    timeout: float,
    pg_timeout: float,
    gpu_index: int | None = None,
    debug: bool = False,
    restarts: int = 0,
    prefix: str = "",
) -> float:
    """Join the process group and prove it with one all_reduce; return its sum.

    Under nccl the rank first binds ``cuda:gpu_index`` (engine/gpu.py holds the rule).
    ``debug``: torch checks every collective across ranks first (engine/collectives.py).
    ``restarts``: how many times the world was restarted (torchrun's TORCHELASTIC_RESTART_COUNT).
    ``prefix``: this forming's keys in the store. A rank keeps its connection to the store while the store's
    address stays the same, so a world formed again (a rank replaced, the world shrunk or grown) connects only
    its new ranks to it. Each new connection costs a reverse DNS lookup of the store's address: torch names the
    socket's peer as it makes it (c10d's ``formatSockAddr``), and connects by IPv6 first, so 127.0.0.1 is looked up as
    ::ffff:127.0.0.1, which /etc/hosts does not answer; where the DNS server drops queries under load (this machine's
    does), a lookup waits 5 s, and 64 ranks connecting at once left a few waiting that long (docs/scaling.md,
    session 44)."""
    import torch
    import torch.distributed as dist
    from torch.distributed import PrefixStore, TCPStore

    rank, world_size = STATE.placed()
    cpu_only = backend == "gloo" and gpu_index is None
    launched.apply(launched.world_env(master_addr=master_addr, port=port, restarts=restarts, cpu_only=cpu_only))
    if rank != 0 and not master_addr.startswith("127."):
        reason = net.connect_error(master_addr, port, timeout=min(timeout, 10.0))
        if reason:
            raise ConnectionError(
                f"{socket.gethostname()} cannot reach MASTER_ADDR {master_addr}:{port} ({reason}): "
                f"{net.likely_fix(reason)}; open the port range between the nodes, or start with --ip on "
                "the interface the nodes share."
            )
    if STATE.store is None or STATE.store_at is None or STATE.store_at[:2] != (master_addr, port):
        STATE.store = TCPStore(
            master_addr,
            port,
            world_size,
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout),
        )
        STATE.store_at = (master_addr, port, False)
    store = PrefixStore(prefix, STATE.store) if prefix else STATE.store
    arrive(store, rank, world_size, timeout)
    before = connections.tcp_connections()
    kwargs: dict[str, Any] = {}
    device = torch.device("cpu")
    if backend == "nccl":
        device = gpu.bind(int(os.environ.get("LOCAL_RANK", "0")) if gpu_index is None else gpu_index)
        kwargs["device_id"] = device
    collectives.set_debug(debug)
    hosted.init_world(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=pg_timeout),
        **kwargs,
    )
    STATE.update(backend=backend, aborted=False, forming=(prefix, pg_timeout))
    probe = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(probe)
    STATE.pg_fds = connections.added(before, connections.tcp_connections())
    return float(probe.item())


def arrive(store: Any, rank: int, world_size: int, timeout: float) -> None:
    """Wait, in Python, until every rank of this forming came to it (the last to come says so in the store), before
    torch's own rendezvous waits in C++ for them: a rank that died before it came leaves the others here, where the
    notebook's interrupt (world/answers.py, ``wait_releasing``) ends the wait within 0.25 s instead of at the
    timeout. TimeoutError naming how many came."""
    import torch.distributed as dist

    if store.add("arrived", 1) == world_size:
        store.set("all-arrived", "1")
    deadline = time.monotonic() + timeout
    while True:
        try:
            store.wait(["all-arrived"], datetime.timedelta(seconds=0.25))
            return
        except dist.DistStoreError:  # its own timeout (the store cancels the wait): look again, or give up
            if time.monotonic() > deadline:
                came = store.add("arrived", 0)
                raise TimeoutError(
                    f"rank {rank}: {came} of {world_size} ranks came to form the process group within {timeout:.0f} s"
                ) from None


def leave_world() -> None:
    """Destroy this rank's process group, whatever state it is in (its connection to the store is kept for the
    next forming: ``join_world``)."""
    import torch.distributed as dist

    try:
        if dist.is_initialized():
            if STATE.aborted:
                keep_broken([dist.group.WORLD, *STATE.control.values()])
            hosted.destroy_world()
    except Exception:  # a broken group may refuse a clean destroy; drop it anyway
        pass
    STATE.update(pg_fds={}, backend=None, control={}, control_of=None, forming=None)
    control.forget()
    preempt.reset()


KEPT_BROKEN = 1  # broken worlds whose groups a rank keeps from being freed (keep_broken)
BROKEN: list[list[Any]] = []


def keep_broken(groups: list[Any]) -> None:
    """Keep the groups of a world this rank broke (``abort_world``) from being freed on this thread. torch frees a
    gloo group by joining its worker threads, and a worker can be left in a send after its connection was shut:
    gloo's TCP pair queues a send whose write failed (EPIPE) and, when it then reads the broken connection, tells
    every waiting operation but that one, which waits for the group's timeout (30 minutes by default). Freed as the
    world was left, that held the rank in ``leave_world`` (the preemption flags' all-reduce, in flight at the kill;
    32 ranks on 2 cores, 1 recovery in 32; the cell failed, and no rank had a group after it). The last broken
    world's groups are kept until the next world breaks, long after the setup cells replaced the objects that
    held them (a DDP model's reducer, whose freeing would join the workers too); then they are freed on a thread
    of their own, where a stuck worker holds nothing else. Not more: each kept group's gloo thread polls 100
    times a second (with 4 worlds kept, 32 ranks on 2 cores, a peer exchange failed twice in 30 recoveries: the
    load it added is the likely reason; parallel/peer.py's waits no longer fail that way)."""
    BROKEN.append(groups)
    while len(BROKEN) > KEPT_BROKEN:
        threading.Thread(target=BROKEN.pop(0).clear, name="nbdist-free-groups", daemon=True).start()


def leave_then(fn: Callable[..., Any] | None = None, *args: Any) -> Any:
    """``leave_world``, then ``fn(*args)`` (the forming's next step on this rank: its host asked, its store opened)
    in the same call, one round trip to the ranks instead of two (world/rendezvous.py, ``rejoin``)."""
    leave_world()
    return None if fn is None else fn(*args)


@contextmanager
def broken_on_error() -> Iterator[None]:
    """Collectives called on a rank outside a cell (a recovery's give or restore, through apply): when they fail
    here (a peer died meanwhile), break this rank's group too, so the ranks blocked on this one fail now rather
    than at the group's timeout (no release reaches an apply call)."""
    try:
        yield
    except BaseException:
        abort_world()
        raise


def abort_world() -> str:
    """Break this rank's process group so a collective blocked on it returns now."""
    STATE.aborted = True
    if STATE.backend == "nccl":
        try:
            compat.abort_process_group()
            return "nccl abort"
        except Exception as exc:  # pragma: no cover - GPU only
            return f"nccl abort failed: {exc}"
    closed = sum(connections.shut(fd, ends) for fd, ends in STATE.pg_fds.items())
    STATE.broke = (closed, len(STATE.pg_fds), time.time())  # said when the rank is ended for not stopping
    return f"closed {closed} gloo connections"
