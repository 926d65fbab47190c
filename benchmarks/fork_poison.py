"""The check before every fork (#55): start/stop cycles with a poison planted 1 time in 10.

Each cycle: a new warm process (as ``%load_ext nbdist`` starts one), ``--settle`` seconds for it to import torch (a
user reading), then ``nbdist.start(n=2)``, a trivial all-reduce, ``stop()``. A poisoned cycle has a thread planted
by a sitecustomize at the start of the fork servers (engine/warm.unsafe refuses to fork there), alternately in the
warm process only (its ranks must come from a fork server begun for them: ``--start forkserver``) and in every fork
server (the warm process and that fork server refuse: its ranks start cold, ``--start spawn``). Each refusal must be
named in one line; no start may hang. The alternative in the same run: as many cycles with no poison at all, so the
clean cycles' start time beside poisoned ones can be compared with a series that never saw one. Saved under
results/fork_poison.json.
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
    "import os, sys, threading, time\n"
    "if 'nbdist.engine.warm' in sys.orig_argv and ('--lean' not in sys.orig_argv or os.environ.get('POISON_ALL')):\n"
    "    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()\n"
)
KINDS = {"": "clean", "warm": "the warm process", "all": "every fork server"}
WANT = {"": ("fork", 0), "warm": ("forkserver", 1), "all": ("spawn", 2)}  # how the ranks are made, lines said
HANG_S = 120


def made(pid: int) -> str:
    parent = psutil.Process(pid).parent()
    if parent is None or parent.pid == os.getpid():
        return "spawn"
    return "forkserver" if "--lean" in parent.cmdline() else "fork"


def cycle(poison: str, site: str, settle: float) -> dict:
    pool.shutdown()
    base = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = f"{site}{os.pathsep}{base}" if poison else base
    if poison == "all":
        os.environ["POISON_ALL"] = "1"
    try:
        server = pool.warm(2, default_threads(2))
        time.sleep(settle)
        said = io.StringIO()
        tic = time.perf_counter()
        with contextlib.redirect_stderr(said):
            cluster = nbdist.start(n=2, timeout=HANG_S)
        started = time.perf_counter() - tic
        try:
            makers = {made(r.pid) for r in cluster.ranks}
            forked = all(psutil.Process(r.pid).ppid() == server for r in cluster.ranks)
            cluster.run("t = torch.ones(1)\ndist.all_reduce(t)\nv = t.item()", timeout=HANG_S).raise_for_error()
            works = cluster.pull("v") == [2.0, 2.0]
        finally:
            cluster.stop()
    finally:
        os.environ["PYTHONPATH"] = base
        os.environ.pop("POISON_ALL", None)
    want, lines = WANT[poison]
    return {
        "poisoned": bool(poison),
        "poison": poison,
        "start_s": started,
        "forked": forked,
        "made": sorted(makers),
        "as_wanted": makers == {want} and said.getvalue().count("cannot fork ranks safely") == lines,
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
                poison = ("warm", "all")[(i // 10) % 2] if poisoned else ""
                row = {"series": series, **cycle(poison, site, args.settle)}
                rows.append(row)
                print(
                    f"{series:16} cycle {i:3}: {KINDS[poison]:17} start {row['start_s']:.2f} s ranks by "
                    f"{'+'.join(row['made'])}{' named' if row['named'] else ''}"
                    f"{'' if row['as_wanted'] else ' NOT AS WANTED'}{'' if row['works'] else ' BROKEN'}",
                    flush=True,
                )
    pool.shutdown()
    poisoned = [r for r in rows if r["poisoned"]]
    clean_beside = [r["start_s"] for r in rows if r["series"] != "never poisoned" and not r["poisoned"]]
    clean_alone = [r["start_s"] for r in rows if r["series"] == "never poisoned"]
    summary = {
        "poisoned": len(poisoned),
        "poisoned_named": sum(r["named"] and not r["forked"] for r in poisoned),
        "as_wanted": sum(r["as_wanted"] for r in rows),
        "cycles": len(rows),
        "start_poisoned_warm_s": statistics.median([r["start_s"] for r in poisoned if r["poison"] == "warm"] or [0]),
        "start_poisoned_all_s": statistics.median([r["start_s"] for r in poisoned if r["poison"] == "all"] or [0]),
        "clean_forked": sum(r["forked"] and not r["named"] for r in rows if not r["poisoned"]),
        "clean": sum(not r["poisoned"] for r in rows),
        "all_worked": all(r["works"] for r in rows),
        "start_clean_never_poisoned_s": statistics.median(clean_alone),
        "start_clean_beside_poisoned_s": statistics.median(clean_beside),
    }
    print(
        f"\n{summary['as_wanted']}/{summary['cycles']} cycles made their ranks as wanted (clean: forked from the warm "
        f"process; warm poisoned: from a fork server, one line; all poisoned: cold, two lines); start (median) warm "
        f"poisoned {summary['start_poisoned_warm_s']:.2f} s, all poisoned {summary['start_poisoned_all_s']:.2f} s"
    )
    print(
        f"{summary['poisoned_named']}/{summary['poisoned']} poisoned starts named and not forked from the warm process; "
        f"{summary['clean_forked']}/{summary['clean']} clean starts forked; every world worked: {summary['all_worked']}; "
        f"start (median) clean {summary['start_clean_never_poisoned_s']:.2f} s in a series never poisoned, "
        f"{summary['start_clean_beside_poisoned_s']:.2f} s beside poisoned cycles"
    )
    save("fork_poison", {"rows": rows, "summary": summary})


if __name__ == "__main__":
    main()
