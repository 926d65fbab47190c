"""Ranks on two Slurm nodes (tests/slurmnodes.py: two slurmd in network namespaces; root only).

1. Start until a collective runs, 2 ranks on 2 nodes: ``%dist_start --launcher slurm -n 2 --nodes 2``
   against raw ipyparallel (its Slurm engine launcher, then ``init_process_group`` by hand with what a
   careful user must set: rank from SLURM_PROCID, MASTER_ADDR, GLOO_SOCKET_IFNAME), alternating in
   one run. Targets: nbdist <= 0.5x raw and <= 6 s.
2. all_reduce bus bandwidth across the two nodes vs within one node, same run, several sizes. Each node's
   link runs at 1 Gb/s (tests/slurmnodes.LINK, since 2026-11-24; before, unshaped veths ran at loopback speed).
3. Start until a collective runs, 4 ranks on two nodes (2 a node), then the Slurm cluster is down and a
   two-node Ray cluster up (tests/raynodes.py, reached through Ray Client as a KubeRay cluster is):
   ``--launcher slurm -n 4 --nodes 2`` and ``--launcher ray -n 4`` against raw Ray, what a Ray user writes
   (``ray.init``, a placement group, one actor per rank, ``init_process_group`` with rank 0's address and
   the interface set by hand, one all_reduce), alternating in one run.
4. On the Ray cluster, warm starts against cold (``NBDIST_WARM=0``), alternating: 4 ranks started until a
   collective runs, then rank 3's engine killed and ``%dist_restart 3`` until a collective runs again.

    python benchmarks/multinode.py [--rounds 5] [--ray-rounds 3] [--part all|slurm|ray|ray-start]

``--part ray-start`` times part 3's Ray starts alone (nbdist against raw Ray, alternated), without Slurm. Part 3 also
times both from a fresh Python each, as a fresh kernel's first start, with their imports (``import ray`` for raw Ray)
inside the time (_ray_fresh.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from _common import save, stats  # noqa: E402
from _ray_fresh import fresh_once, raw_start  # noqa: E402

from tests.slurmnodes import NODES, TwoNodeSlurm, unavailable  # noqa: E402

RAW_TEMPLATE = """#!/bin/sh
#SBATCH --job-name=raw-ipp
#SBATCH --ntasks={n}
#SBATCH --nodes=2
#SBATCH --output={output_file}
srun {program_and_args}
"""


def _init_by_hand(port: int) -> float:
    """What a user types on every engine after raw ipyparallel: rank, master, interface, init, one all_reduce."""
    import os
    import socket
    import subprocess

    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    first = subprocess.run(
        ["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]], capture_output=True, text=True
    ).stdout.split()[0]
    master = subprocess.run(["sinfo", "-h", "-N", "-n", first, "-o", "%o"], capture_output=True, text=True).stdout
    os.environ["GLOO_SOCKET_IFNAME"] = "eth0"  # the hostname does not resolve to a routable address
    dist.init_process_group("gloo", init_method=f"tcp://{master.strip()}:{port}", rank=rank, world_size=world)
    x = torch.ones(1)
    dist.all_reduce(x)
    socket.gethostname()
    return x.item()


def raw_once(port: int) -> float:
    import ipyparallel as ipp

    tic = time.perf_counter()
    here = os.getcwd()
    with tempfile.TemporaryDirectory(dir=os.path.expanduser("~")) as tmp:
        os.chdir(tmp)  # ipyparallel writes its batch script (slurm_engine.sbatch) into the working directory
        cluster = ipp.Cluster(
            profile_dir=os.path.join(tmp, "profile"), n=2, engines="slurm", controller_ip="10.77.0.1", log_level=40
        )
        cluster.config.SlurmEngineSetLauncher.batch_template = RAW_TEMPLATE
        try:
            rc = cluster.start_and_connect_sync()
            rc.wait_for_engines(2, timeout=120)
            sums = rc[:].apply_sync(_init_by_hand, port)
            assert sums == [2.0, 2.0], sums
            seconds = time.perf_counter() - tic
            rc.close()
        finally:
            cluster.stop_cluster_sync()
            os.chdir(here)
    return seconds


def nbdist_once(n: int = 2, hosts: tuple[str, ...] = tuple(NODES), **how) -> tuple[float, dict]:
    import nbdist

    how = how or {"launcher": "slurm", "nodes": 2}
    tic = time.perf_counter()
    cluster = nbdist.start(n=n, timeout=120, progress=lambda line: None, **how)
    try:
        cluster.run("x = torch.ones(1); dist.all_reduce(x)", quiet=True).raise_for_error()
        seconds = time.perf_counter() - tic
        assert {r.host for r in cluster.ranks} == set(hosts), [r.host for r in cluster.ranks]
        return seconds, dict(cluster.startup)
    finally:
        cluster.stop()


def raw_ray_once(address: str, n: int, port: int) -> float:
    tic, done = raw_start(address, n, port)
    return done - tic


def ray_restart_once(address: str, warm: bool) -> tuple[float, float]:
    """nbdist --launcher ray, 4 ranks: (start until a collective ran, ``%dist_restart 3`` until one ran again),
    warm (the default: the world's driver starts the replacement, forked from its node's warm process) or cold
    (NBDIST_WARM=0: each rank a fresh interpreter, still started by the world's driver in the bundle it holds)."""
    import signal

    import nbdist

    os.environ["NBDIST_WARM"] = "1" if warm else "0"
    try:
        tic = time.perf_counter()
        cluster = nbdist.start(n=4, launcher="ray", address=address, timeout=120, progress=lambda line: None)
        try:
            cluster.run("x = torch.ones(1); dist.all_reduce(x)", quiet=True).raise_for_error()
            start = time.perf_counter() - tic
            os.kill(cluster.ranks[3].pid, signal.SIGKILL)  # what a restart replaces: a dead rank
            tic = time.perf_counter()
            cluster.restart([3])
            cluster.run("x = torch.ones(1); dist.all_reduce(x)", quiet=True).raise_for_error()
            return start, time.perf_counter() - tic
        finally:
            cluster.stop()
    finally:
        del os.environ["NBDIST_WARM"]


def ray_part(rounds: int, slurm_four: list[float], restarts: bool = True) -> dict:
    from tests.raynodes import NODES as RAY_NODES
    from tests.raynodes import TwoNodeRay
    from tests.raynodes import unavailable as ray_unavailable

    why = ray_unavailable()
    if why:
        print(f"Ray part skipped: {why}")
        return {}
    with TwoNodeRay() as nodes:
        ours, raw, phases = [], [], []
        for i in range(rounds):
            order = ("raw", "nbdist") if i % 2 == 0 else ("nbdist", "raw")
            for which in order:
                if which == "raw":
                    raw.append(raw_ray_once(nodes.address, 4, 29600 + i))
                else:
                    seconds, startup = nbdist_once(4, tuple(RAY_NODES), launcher="ray", address=nodes.address)
                    ours.append(seconds)
                    phases.append(startup)
        fresh: dict[str, list[float]] = {"raw": [], "nbdist": []}  # each in a fresh Python (_ray_fresh.py)
        for i in range(rounds):
            for which in ("raw", "nbdist") if i % 2 == 0 else ("nbdist", "raw"):
                fresh[which].append(fresh_once(which, nodes.address, 29650 + i))
        warm: dict[str, list[float]] = {"start_warm": [], "start_cold": [], "restart_warm": [], "restart_cold": []}
        for i in range(rounds if restarts else 0):
            for how in ("warm", "cold") if i % 2 == 0 else ("cold", "warm"):
                start_s, restart_s = ray_restart_once(nodes.address, how == "warm")
                warm[f"start_{how}"].append(start_s)
                warm[f"restart_{how}"].append(restart_s)
    restart = {k: stats(v) for k, v in warm.items() if v}
    if restarts:
        print("nbdist --launcher ray, 4 ranks, warm (default) against NBDIST_WARM=0 (each rank cold), medians:")
        for what in ("start", "restart"):
            warm_s, cold_s = restart[what + "_warm"]["median"], restart[what + "_cold"]["median"]
            print(f"  {what:8} warm {warm_s:.2f} s   cold {cold_s:.2f} s")
    start = {"nbdist_ray": stats(ours), "raw_ray": stats(raw)}
    start.update({f"{k}_ray_fresh_python": stats(v) for k, v in fresh.items()})
    if slurm_four:
        start["nbdist_slurm"] = stats(slurm_four)
    print(f"start until a collective runs, 4 ranks on 2 nodes (medians; Slurm of {len(slurm_four)}, Ray of {rounds}):")
    if slurm_four:
        print(f"  nbdist --launcher slurm  {start['nbdist_slurm']['median']:.2f} s")
    print(f"  nbdist --launcher ray    {start['nbdist_ray']['median']:.2f} s   {ours}")
    print(f"  raw Ray + init by hand   {start['raw_ray']['median']:.2f} s   {raw}")
    print("  each in a fresh Python, its imports in the time (a fresh kernel's first start):")
    print(f"  nbdist --launcher ray    {start['nbdist_ray_fresh_python']['median']:.2f} s   {fresh['nbdist']}")
    print(f"  raw Ray + init by hand   {start['raw_ray_fresh_python']['median']:.2f} s   {fresh['raw']}")
    return {"start_4_ranks": start, "nbdist_ray_phases": phases, "ray_warm_against_cold": restart}


BANDWIDTH = """
import time
x = torch.ones(numel)
for _ in range(3):
    dist.all_reduce(x)
dist.barrier()
tic = time.perf_counter()
for _ in range(reps):
    dist.all_reduce(x)
seconds = (time.perf_counter() - tic) / reps
"""


def bandwidth(nodes: int, sizes: list[int]) -> dict[str, dict]:
    import nbdist

    out = {}
    with nbdist.start(n=2, launcher="slurm", nodes=nodes, timeout=120, progress=lambda line: None) as cluster:
        hosts = sorted({r.host for r in cluster.ranks})
        for numel in sizes:
            cluster.push({"numel": numel, "reps": max(5, min(50, (1 << 24) // numel))})
            cluster.run(BANDWIDTH, quiet=True).raise_for_error()
            seconds = max(cluster.pull("seconds"))
            out[f"{numel * 4 // 1024} KiB"] = {
                "seconds": seconds,
                "busbw_gb_s": numel * 4 / seconds / 1e9,  # 2 ranks: 2 (n-1)/n = 1
                "hosts": hosts,
            }
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ray-rounds", type=int, default=3)
    parser.add_argument("--part", choices=("all", "slurm", "ray", "ray-start"), default="all")
    args = parser.parse_args()
    if args.part == "ray-start":  # the Ray start alone, against raw Ray (no Slurm, no restarts)
        save("multinode_ray_start", ray_part(args.ray_rounds, [], restarts=False))
        return
    why = unavailable()
    if why:
        print(f"skipped: {why}")
        return
    result: dict = {}
    slurm_four: list[float] = []
    with TwoNodeSlurm() as nodes:
        os.environ.update(nodes.env)
        if args.part in ("all", "slurm"):
            result.update(slurm_part(nodes, args.rounds))
        if args.part in ("all", "ray"):
            for _ in range(args.ray_rounds):
                slurm_four.append(nbdist_once(4, launcher="slurm", nodes=2)[0])
                assert nodes.wait_empty(30) == []
    if args.part in ("all", "ray"):
        result.update(ray_part(args.ray_rounds, slurm_four))
    save("multinode" if args.part == "all" else f"multinode_{args.part}", result)


def slurm_part(nodes: TwoNodeSlurm, rounds: int) -> dict:
    raw, ours, phases = [], [], []
    for i in range(rounds):
        # alternate which goes first, so a warmer page cache favours neither
        order = ("raw", "nbdist") if i % 2 == 0 else ("nbdist", "raw")
        for which in order:
            if which == "raw":
                raw.append(raw_once(29500 + i))
            else:
                seconds, startup = nbdist_once()
                ours.append(seconds)
                phases.append(startup)
            assert nodes.wait_empty(30) == []
    start = {"nbdist": stats(ours), "raw_ipyparallel": stats(raw)}
    ratio = start["nbdist"]["median"] / start["raw_ipyparallel"]["median"]
    print(f"start until a collective runs, 2 ranks on 2 nodes (median of {rounds}):")
    print(f"  nbdist --launcher slurm  {start['nbdist']['median']:.2f} s  (target <= 6 s)")
    print(f"  raw ipyparallel + init   {start['raw_ipyparallel']['median']:.2f} s")
    print(f"  ratio                    {ratio:.2f}x  (target <= 0.5x)")
    sizes = [1 << 10, 1 << 16, 1 << 20, 1 << 22]
    across = bandwidth(2, sizes)
    within = bandwidth(1, sizes)
    print("all_reduce bus bandwidth, 2 ranks:")
    print(f"  {'size':>10}  {'within a node':>14}  {'across nodes':>13}  ratio")
    for key in across:
        w, a = within[key]["busbw_gb_s"], across[key]["busbw_gb_s"]
        print(f"  {key:>10}  {w:11.3f} GB/s  {a:10.3f} GB/s  {w / a:5.2f}x")
    return {
        "start": start,
        "ratio_nbdist_to_raw": ratio,
        "nbdist_phases": phases,
        "allreduce_within": within,
        "allreduce_across": across,
    }


if __name__ == "__main__":
    main()
