"""The first cell after a start, under %dist_why: does nbdist's own background work beside it unbalance the ranks?

Each round begins a new warm process (what ``%load_ext nbdist`` does; its idle work, about 1.5 s of a core, comes
right after) and starts 2 ranks (on 2 cores: every core computes), then runs tests/why_cases.py's balanced DDP cell
under ``nbdist.why``: ``at once``, as a user's first cell or the test suite's first test does, or ``after`` a pause
of ``--pause`` s (the warm process has nothing left to do), alternating. Counted: the verdict (balanced is right), the
largest difference between the ranks as a share of a step (the crowded bar: stragglers.CROWDED_SHARE), and the CPU
the warm process used while the cell ran. Saved under results/first_cell.json.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import psutil
from _common import save

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import nbdist  # noqa: E402
from nbdist.config import default_threads  # noqa: E402
from nbdist.launch import pool  # noqa: E402
from tests.why_cases import cell  # noqa: E402


def _cpu_s(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def once(pause: float) -> dict:
    pool.shutdown()
    server = pool.warm(2, default_threads(2))
    assert server is not None
    with nbdist.start(n=2, timeout=120) as cluster:
        time.sleep(pause)
        before = _cpu_s(server)
        verdict = nbdist.why(cell("none", -1, 0), cluster)
        warm_s = _cpu_s(server) - before
    share = verdict.figures.get("excess_s", 0) / verdict.figures.get("step_s", 1)
    return {"pause_s": pause, "verdict": verdict.cause, "share": share, "warm_cpu_s": warm_s, "text": verdict.text}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--pause", type=float, default=5.0)
    args = parser.parse_args()
    rows = []
    for i in range(args.rounds):
        for pause in (0.0, args.pause):
            row = once(pause)
            rows.append(row)
            print(
                f"round {i} {'at once' if not pause else 'after':7}: {row['verdict']:9} largest difference "
                f"{row['share']:.0%} of a step; warm process {row['warm_cpu_s']:.2f} s of CPU in the cell",
                flush=True,
            )
    pool.shutdown()
    summary = {}
    for name, pause in (("at_once", 0.0), ("after", args.pause)):
        mine = [r for r in rows if r["pause_s"] == pause]
        summary[name] = {
            "balanced": sum(r["verdict"] == "balanced" for r in mine) / len(mine),
            "share_median": statistics.median(r["share"] for r in mine),
            "share_max": max(r["share"] for r in mine),
            "warm_cpu_s_median": statistics.median(r["warm_cpu_s"] for r in mine),
        }
        print(f"{name:8}: {summary[name]}")
    save("first_cell", {"rows": rows, "summary": summary, "rounds": args.rounds})


if __name__ == "__main__":
    main()
