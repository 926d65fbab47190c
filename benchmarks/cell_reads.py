"""What the notebook reads of each rank on a cell's path, as shipped against as before (issue 52):

- a cell's start asks which ranks are dead (``EngineSet.dead_ranks``): a read of /proc for every rank on this host,
  timed here, not changed (asking the kernel through the ranks' pidfds instead was tried: a pidfd is ready only once
  every thread of the process is gone, and /proc shows the process dead before that, so a rank killed and seen gone
  could still count as alive; docs/scaling.md, session 35);
- a reply is read three times (the IO thread as it comes, again once its output is in, and in ``replies.collect``):
  before, each read asked its future whether it was done, its exception and its result (a lock each); now an ok reply
  is read from its metadata alone (``replies.error_of``).

1. On a live world a size, each read timed alone (the medians of 7 runs of 300, the main thread's CPU).
2. The same world, nbdist's trivial cell in rounds alternated between the two ways (``before``: the old reading of a
   reply put back), timed as benchmarks/many_ranks.py times a cell. The watch's end
   also no longer waits on the output of a rank it already saw all in; that part is in both ways.

    python benchmarks/cell_reads.py [--ranks 16,64] [--rounds 6] [--reps 11]
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

from _common import medians, save, sizes_parser  # noqa: E402
from many_ranks import cells_alternated, shown, world  # noqa: E402

import nbdist  # noqa: E402
from nbdist import compat  # noqa: E402
from nbdist.cells import replies  # noqa: E402

SHIPPED = replies.error_of


def error_of_before(child: Any) -> BaseException | None:
    """``replies.error_of`` as it was: the future asked three times, whatever the reply said."""
    if not child.done():
        return None
    exc = child.exception()
    if exc is not None:
        return exc
    res = child.result()
    if isinstance(res, BaseException):
        return res
    err = child.output.metadata.get("error")
    return err if isinstance(err, BaseException) else None


def way(before: bool) -> None:
    """Put the reads back as they were (``before``), or as shipped."""
    replies.error_of = error_of_before if before else SHIPPED


def cpu_us(fn, number: int = 300) -> float:
    """The main thread's CPU a call, in microseconds (median of 7 runs)."""
    runs = []
    for _ in range(7):
        tic = time.thread_time()
        for _ in range(number):
            fn()
        runs.append((time.thread_time() - tic) / number * 1e6)
    return statistics.median(runs)


def reads(cluster: nbdist.Cluster) -> dict[str, float]:
    shown(cluster, "x = 1")  # the ranks' processes followed from a cell on, as in a session
    view = cluster.view(list(range(cluster.world_size)))
    ar = view.execute("x = 1", silent=False, block=False)
    ar.wait()
    ar.wait_for_output()
    children = compat.async_result_children(ar)  # each rank's reply, as the watch reads them
    out = {}
    out["dead_ranks_us"] = cpu_us(cluster.dead_ranks)
    for name, before in (("before", True), ("shipped", False)):
        way(before)
        out[f"reply_reads_us_{name}"] = cpu_us(lambda: [replies.error_of(c) for c in children])
    way(False)
    return out


def one_size(n: int, rounds: int, reps: int) -> dict[str, Any]:
    with world(n) as cluster:
        timed = reads(cluster)
        ways = {"shipped": lambda: way(False), "before": lambda: way(True)}
        return {"reads": timed, "cells": medians(cells_alternated(cluster, ways, rounds, reps))}


def main() -> None:
    parser = sizes_parser("16,64", rounds=6)
    args = parser.parse_args()
    result: dict[str, Any] = {}
    for n in [int(x) for x in args.ranks.split(",") if x]:
        result[str(n)] = row = one_size(n, args.rounds, args.reps)
        r = row["reads"]
        print(
            f"{n:3} ranks: dead_ranks {r['dead_ranks_us']:.0f} us; every "
            f"reply read once {r['reply_reads_us_before']:.0f} -> {r['reply_reads_us_shipped']:.0f} us (three reads a cell)",
            flush=True,
        )
        for name, m in row["cells"].items():
            print(
                f"{n:3} ranks, {name:8} nbdist cell {m['nbdist_cell_ms']:7.2f} ms  view.execute "
                f"{m['view_execute_ms']:7.2f} ms  ratio {m['ratio']:.3f}  notebook CPU {m['notebook_cpu_ms']:.2f} ms "
                f"(view.execute {m['notebook_cpu_view_execute_ms']:.2f} ms)",
                flush=True,
            )
    save("cell_reads", result)


if __name__ == "__main__":
    main()
