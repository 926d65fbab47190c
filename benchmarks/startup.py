"""Start-up: `%dist_start -n 2` until a cell can run a collective, against raw ipyparallel.

Raw: `ipyparallel.Cluster(n=2).start_and_connect_sync()`, then `init_process_group` by hand
on each engine and one all_reduce. nbdist: `%dist_start -n 2` through an IPython shell, then
one `%%distributed` all_reduce cell, in three situations:
- warm: the usual notebook, where `%load_ext nbdist` warmed two engines (nbdist.pool)
  a few seconds (THINK_S) before the user ran `%dist_start`;
- back-to-back: warming starts at the same moment as `%dist_start` (Run All);
- cold: no warm engines at all (NBDIST_WARM=0).
Alternated, median of N runs; JSON under results/.
"""

from __future__ import annotations

import argparse
import socket
import time

from _common import run_cell, save, shell, stats

COLLECTIVE = "t = torch.ones(1)\ndist.all_reduce(t)\nassert t.item() == 2.0"


def raw_once() -> float:
    import ipyparallel as ipp

    tic = time.perf_counter()
    cluster = ipp.Cluster(n=2, log_level=40)
    try:
        rc = cluster.start_and_connect_sync()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        view = rc[:]
        view.scatter("rank", [0, 1], flatten=True, block=True)
        view.execute(
            "import os, torch, torch.distributed as dist\n"
            f"os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT='{port}', WORLD_SIZE='2', RANK=str(rank))\n"
            "dist.init_process_group('gloo')\n" + COLLECTIVE,
            block=True,
        )
        took = time.perf_counter() - tic
        view.execute("dist.destroy_process_group()", block=True)
        rc.close()
        return took
    finally:
        cluster.stop_cluster_sync()


THINK_S = 4.0  # seconds between `%load_ext nbdist` and `%dist_start` in the warm case


def nbdist_once(ip, mode: str) -> tuple[float, dict]:
    import nbdist
    from nbdist import pool
    from nbdist.config import default_threads

    pool.shutdown()
    if mode == "warm":
        pool.warm(2, default_threads(2))
        time.sleep(THINK_S)
    tic = time.perf_counter()
    if mode == "back-to-back":
        pool.warm(2, default_threads(2))
    try:
        run_cell(ip, "%dist_start -n 2")
        run_cell(ip, "%%distributed\n" + COLLECTIVE)
        took = time.perf_counter() - tic
        return took, dict(nbdist.current().startup)
    finally:
        run_cell(ip, "%dist_stop")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("-n", "--runs", type=int, default=5)
    args = parser.parse_args()
    ip = shell()
    modes = ("warm", "back-to-back", "cold")
    raw: list[float] = []
    ours: dict[str, list[float]] = {m: [] for m in modes}
    phases: dict[str, list[dict]] = {m: [] for m in modes}
    for i in range(args.runs):
        raw.append(raw_once())
        line = f"run {i + 1}: raw ipyparallel {raw[-1]:.2f} s"
        for mode in modes:
            took, phase = nbdist_once(ip, mode)
            ours[mode].append(took)
            phases[mode].append(phase)
            line += f"   {mode} {took:.2f} s"
        print(line, flush=True)
    r = stats(raw)
    o = {m: stats(ours[m]) for m in modes}
    ratio = {m: o[m]["median"] / r["median"] for m in modes}
    print(f"\nmedian raw ipyparallel + init_process_group: {r['median']:.2f} s")
    for m in modes:
        print(f"median %dist_start -n 2 + first collective, {m:>12}: {o[m]['median']:.2f} s  ({ratio[m]:.2f}x of raw)")
    w = o["warm"]["median"]
    print(
        f"targets (warm, the usual notebook): <= 2.0 s -> {'met' if w <= 2.0 else 'NOT met'}; "
        f"<= 0.25x raw -> {'met' if ratio['warm'] <= 0.25 else 'NOT met'}"
    )
    save(
        "startup",
        {"raw_ipyparallel_s": r, "nbdist_s": o, "ratio": ratio, "think_s": THINK_S, "nbdist_phases": phases},
    )


if __name__ == "__main__":
    main()
