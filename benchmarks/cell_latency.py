"""Cell latency: a trivial `%%distributed` cell against raw `%%px`, same shell, same run.

Also measures recovery: how long until the next cell has run after (a) one rank raised while
the other waited in an all_reduce, and (b) Ctrl-C while both ranks were inside collectives.
"""

from __future__ import annotations

import argparse
import time

from _common import FAILURE_CELL, INTERRUPT_CELL, interrupted_cell, run_cell, save, shell, stats

NEXT = "%%distributed\nt = torch.ones(1)\ndist.all_reduce(t)"


def time_cells(ip, code: str, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        tic = time.perf_counter()
        run_cell(ip, code)
        out.append(time.perf_counter() - tic)
    return out


def recovery_after_failure(ip) -> float:
    tic = time.perf_counter()
    ip.run_cell(FAILURE_CELL, silent=True)
    run_cell(ip, NEXT)
    return time.perf_counter() - tic


def recovery_after_interrupt(ip) -> float:
    tic = time.perf_counter()
    interrupted_cell(ip, INTERRUPT_CELL)
    run_cell(ip, NEXT)
    return time.perf_counter() - tic - 0.5


def main() -> None:
    import ipyparallel as ipp

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    ip = shell()
    raw = ipp.Cluster(n=2, log_level=40)
    try:
        rc = raw.start_and_connect_sync(activate=True)
        run_cell(ip, "%dist_start -n 2")
        for code in ("%%px\nx = 1", "%%distributed\nx = 1"):  # warm up both paths
            time_cells(ip, code, 5)
        px, ours = [], []
        for _ in range(args.rounds):  # alternate blocks so drift hits both alike
            px += time_cells(ip, "%%px\nx = 1", args.reps)
            ours += time_cells(ip, "%%distributed\nx = 1", args.reps)
        fail = [recovery_after_failure(ip) for _ in range(5)]
        intr = [recovery_after_interrupt(ip) for _ in range(5)]
    finally:
        ip.run_cell("%dist_stop", silent=True)
        try:
            rc.close()
        except Exception:
            pass
        raw.stop_cluster_sync()
    p, o = stats(px), stats(ours)
    print(f"median trivial %%px cell:          {p['median'] * 1e3:.1f} ms")
    print(f"median trivial %%distributed cell: {o['median'] * 1e3:.1f} ms  ({o['median'] / p['median']:.2f}x of %%px)")
    f, i = stats(fail), stats(intr)
    print(f"failure on one rank -> next cell done: median {f['median']:.2f} s (max {f['max']:.2f})")
    print(f"Ctrl-C in a collective -> next cell done: median {i['median']:.2f} s (max {i['max']:.2f})")
    save(
        "cell_latency",
        {
            "px_s": p,
            "distributed_s": o,
            "ratio": o["median"] / p["median"],
            "recovery_after_failure_s": f,
            "recovery_after_interrupt_s": i,
        },
    )


if __name__ == "__main__":
    main()
