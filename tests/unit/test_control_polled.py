"""``control.polled`` (engine/control.py): the world's store as a group made on a thread sees it. A torch store
client serves one request at a time, and a wait holds it until its keys come: a thread making a group that waits
there for a rank that died would hold every other use of the store on its rank (the next forming's included) for the
group's timeout. Here a real two-rank gloo group is made on a thread, on a real TCPStore, and its second rank never
comes: the same client must still answer the main thread at once, and the thread must give up once the world is
broken (``STATE.aborted``, as the watcher sets it)."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch.distributed as dist

from nbdist.engine import control
from nbdist.engine.state import STATE

TIMEOUT_S = 20.0  # the group's timeout: a wait that held the client would hold the main thread's set this long
# (a bound on a hang, that one: the set takes a round trip)


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=30))
    client = dist.TCPStore("127.0.0.1", server.port, 1, is_master=False, timeout=datetime.timedelta(seconds=30))
    kept = STATE.store, STATE.aborted
    STATE.store, STATE.aborted = client, False
    try:
        yield client
    finally:
        STATE.store, STATE.aborted = kept
        control.forget()  # as leaving a world does: the store is this test's alone


def making(store: dist.Store) -> tuple[threading.Thread, list[BaseException]]:
    """Rank 0 of a two-rank gloo group, made on a thread of its own; rank 1 never comes."""
    failed: list[BaseException] = []

    def make() -> None:
        try:
            dist.ProcessGroupGloo(dist.PrefixStore("flags/", store), 0, 2, datetime.timedelta(seconds=TIMEOUT_S))
        except BaseException as exc:  # noqa: BLE001 - read by the test
            failed.append(exc.with_traceback(None))  # no cycle through this frame: the store goes with the test

    thread = threading.Thread(target=make, daemon=True)
    thread.start()
    return thread, failed


def test_a_group_made_on_a_thread_for_a_rank_that_never_comes_leaves_the_store_to_the_others(store):
    thread, failed = making(control.polled(dist.group.WORLD, TIMEOUT_S))
    thread.join(0.5)  # rank 0 published its address and waits for rank 1's
    assert thread.is_alive() and not failed, failed
    tic = time.monotonic()
    store.set("the next forming", "here")  # the main thread's own use of the same client
    held = time.monotonic() - tic
    assert held < TIMEOUT_S / 2, f"the main thread's set waited {held:.1f} s, for the making thread's wait to end"
    assert thread.is_alive() and not failed, failed
    assert store.get("the next forming") == b"here"
    STATE.aborted = True  # the watcher broke the world
    thread.join(5.0)  # bounds a hang only
    assert not thread.is_alive(), "the making thread went on waiting for a broken world's rank"
    assert failed and "left or broken" in str(failed[0]), failed


def test_two_groups_made_at_once_on_one_client_do_not_hold_each_other(store):
    """Both ranks of a real two-rank group, each on a thread of this process, through one polled store client, the
    second 0.3 s after the first: made, and they all-reduce. ``pair_groups`` makes a rank's two pairs so, at once on
    one client; a thread whose wait held the client (for the other rank's address) would keep the other thread from
    publishing its own, which the other rank of its pair waits for: here rank 0 would wait, holding the client, for
    the address rank 1 cannot publish, until the group's timeout."""
    import torch

    made: dict[int, object] = {}

    def make(rank: int) -> None:
        time.sleep(0.3 * rank)
        made[rank] = dist.ProcessGroupGloo(
            dist.PrefixStore("pair/", control.polled(dist.group.WORLD, TIMEOUT_S)), rank, 2, datetime.timedelta(seconds=TIMEOUT_S)
        )

    threads = [threading.Thread(target=make, args=(rank,), daemon=True) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S)  # bounds a hang only
    assert sorted(made) == [0, 1]
    values = {rank: torch.tensor([rank + 5]) for rank in (0, 1)}
    works = [control.start_max(made[rank], values[rank]) for rank in (0, 1)]
    for work in works:
        work.wait()
    assert [int(v.item()) for v in values.values()] == [6, 6]
