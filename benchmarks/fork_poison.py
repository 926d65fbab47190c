"""The check before every fork (#55): start/stop cycles with a poison planted in the warm process 1 time in 10.

Each cycle: a new warm process (as ``%load_ext nbdist`` starts one), ``--settle`` seconds for it to import torch (a
user reading), then ``nbdist.start(n=2)``, a trivial all-reduce, ``stop()``. A poisoned cycle's warm process has a
thread planted by a sitecustomize at its start (engine/warm.unsafe refuses to fork there): its start must be named
in one line and its ranks start cold; no start may hang. The alternative in the same run: as many cycles with no
poison at all, so the clean cycles' start time beside poisoned ones can be compared with a series that never saw
one. Saved under results/fork_poison.json.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import pathlib
import statistics
import sys
import tempfile
import time

import psutil
from _common import save

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import nbdist  # noqa: E402
from nbdist.config import default_threads  # noqa: E402
from nbdist.launch import pool  # noqa: E402

POISON = (
    "import sys, threading, time\n"
    "if 'nbdist.engine.warm' in sys.orig_argv:\n"
    "    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()\n"
)
HANG_S = 120


def cycle(poisoned: bool, site: str, settle: float) -> dict:
    pool.shutdown()
    base = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = f"{site}{os.pathsep}{base}" if poisoned else base
    try:
        server = pool.warm(2, default_threads(2))
        time.sleep(settle)
        said = io.StringIO()
        tic = time.perf_counter()
        with contextlib.redirect_stderr(said):
            cluster = nbdist.start(n=2, timeout=HANG_S)
        started = time.perf_counter() - tic
        try:
            forked = all(psutil.Process(r.pid).ppid() == server for r in cluster.ranks)
            cluster.run("t = torch.ones(1)\ndist.all_reduce(t)\nv = t.item()", timeout=HANG_S).raise_for_error()
            works = cluster.pull("v") == [2.0, 2.0]
        finally:
            cluster.stop()
    finally:
        os.environ["PYTHONPATH"] = base
    return {
        "poisoned": poisoned,
        "start_s": started,
        "forked": forked,
        "named": "cannot fork ranks safely" in said.getvalue(),
        "works": works,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=20, help="cycles with a poison 1 in 10 (and as many clean)")
    parser.add_argument("--settle", type=float, default=3.0)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as site:
        pathlib.Path(site, "sitecustomize.py").write_text(POISON)
        for series in ("never poisoned", "poisoned 1 in 10"):
            for i in range(args.cycles):
                poisoned = series != "never poisoned" and i % 10 == 3
                row = {"series": series, **cycle(poisoned, site, args.settle)}
                rows.append(row)
                print(
                    f"{series:16} cycle {i:3}: {'POISONED' if poisoned else 'clean   '} start {row['start_s']:.2f} s "
                    f"{'forked' if row['forked'] else 'cold'}{' named' if row['named'] else ''}"
                    f"{'' if row['works'] else ' BROKEN'}",
                    flush=True,
                )
    pool.shutdown()
    poisoned = [r for r in rows if r["poisoned"]]
    clean_beside = [r["start_s"] for r in rows if r["series"] != "never poisoned" and not r["poisoned"]]
    clean_alone = [r["start_s"] for r in rows if r["series"] == "never poisoned"]
    summary = {
        "poisoned": len(poisoned),
        "poisoned_named": sum(r["named"] and not r["forked"] for r in poisoned),
        "clean_forked": sum(r["forked"] and not r["named"] for r in rows if not r["poisoned"]),
        "clean": sum(not r["poisoned"] for r in rows),
        "all_worked": all(r["works"] for r in rows),
        "start_clean_never_poisoned_s": statistics.median(clean_alone),
        "start_clean_beside_poisoned_s": statistics.median(clean_beside),
        "start_poisoned_cold_s": statistics.median(r["start_s"] for r in poisoned) if poisoned else None,
    }
    print(
        f"\n{summary['poisoned_named']}/{summary['poisoned']} poisoned starts named and started cold; "
        f"{summary['clean_forked']}/{summary['clean']} clean starts forked; every world worked: {summary['all_worked']}; "
        f"start (median) clean {summary['start_clean_never_poisoned_s']:.2f} s in a series never poisoned, "
        f"{summary['start_clean_beside_poisoned_s']:.2f} s beside poisoned cycles, poisoned (cold) "
        f"{summary['start_poisoned_cold_s']:.2f} s"
    )
    save("fork_poison", {"rows": rows, "summary": summary})


if __name__ == "__main__":
    main()
