"""Start-up: `%dist_start -n N` until a cell can run a collective, against raw ipyparallel.

Raw: `ipyparallel.Cluster(n=2).start_and_connect_sync()`, then `init_process_group` by hand
on each engine and one all_reduce. nbdist: `%dist_start -n N` through an IPython shell, then
one `%%distributed` all_reduce cell, for 2 ranks and for 4 (oversubscribed on 2 cores), in
four situations:
- warm: the usual notebook, where `%load_ext nbdist` started the warm process (nbdist.launch.pool)
  a few seconds (THINK_S) before the user ran `%dist_start`;
- back-to-back: warming starts at the same moment as `%dist_start` (Run All);
- cold: nothing warm before `%dist_start` (a script's first `nbdist.start`); the start begins
  the warm process itself, beside the controller;
- forkserver: `%dist_start --start forkserver` in the usual notebook (the warm process there): the ranks
  come from a fork server begun for the world, which imports torch beside the controller;
- spawn: `%dist_start --start spawn`, every rank a fresh interpreter importing torch;
- warming off: NBDIST_WARM=0, every engine a fresh interpreter importing torch (what every
  start was before the warm process forked engines).
Alternated, median of N runs; `%dist_stop` timed too. JSON under results/.

`--cache`: numba's cache empty (a fresh install, a read-only environment: NUMBA_CACHE_DIR an
empty folder) against filled, in the warm situation: `%dist_start` + a collective, then, after
READ_S, `%dist_restart` + a collective (the kernels compile in the warm process's idle time;
issue 30 measured 16-19 s for that restart before they compiled in a child process of their own).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from _common import run_cell, save, shell, stats

MODES = ("warm", "back-to-back", "cold", "forkserver", "spawn", "warming off")
START = {"forkserver": " --start forkserver", "spawn": " --start spawn"}


def collective(n: int) -> str:
    return f"t = torch.ones(1)\ndist.all_reduce(t)\nassert t.item() == {n}.0"


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
            "dist.init_process_group('gloo')\n" + collective(2),
            block=True,
        )
        took = time.perf_counter() - tic
        view.execute("dist.destroy_process_group()", block=True)
        rc.close()
        return took
    finally:
        cluster.stop_cluster_sync()


THINK_S = 4.0  # seconds between `%load_ext nbdist` and `%dist_start` in the warm case


def nbdist_once(ip, mode: str, n: int) -> tuple[float, float, dict]:
    """(seconds to the first collective, seconds %dist_stop took, the start's phases)."""
    import nbdist
    from nbdist.config import default_threads
    from nbdist.launch import pool

    pool.shutdown()
    if mode == "warming off":
        os.environ["NBDIST_WARM"] = "0"
    if mode in ("warm", "forkserver", "spawn"):
        pool.warm(n, default_threads(n))
        time.sleep(THINK_S)
    tic = time.perf_counter()
    if mode == "back-to-back":
        pool.warm(n, default_threads(n))
    try:
        over = " --oversubscribe" if n > (os.cpu_count() or 1) else ""
        run_cell(ip, f"%dist_start -n {n}{over}{START.get(mode, '')}")
        run_cell(ip, "%%distributed\n" + collective(n))
        took = time.perf_counter() - tic
        phases = dict(nbdist.current().startup)
    finally:
        tic = time.perf_counter()
        run_cell(ip, "%dist_stop")
        stop = time.perf_counter() - tic
        os.environ.pop("NBDIST_WARM", None)
    return took, stop, phases


READ_S = 2.0  # seconds between the first cell's output and `%dist_restart`


def cache_once(ip, cache_dir: str) -> tuple[float, float]:
    """(%dist_start + a collective, %dist_restart + a collective), with NUMBA_CACHE_DIR=cache_dir."""
    from nbdist.config import default_threads
    from nbdist.launch import pool

    pool.shutdown()
    os.environ["NUMBA_CACHE_DIR"] = cache_dir
    try:
        pool.warm(2, default_threads(2))
        time.sleep(THINK_S)
        tic = time.perf_counter()
        run_cell(ip, "%dist_start -n 2")
        run_cell(ip, "%%distributed\n" + collective(2))
        start = time.perf_counter() - tic
        time.sleep(READ_S)
        tic = time.perf_counter()
        run_cell(ip, "%dist_restart")
        run_cell(ip, "%%distributed\n" + collective(2))
        restart = time.perf_counter() - tic
    finally:
        run_cell(ip, "%dist_stop")
        pool.shutdown()
        os.environ.pop("NUMBA_CACHE_DIR", None)
    return start, restart


def cache_bench(ip, runs: int) -> dict:
    filled = tempfile.mkdtemp(prefix="nbdist-numba-filled-")
    code = "from nbdist.compression import kernels; kernels.warm_up()"
    subprocess.run([sys.executable, "-c", code], env={**os.environ, "NUMBA_CACHE_DIR": filled}, check=True)
    out: dict[str, dict[str, list[float]]] = {
        "empty": {"start": [], "restart": []},
        "filled": {"start": [], "restart": []},
    }
    try:
        for i in range(runs):
            empty = tempfile.mkdtemp(prefix="nbdist-numba-empty-")
            try:
                for name, folder in (("empty", empty), ("filled", filled)):
                    start, restart = cache_once(ip, folder)
                    out[name]["start"].append(start)
                    out[name]["restart"].append(restart)
            finally:
                shutil.rmtree(empty, ignore_errors=True)
            print(
                f"run {i + 1}: empty cache start {out['empty']['start'][-1]:.2f} s, restart "
                f"{out['empty']['restart'][-1]:.2f} s | filled start {out['filled']['start'][-1]:.2f} s, restart "
                f"{out['filled']['restart'][-1]:.2f} s",
                flush=True,
            )
    finally:
        shutil.rmtree(filled, ignore_errors=True)
    return {name: {k: stats(v) for k, v in d.items()} for name, d in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("-n", "--runs", type=int, default=5)
    parser.add_argument("--cache", action="store_true", help="only numba's cache empty against filled (saved JSON)")
    args = parser.parse_args()
    ip = shell()
    if args.cache:
        res = cache_bench(ip, args.runs)
        for name in ("empty", "filled"):
            print(
                f"median with numba's cache {name:6s}: %dist_start + collective {res[name]['start']['median']:.2f} s, "
                f"%dist_restart + collective {res[name]['restart']['median']:.2f} s"
            )
        gap = max(res["empty"][k]["median"] - res["filled"][k]["median"] for k in ("start", "restart"))
        print(f"target: empty within 0.5 s of filled -> {'met' if gap <= 0.5 else 'NOT met'} (+{gap:.2f} s)")
        save("startup_cache", {"think_s": THINK_S, "read_s": READ_S, **res})
        return
    raw: list[float] = []
    ours: dict[str, list[float]] = {}
    stops: list[float] = []
    phases: dict[str, list[dict]] = {}
    for i in range(args.runs):
        raw.append(raw_once())
        line = f"run {i + 1}: raw ipyparallel {raw[-1]:.2f} s"
        for n in (2, 4):
            for mode in MODES:
                took, stop, phase = nbdist_once(ip, mode, n)
                ours.setdefault(f"{n}:{mode}", []).append(took)
                phases.setdefault(f"{n}:{mode}", []).append(phase)
                stops.append(stop)
                line += f" | {n} {mode} {took:.2f}"
        print(line, flush=True)
    r = stats(raw)
    o = {k: stats(v) for k, v in ours.items()}
    s = stats(stops)
    print(f"\nmedian raw ipyparallel (2 engines) + init_process_group: {r['median']:.2f} s")
    for key, st in o.items():
        n, mode = key.split(":")
        print(f"median %dist_start -n {n} + first collective, {mode:>12}: {st['median']:.2f} s")
    print(f"median %dist_stop: {s['median']:.2f} s (max {s['max']:.2f})")
    two = max(o[f"2:{m}"]["median"] for m in ("warm", "back-to-back", "cold"))
    four = max(o[f"4:{m}"]["median"] for m in ("warm", "back-to-back", "cold"))
    print(
        f"targets: 2 ranks <= 2.0 s in every case -> {'met' if two <= 2.0 else 'NOT met'} ({two:.2f}); "
        f"4 ranks <= 3.0 s -> {'met' if four <= 3.0 else 'NOT met'} ({four:.2f}); "
        f"%dist_stop <= 1 s -> {'met' if s['median'] <= 1.0 else 'NOT met'}"
    )
    for n in (2, 4):
        ratio = o[f"{n}:forkserver"]["median"] / o[f"{n}:warm"]["median"]
        print(f"{n} ranks: forkserver / warm fork = {ratio:.2f}x (the 1.5x goal is at 64 ranks: start_methods.py)")
    save(
        "startup",
        {"raw_ipyparallel_s": r, "nbdist_s": o, "stop_s": s, "think_s": THINK_S, "nbdist_phases": phases},
    )


if __name__ == "__main__":
    main()
