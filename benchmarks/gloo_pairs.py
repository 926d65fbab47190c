"""Issue 52 names gloo's lazy pairs (``TORCH_GLOO_LAZY_INIT=1``: a pair of ranks connects at its first message
instead of every pair at the group's making) as a way to re-form a group faster. This measures it on plain torch,
as the reference: n processes forked on this host (``OMP_NUM_THREADS=1``), a TCPStore on rank 0, the gloo group
made, then two all-reduces of 1,000 floats; the slowest rank's time for each part. Four ways alternated: eager and
lazy, each as torch is called (every rank makes the group as soon as it can) and with every rank arrived first, as
nbdist's ``join_world`` does (engine/group.py, ``arrive``: a count in the store, outside the time).

``--peer-dies`` times pytorch/gloo#520's case instead, the one a recovery meets if nbdist's groups were lazy: every
rank makes the world and a group of every rank (``new_group``), passes a barrier of the world, and then the last
rank exits before the group's first collective; each living rank's all-reduce on the group is timed until it fails,
against the group's timeout (``--group-timeout``). Eager pairs fail at once (the dead peer's connection resets);
lazy ones wait for a pair that never connects, up to five times the timeout (gloo's ``Connect timeout``, pair.h),
where nbdist's release, which shuts the group's connections, has none to shut.

    python benchmarks/gloo_pairs.py [--ranks 8,32,64] [--rounds 2]
    python benchmarks/gloo_pairs.py --peer-dies [--ranks 2,4] [--group-timeout 2]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _common import alternated, save  # noqa: E402

from nbdist.forecast.comm import gloo_world  # noqa: E402

HANG_S = 300
WAYS = ["eager", "lazy", "eager, all arrived", "lazy, all arrived"]


def rank_main(rank: int, port: int, answers, n: int, way: str) -> None:
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1" if way.startswith("lazy") else "0"
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, n, rank == 0, timeout=datetime.timedelta(seconds=HANG_S))
    if way.endswith("arrived"):
        if store.add("arrived", 1) == n:
            store.set("all-arrived", "1")
        store.wait(["all-arrived"])
    tic = time.perf_counter()
    dist.init_process_group("gloo", store=store, rank=rank, world_size=n, timeout=datetime.timedelta(seconds=HANG_S))
    made = time.perf_counter()
    x = torch.ones(1000)
    dist.all_reduce(x)
    first = time.perf_counter()
    dist.all_reduce(x)
    second = time.perf_counter()
    answers.put((made - tic, first - made, second - first))
    # Every rank done before any leaves, counted in the store (a gloo barrier would connect lazy pairs anew), and rank
    # 0, which serves the store, leaves last.
    store.add("done", 1)
    while rank == 0 and int(store.add("done", 0)) < n:
        time.sleep(0.01)
    dist.destroy_process_group()


def one_group(n: int, way: str) -> dict[str, float]:
    """One group of ``n`` forked processes made ``way``: the slowest rank's times."""
    rows = gloo_world(rank_main, n, (n, way), timeout=HANG_S, answers=n, start="fork")
    made, first, second = (max(r[i] for r in rows) * 1e3 for i in range(3))
    return {"group_made_ms": made, "first_all_reduce_ms": first, "second_all_reduce_ms": second, "both_ms": made + first}


def dying_rank(rank: int, port: int, answers: Any, n: int, lazy: bool, timeout_s: float) -> None:
    """gloo#520's case on one rank: the last rank exits before the group's first collective; the others time their
    all-reduce on it until it fails (or returns)."""
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1" if lazy else "0"
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, n, rank == 0, timeout=datetime.timedelta(seconds=HANG_S))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=n, timeout=timeout)
    group = dist.new_group(backend="gloo", timeout=timeout)
    dist.barrier()
    if rank == n - 1:
        os._exit(0)  # not rank 0, which serves the store (as in nbdist's worlds)
    time.sleep(0.5)  # the peer is gone before the first collective
    tic = time.perf_counter()
    try:
        dist.all_reduce(torch.ones(1), group=group)
        error = ""
    except Exception as exc:  # noqa: BLE001 - what gloo raises is the measurement
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    answers.put((rank, time.perf_counter() - tic, error))
    answers.close()
    answers.join_thread()  # the answer is written before os._exit below, which would drop the queue's buffer
    store.add("done", 1)  # rank 0 serves the store: it leaves once every living rank has answered
    while rank == 0 and int(store.add("done", 0)) < n - 1:
        time.sleep(0.01)
    os._exit(0)  # freeing a group with a broken pair may wait in gloo: this measures the failure only


def peer_dies(n: int, lazy: bool, timeout_s: float) -> dict[str, Any]:
    """gloo#520's case at ``n`` ranks: each living rank's seconds until its all-reduce failed, its error, and the
    ranks still waiting at the guard (12 times the group's timeout), which are then ended."""
    rows = gloo_world(dying_rank, n, (n, lazy, timeout_s), timeout=12 * timeout_s, answers=n - 1, start="fork", partial=True)
    waited = [s for _, s, _ in rows]
    return {
        "ranks": n,
        "pairs": "lazy" if lazy else "eager",
        "group_timeout_s": timeout_s,
        "slowest_s": max(waited, default=None),
        "over_timeout": max(waited, default=0.0) / timeout_s,
        "errors": sorted({e for _, _, e in rows}),
        "still_waiting": n - 1 - len(rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", default="8,32,64")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--peer-dies", action="store_true", help="time gloo#520's case, eager and lazy")
    parser.add_argument("--group-timeout", type=float, default=2.0)
    args = parser.parse_args()
    result: dict[str, object] = {}
    if args.peer_dies:
        for n in [int(x) for x in args.ranks.split(",") if x]:
            for lazy in (False, True):
                got = peer_dies(n, lazy, args.group_timeout)
                result[f"{n} {got['pairs']}"] = got
                print(
                    f"{n:3} ranks, {got['pairs']:5} pairs, the last rank gone: the slowest living rank failed after "
                    f"{got['slowest_s'] or 0:.1f} s ({got['over_timeout']:.1f}x the group's {args.group_timeout:g} s); "
                    f"{got['still_waiting']} still waiting; {'; '.join(got['errors'])}",
                    flush=True,
                )
        save("gloo_pairs_peer_dies", result)
        return
    for n in [int(x) for x in args.ranks.split(",") if x]:

        rows = alternated(WAYS, args.rounds, lambda way, n=n: one_group(n, way))
        result[str(n)] = rows
        for way, samples in rows.items():
            med = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
            runs = ", ".join(f"{s['both_ms']:.0f}" for s in samples)
            print(
                f"{n:3} ranks, {way:18}: group made {med['group_made_ms']:8.0f} ms, first all-reduce "
                f"{med['first_all_reduce_ms']:7.0f} ms, both {med['both_ms']:7.0f} ms, second all-reduce "
                f"{med['second_all_reduce_ms']:6.0f} ms  (runs: {runs} ms)",
                flush=True,
            )
    save("gloo_pairs", result)


if __name__ == "__main__":
    main()
