"""Start-up: `%dist_start -n 2` until a cell can run a collective, against raw ipyparallel.

Raw: `ipyparallel.Cluster(n=2).start_and_connect_sync()`, then `init_process_group` by hand
on each engine and one all_reduce. nbdist: `%dist_start -n 2` through an IPython shell, then
one `%%distributed` all_reduce cell. Alternated, median of N runs; JSON under results/.
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


def nbdist_once(ip) -> tuple[float, dict]:
    import nbdist

    tic = time.perf_counter()
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
    raw, ours, phases = [], [], []
    for i in range(args.runs):
        raw.append(raw_once())
        took, phase = nbdist_once(ip)
        ours.append(took)
        phases.append(phase)
        print(f"run {i + 1}: raw ipyparallel {raw[-1]:.2f} s   nbdist {ours[-1]:.2f} s   phases {phase}", flush=True)
    r, o = stats(raw), stats(ours)
    ratio = o["median"] / r["median"]
    print(f"\nmedian raw ipyparallel + init_process_group: {r['median']:.2f} s")
    print(f"median %dist_start -n 2 + first collective:  {o['median']:.2f} s  ({ratio:.2f}x of raw)")
    print(
        f"targets: <= 2.0 s -> {'met' if o['median'] <= 2.0 else 'NOT met'}; <= 0.25x raw -> {'met' if ratio <= 0.25 else 'NOT met'}"
    )
    save("startup", {"raw_ipyparallel_s": r, "nbdist_s": o, "ratio": ratio, "nbdist_phases": phases})


if __name__ == "__main__":
    main()
