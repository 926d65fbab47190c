"""What the preemption flags' exchange over the world's store (engine/flags.py) costs the rank that serves the store,
at 64 to 1,024 ranks (#52).

Over the store, every rank's part and read are requests to one server: rank 0's TCPStore, a thread of rank 0's own
process. A world at 1,024 ranks does not fit this machine, but the store's side of the exchange does: this runs a
TCPStore server in a process of its own (as rank 0 holds it) and ``n`` clients, one connection each (as each rank holds
one), spread over a few client processes, which say and read the exchanges with nbdist's own ``flags.OverStore``
(no copy of it), in lockstep as a DDP loop's ranks are. The server process does nothing else, so its CPU time (from
/proc) is the store's cost. Per size: the server's CPU per exchange and per rank, and the
share of one core the store takes at one exchange each ``INTERVAL_S`` (the period up to 256 ranks: preempt.period), which rank 0's training
loses (every rank then waits for rank 0). ``--at-once``: each rank a thread of its own, a process's ranks saying
and reading at the same moment (as ranks in lockstep do), and each rank's time to say and to read (median and 99th
percentile): how long a rank's main thread waits its turn. JSON under results/store_load.json
(results/store_load_at_once.json).

    python benchmarks/store_load.py [--ranks 64,256,1024] [--exchanges 30] [--procs 8] [--rounds 3] [--at-once]
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import statistics
import threading
import time
from typing import Any

from _common import save

INTERVAL_S = 0.5  # engine/preempt.py's target time between two exchanges
PREFIX = "bench/"
TIMEOUT_S = 120.0


def cpu_s(pid: int) -> float:
    """The user and system CPU seconds process ``pid`` has used, its threads' included."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def serve(port: Any, ready: Any, stop: Any) -> None:
    """Rank 0's store, alone in this process, as nbdist opens it (engine/group.py's ``open_store``: a socket bound to
    127.0.0.1 alone, handed to torch's TCPStore server, libuv, torch's default); its port to ``port``."""
    from torch.distributed import TCPStore

    from nbdist.launch import net

    listener = net.listen_on("127.0.0.1")
    port.value = listener.getsockname()[1]
    store = TCPStore(
        "127.0.0.1", port.value, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60),
        master_listen_fd=listener.detach(),
    )
    ready.set()
    stop.wait()
    del store


def ranks(port: int, first: int, count: int, size: int, exchanges: int, barrier: Any, out: Any, at_once: bool) -> None:
    """Ranks ``first`` to ``first + count - 1`` of ``size``, each with a store connection of its own: ``exchanges``
    exchanges, each said by every rank, then read by every rank (after a barrier of the client processes: the ranks'
    step between two boundaries), as ``loader.steps()`` does. ``at_once``: each rank a thread of its own (a store
    request lets go of the GIL), all of a process's ranks saying, then reading, at the same moment, as ranks in lockstep
    do; each rank's time to say and to read goes to ``out``. Otherwise one after the other."""
    os.environ["OMP_NUM_THREADS"] = "1"
    from torch.distributed import TCPStore

    from nbdist.engine import flags
    from nbdist.engine.state import STATE

    STATE.update(forming=(PREFIX, TIMEOUT_S), aborted=False)
    stores = [
        TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=TIMEOUT_S)) for _ in range(count)
    ]
    STATE.update(store=stores[0])
    said: list[Any] = [None] * count
    waits: dict[str, list[float]] = {"say": [], "read": []}

    def say(i: int, index: int) -> None:
        tic = time.perf_counter()
        said[i] = _say(flags.OverStore(stores[i], PREFIX, TIMEOUT_S, index, first + i, size), first + i, index)
        waits["say"].append(time.perf_counter() - tic)

    def read(i: int, index: int) -> None:
        tic = time.perf_counter()
        what = said[i].read()
        waits["read"].append(time.perf_counter() - tic)
        assert what.signalled == ([index % size] if index % 7 == 3 else []), (index, what)

    local = threading.Barrier(count + 1)

    def rank(i: int) -> None:
        for index in range(exchanges):
            local.wait()
            say(i, index)
            local.wait()
            local.wait()
            read(i, index)
            local.wait()

    threads = [threading.Thread(target=rank, args=(i,), daemon=True) for i in range(count)] if at_once else []
    for t in threads:
        t.start()
    barrier.wait()
    for index in range(exchanges):
        if at_once:
            local.wait()  # every rank of this process at the boundary: they say at once
            local.wait()
        else:
            for i in range(count):
                say(i, index)
        barrier.wait()  # the step: every rank said its part before any reads it
        if at_once:
            local.wait()
            local.wait()
        else:
            for i in range(count):
                read(i, index)
        barrier.wait()
    out.put((first, waits))


def _say(exchange: Any, rank: int, index: int) -> Any:
    # now and then one rank was signalled (news: one request more to say, one more to read, for every rank)
    exchange.say(index % 7 == 3 and rank == index % exchange.size, 1000 + rank, False)
    return exchange


def one_size(size: int, exchanges: int, procs: int, at_once: bool = False) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    ready, stop, shared = ctx.Event(), ctx.Event(), ctx.Value("i", 0)
    server = ctx.Process(target=serve, args=(shared, ready, stop), daemon=True)
    server.start()
    clients: list[Any] = []
    try:
        if not ready.wait(60):
            raise RuntimeError("the store did not start within 60 s")
        port = shared.value
        procs = min(procs, size)
        barrier, out = ctx.Barrier(procs + 1), ctx.Queue()
        per = [size // procs + (1 if p < size % procs else 0) for p in range(procs)]
        firsts = [sum(per[:p]) for p in range(procs)]
        clients = [
            ctx.Process(target=ranks, args=(port, firsts[p], per[p], size, exchanges, barrier, out, at_once), daemon=True)
            for p in range(procs)
        ]
        started = time.perf_counter()
        for c in clients:
            c.start()
        barrier.wait(timeout=300)  # every rank connected
        print(f"  {size} ranks connected in {time.perf_counter() - started:.1f} s", flush=True)
        pid = server.pid or 0
        cpu0, tic = cpu_s(pid), time.perf_counter()
        for _ in range(exchanges):
            barrier.wait(timeout=300)
            barrier.wait(timeout=300)
        seconds, cpu = time.perf_counter() - tic, cpu_s(pid) - cpu0
        got = sorted((out.get(timeout=60) for _ in clients), key=lambda part: part[0])
        assert [first for first, _ in got] == firsts, got
    finally:
        ended = time.perf_counter()
        stop.set()
        for c in clients:
            c.join(timeout=30)
            if c.is_alive():
                c.kill()
        server.join(timeout=30)
        if server.is_alive():
            server.kill()
        print(f"  stopped in {time.perf_counter() - ended:.1f} s", flush=True)
    per_exchange_ms = cpu / exchanges * 1e3
    say = sorted(w for _, waits in got for w in waits["say"])
    read = sorted(w for _, waits in got for w in waits["read"])
    return {
        "ranks": size,
        "say_median_ms": 1e3 * statistics.median(say),
        "say_p99_ms": 1e3 * say[int(0.99 * (len(say) - 1))],
        "read_median_ms": 1e3 * statistics.median(read),
        "read_p99_ms": 1e3 * read[int(0.99 * (len(read) - 1))],
        "server_cpu_ms_per_exchange": per_exchange_ms,
        "server_cpu_us_per_rank": per_exchange_ms * 1e3 / size,
        "core_share_at_interval": per_exchange_ms / 1e3 / INTERVAL_S,
        "wall_ms_per_exchange": seconds / exchanges * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", default="64,256,1024")
    parser.add_argument("--exchanges", type=int, default=30)
    parser.add_argument("--procs", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--at-once", action="store_true", help="each rank a thread: the ranks say and read at once")
    args = parser.parse_args()
    rows: dict[int, list[dict[str, float]]] = {}
    for r in range(args.rounds):
        for size in (int(s) for s in args.ranks.split(",")):
            row = one_size(size, args.exchanges, args.procs, args.at_once)
            rows.setdefault(size, []).append(row)
            print(
                f"round {r + 1}, {size:5} ranks: the store's CPU {row['server_cpu_ms_per_exchange']:.2f} ms an exchange "
                f"({row['server_cpu_us_per_rank']:.1f} us a rank), "
                f"{100 * row['core_share_at_interval']:.1f}% of a core at one exchange each {INTERVAL_S} s; "
                f"wall {row['wall_ms_per_exchange']:.0f} ms an exchange; a rank's say {row['say_median_ms']:.2f} ms "
                f"(99th percentile {row['say_p99_ms']:.2f}), its read {row['read_median_ms']:.2f} ms "
                f"({row['read_p99_ms']:.2f})",
                flush=True,
            )
    result = {
        size: {key: statistics.median(s[key] for s in samples) for key in samples[0]} for size, samples in rows.items()
    }
    print("medians:")
    for size, row in result.items():
        print(
            f"  {size:5} ranks: {row['server_cpu_ms_per_exchange']:.2f} ms of the store's CPU an exchange, "
            f"{row['server_cpu_us_per_rank']:.1f} us a rank, {100 * row['core_share_at_interval']:.1f}% of a core"
        )
    save(
        "store_load_at_once" if args.at_once else "store_load",
        {"sizes": result, "rounds": rows, "exchanges": args.exchanges, "interval_s": INTERVAL_S, "at_once": args.at_once},
    )


if __name__ == "__main__":
    main()
