"""The preemption flags over the world's store (engine/flags.py), on a real TCPStore with a client per rank.

Every rank must read what the ranks said alike, and as the all-reduce on a real gloo group of as many ranks reads it
(the exchange a world nbdist did not form still uses): the ranks signalled and the resize asked, the same; the time per
step, the ranks' mean over the store against the slowest's over the group. A read before every rank said its part
waits, in Python: an interrupt reaches it, and it ends with an error once the world breaks. The store does not grow
with the exchanges. A world of hundreds of ranks exchanges less often (engine/preempt.py's ``period``)."""

from __future__ import annotations

import datetime
import signal
import threading
import time

import pytest
import torch.distributed as dist

from nbdist.engine import flags
from nbdist.engine.state import STATE

RANKS = 4
PREFIX = "nbdist-test/"
TIMEOUT_S = 30.0
SAID = {0: (False, 1000, False), 1: (False, 3000, True), 2: (True, 2000, False), 3: (False, 6000, False)}


@pytest.fixture
def clients():
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    made = [
        dist.TCPStore("127.0.0.1", server.port, 1, is_master=False, timeout=datetime.timedelta(seconds=TIMEOUT_S))
        for _ in range(RANKS)
    ]
    kept = STATE.values()
    STATE.update(store=made[0], forming=(PREFIX, TIMEOUT_S), aborted=False)
    try:
        yield server, made
    finally:
        STATE.update(**kept)


def exchange(client: dist.TCPStore, index: int, rank: int) -> flags.OverStore:
    return flags.OverStore(client, PREFIX, TIMEOUT_S, index, rank, RANKS)


def over_a_gloo_group() -> list[flags.Said]:
    """The same parts, all-reduced on a real gloo group of ``RANKS`` ranks (a thread each)."""
    store = dist.HashStore()
    read: dict[int, flags.Said] = {}

    def rank_(rank: int) -> None:
        group = dist.ProcessGroupGloo(store, rank, RANKS, datetime.timedelta(seconds=TIMEOUT_S))
        read[rank] = flags.OverGroup(group, rank, RANKS, *SAID[rank]).read()

    threads = [threading.Thread(target=rank_, args=(r,), daemon=True) for r in range(RANKS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S)  # bounds a hang only
    return [read[r] for r in range(RANKS)]


def test_every_rank_reads_what_the_ranks_said_as_the_gloo_all_reduce_reads_it(clients):
    _, made = clients
    for rank, client in enumerate(made):
        exchange(client, 0, rank).say(*SAID[rank])
    over_store = [exchange(client, 0, rank).read() for rank, client in enumerate(made)]
    over_group = over_a_gloo_group()
    assert over_store == [over_store[0]] * RANKS  # alike on every rank
    assert over_store[0].signalled == over_group[0].signalled == [2]
    assert over_store[0].resize is over_group[0].resize is True
    assert over_store[0].per_step == pytest.approx(3000e-6)  # the mean of 1, 3, 2 and 6 ms
    assert over_group[0].per_step == pytest.approx(6000e-6)  # the slowest rank's
    quiet = [exchange(client, 1, rank) for rank, client in enumerate(made)]
    for part in quiet:
        part.say(False, 500, False)
    assert all(part.read() == flags.Said([], 500e-6, False) for part in quiet)  # the next one: nobody signalled


def test_a_read_before_every_rank_said_its_part_waits_takes_an_interrupt_and_ends_once_the_world_broke(clients):
    _, made = clients
    for rank in range(RANKS - 1):  # the last rank never says its part
        exchange(made[rank], 0, rank).say(False, 1000, False)
    waiting = exchange(made[0], 0, 0)

    def interrupt() -> None:
        time.sleep(0.5)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # as the release interrupts a rank

    threading.Thread(target=interrupt, daemon=True).start()
    tic = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        waiting.read()
    assert 0.4 < time.monotonic() - tic < 5.0  # it waited, and the interrupt ended the wait (5 s bounds a hang)

    failed: list[BaseException] = []

    def read_on_a_thread() -> None:
        try:
            waiting.read()
        except BaseException as exc:  # noqa: BLE001 - read by the test
            failed.append(exc)

    thread = threading.Thread(target=read_on_a_thread, daemon=True)
    thread.start()
    thread.join(0.5)
    assert thread.is_alive() and not failed, failed  # still waiting for the last rank
    STATE.aborted = True  # the watcher broke the world
    thread.join(5.0)  # bounds a hang only
    assert not thread.is_alive(), "the read went on waiting in a broken world"
    assert failed and "broke while rank 0 waited" in str(failed[0]) and "3 of 4 ranks" in str(failed[0]), failed


def test_the_store_does_not_grow_with_the_exchanges(clients):
    server, made = clients
    sizes = []
    for index in range(60):
        parts = [exchange(client, index, rank) for rank, client in enumerate(made)]
        for rank, part in enumerate(parts):
            part.say(rank == 1 and index % 7 == 0, 1000, False)  # a line of news now and then
        for part in parts:
            part.read()
        sizes.append(server.num_keys())
    assert max(sizes) <= sizes[0], sizes  # the keys of one exchange (the first had a line of news), no more


def test_a_world_of_hundreds_of_ranks_exchanges_less_often_so_its_store_serves_no_more_than_at_256_ranks():
    from nbdist.engine import preempt

    # 10 ms a step: an exchange each 50 steps (0.5 s) up to 256 ranks; then in proportion to the ranks, up to 2 s
    sizes = (2, 64, 256, 512, 1024, 4096)
    assert [preempt.steps_between(0.01, n) for n in sizes] == [50, 50, 50, 100, 200, 200]
    assert [preempt.steps_between(5.0, n) for n in sizes] == [1] * 6  # a step longer than the period: every boundary
    assert preempt.steps_between(0.0, 1024) == 1  # no time said yet (the first exchange): the next boundary
