"""Issue 52 names gloo's lazy pairs (``TORCH_GLOO_LAZY_INIT=1``: a pair of ranks connects at its first message
instead of every pair at the group's making) as a way to re-form a group faster. This measures it on plain torch,
as the reference: n processes forked on this host (``OMP_NUM_THREADS=1``), a TCPStore on rank 0, the gloo group
made, then two all-reduces of 1,000 floats; the slowest rank's time for each part. Four ways alternated: eager and
lazy, each as torch is called (every rank makes the group as soon as it can) and with every rank arrived first, as
nbdist's ``join_world`` does (engine/group.py, ``arrive``: a count in the store, outside the time).

    python benchmarks/gloo_pairs.py [--ranks 8,32,64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", default="8,32,64")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    result: dict[str, object] = {}
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
