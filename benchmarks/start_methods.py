"""How ranks are made (#55): ``nbdist.start(n, start=fork|forkserver|spawn)`` until a collective ran, alternated in
one run, at 2, 16 and 64 ranks (oversubscribed on this machine).

- fork: the ranks are forked from the warm process, begun SETTLE_S before the start (``%load_ext nbdist`` while
  the user types);
- forkserver: the start begins a fork server of its own (a fresh Python importing torch and ipyparallel's engine,
  beside the controller) and forks the ranks from it; the warm process is there too, unused;
- spawn: every rank a fresh Python importing torch (up to ``--spawn-max`` ranks: 64 of them take minutes here).

The goal: 64 ranks under forkserver within 1.5x of the warm fork. Medians; JSON under results/start_methods.json.
"""

from __future__ import annotations

import argparse
import statistics
import time

from _common import save

import nbdist
from nbdist.config import default_threads
from nbdist.launch import pool

METHODS = ("fork", "forkserver", "spawn")
SETTLE_S = 4.0


def once(n: int, method: str) -> tuple[float, float]:
    """(seconds from the start to a collective's result, seconds %dist_stop took)."""
    pool.shutdown()
    pool.warm(n, default_threads(n))
    time.sleep(SETTLE_S)
    tic = time.perf_counter()
    cluster = nbdist.start(n=n, start=method, oversubscribe=True, timeout=300)
    try:
        cluster.run(f"t = torch.ones(1)\ndist.all_reduce(t)\nassert t.item() == {n}.0").raise_for_error()
        took = time.perf_counter() - tic
    finally:
        tic = time.perf_counter()
        cluster.stop()
        stop = time.perf_counter() - tic
        pool.shutdown()
    return took, stop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", default="2,16,64")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--spawn-max", type=int, default=16, help="the largest world started with spawn")
    args = parser.parse_args()
    sizes = [int(v) for v in args.ranks.split(",")]
    took: dict[str, list[float]] = {}
    for rep in range(args.reps):
        for n in sizes:
            line = f"rep {rep + 1}, {n} ranks:"
            for method in METHODS:
                if method == "spawn" and n > args.spawn_max:
                    continue
                start, _ = once(n, method)
                took.setdefault(f"{n}:{method}", []).append(start)
                line += f" {method} {start:.2f} s"
            print(line, flush=True)
    medians = {key: statistics.median(v) for key, v in took.items()}
    print()
    for n in sizes:
        fork = medians[f"{n}:fork"]
        row = " | ".join(f"{m} {medians[f'{n}:{m}']:.2f} s" for m in METHODS if f"{n}:{m}" in medians)
        print(
            f"{n:3d} ranks, median start to first collective: {row}; forkserver/fork {medians[f'{n}:forkserver'] / fork:.2f}x"
        )
    big = max(sizes)
    ratio = medians[f"{big}:forkserver"] / medians[f"{big}:fork"]
    print(
        f"goal: {big} ranks under forkserver within 1.5x of the warm fork -> {'met' if ratio <= 1.5 else 'NOT met'} ({ratio:.2f}x)"
    )
    save("start_methods", {"settle_s": SETTLE_S, "samples_s": took, "median_s": medians, "ratio_at_largest": ratio})


if __name__ == "__main__":
    main()
