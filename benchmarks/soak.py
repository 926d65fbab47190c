"""A run you can leave (#50): what a long run's logging keeps, in a real Jupyter kernel as a notebook has it.

A kernel (jupyter_client, ipykernel: the notebook's kernel, with nbdist's cell output, dashboard widget and
transcript) starts ``--ranks`` ranks and runs one ``%%distributed`` cell that only calls ``nbdist.log(step=s,
loss=...)`` for ``--steps`` steps. Sampled every 0.5 s: the resident memory of the kernel and of every rank, and
the size of the world's directory (transcripts, metric rows). Reported: each at the cell's start and end, the
growth, and growth per 1,000 steps. ``--trace``: the kernel's tracemalloc top allocations after the cell (what
keeps memory). ``--before TREE``: the same for an earlier checkout, in the same run (its nbdist on PYTHONPATH).

    python benchmarks/soak.py --ranks 8 --steps 1000000
    git worktree add /tmp/nbdist-before <commit>; python benchmarks/soak.py --before /tmp/nbdist-before

JSON under results/soak.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import threading
import time

from _common import save

HERE = pathlib.Path(__file__).resolve().parents[1]
CELL = "%%distributed\nimport nbdist\nfor s in range({steps}):\n    nbdist.log(step=s, loss=1.0 / (s + 1))\n"


def rss_mib(pid: int) -> float:
    import psutil

    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except Exception:
        return float("nan")


def dir_mib(path: str) -> float:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total / 2**20


def probe(ranks: int, steps: int, trace: bool) -> dict:
    """In a fresh process: one kernel, one world, one logging cell; the figures."""
    sys.path.insert(0, str(HERE))
    from tests.helpers import NotebookKernel

    kernel = NotebookKernel()
    run = kernel.run
    out: dict = {"ranks": ranks, "steps": steps}
    try:
        run(f"%load_ext nbdist\n%dist_start -n {ranks} --oversubscribe --timeout 180")
        info = run(
            "import json, nbdist, nbdist.cluster as _c\n_w = _c.current()",
            "json.dumps({'pids': [r.pid for r in _w.ranks], 'dir': _w.membership.workdir, 'nbdist': nbdist.__file__})",
        )
        assert isinstance(info, dict)
        out["nbdist"] = os.path.dirname(info["nbdist"])
        run("%%distributed\nimport nbdist\nnbdist.log(step=0, loss=1.0)")  # everything imported, first row shown
        if trace:
            run("import tracemalloc; tracemalloc.start(12)")
        samples: list[tuple[float, float, list[float], float]] = []
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                samples.append(
                    (time.perf_counter(), rss_mib(kernel.pid), [rss_mib(p) for p in info["pids"]], dir_mib(info["dir"]))
                )
                done.wait(0.5)

        sampler = threading.Thread(target=sample, daemon=True)
        tic = time.perf_counter()
        sampler.start()
        run(CELL.format(steps=steps))
        out["cell_s"] = round(time.perf_counter() - tic, 1)
        time.sleep(1.0)
        done.set()
        sampler.join()
        first, last = samples[0], samples[-1]
        out["kernel_MiB"] = {
            "start": round(first[1], 1),
            "end": round(last[1], 1),
            "peak": round(max(s[1] for s in samples), 1),
        }
        out["kernel_growth_MiB"] = round(last[1] - first[1], 1)
        growth = [b - a for a, b in zip(first[2], last[2], strict=True)]
        out["rank_growth_MiB"] = {"max": round(max(growth), 1), "each": [round(g, 1) for g in growth]}
        out["world_dir_MiB"] = {"start": round(first[3], 2), "end": round(last[3], 2)}
        out["kernel_KiB_per_1000_steps"] = round((last[1] - first[1]) * 1024 / steps * 1000, 2)
        if trace:
            out["kernel_top"] = run(
                "import tracemalloc as _t\n_s = _t.take_snapshot().filter_traces([_t.Filter(False, _t.__file__)])\n"
                "_top = ['%.1f MiB %s' % (st.size / 2**20, ' <- '.join(f'{f.filename.split(\"site-packages/\")[-1]}:"
                "{f.lineno}' for f in st.traceback[:4])) for st in _s.statistics('traceback')[:8]]",
                "_top",
            )
        run("%dist_stop")
    finally:
        kernel.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--before", default=None, metavar="TREE", help="an earlier checkout, measured in the same run")
    parser.add_argument("--trace", action="store_true", help="the kernel's top allocations after the cell")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(probe(args.ranks, args.steps, args.trace)))
        return
    results = {}
    trees = ([("before", args.before)] if args.before else []) + [("after", str(HERE))]
    for name, tree in trees:
        env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
        argv = [sys.executable, __file__, "--probe", "--ranks", str(args.ranks), "--steps", str(args.steps)]
        done = subprocess.run(argv + (["--trace"] if args.trace else []), env=env, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"{name} ({tree}) failed:\n{done.stderr[-3000:]}")
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
        print(name, json.dumps(results[name], indent=1), flush=True)
    save("soak", {"ranks": args.ranks, "steps": args.steps, **results})


if __name__ == "__main__":
    main()
