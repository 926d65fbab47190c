"""Which of nbdist's controller's differences from ipyparallel's own costs a cell at many stub ranks.

nbdist starts ipyparallel's controller with its schedulers as threads (``--usethreads``), CurveZMQ on, and a
heartbeat every 100 ms (``WorldConfig.heartbeat_ms``; ipyparallel's default is 3 s). Session 19's stub_ranks.py run
found ``DirectView.execute`` 1.7x-1.8x slower behind nbdist's controller than behind ipyparallel's own at 128 and
256 ranks. This starts the same stub world (stub_ranks.py: plain ipyparallel engines, nbdist's controller) once per
variant, each difference undone alone, in pairs and all three together, with nbdist's own controller first and again last (the
spread between those two is the noise floor), and times ``DirectView.execute`` and nbdist's cell (medians), and
reads the share of a core the controller's processes take while the world is idle (the heartbeat's own cost).

    python controller_variants.py --ranks 128 --reps 7     # prints, and saves results/controller_variants.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

import psutil
from _common import save
from many_ranks import controller_of
from stub_ranks import TRIVIAL, StubLauncher, nbdist_cell

from nbdist.config import StartConfig
from nbdist.world.engineset import EngineSet

IDLE_S = 5.0  # how long the controller's idle CPU is read
# (name, heartbeat ms, schedulers as threads, CurveZMQ)
VARIANTS = [
    ("nbdist's controller", 100, True, True),
    ("heartbeat every 3 s", 3000, True, True),
    ("schedulers as processes", 100, False, True),
    ("no CurveZMQ", 100, True, False),
    ("3 s beat, schedulers as processes", 3000, False, True),
    ("3 s beat, no CurveZMQ", 3000, True, False),
    ("processes, no CurveZMQ", 100, False, False),
    ("all three as ipyparallel's", 3000, False, False),
    ("nbdist's controller, again", 100, True, True),
]


class Variant(StubLauncher):
    """The stub world's launcher with the schedulers' threads or CurveZMQ undone."""

    def __init__(self, threads: bool, curve: bool) -> None:
        super().__init__()
        self.threads, self.curve = threads, curve

    def cluster(self, config: StartConfig, profile_dir: str, fresh: bool = True) -> Any:
        cluster = super().cluster(config, profile_dir, fresh)
        if not self.threads:
            cluster.controller_args = [a for a in cluster.controller_args if a != "--usethreads"]
        if not self.curve:  # written by launchers.secure_controller; the HMAC key stays
            path = os.path.join(profile_dir, "ipcontroller_config.py")
            with open(path) as fh:
                text = fh.read()
            with open(path, "w") as fh:
                fh.write(text.replace("enable_curve = True", "enable_curve = False"))
        return cluster


def measure(n: int, reps: int, heartbeat_ms: int, threads: bool, curve: bool) -> dict[str, float]:
    config = StartConfig.of(n=n, oversubscribe=True, pin=False, timeout=600, heartbeat_ms=heartbeat_ms)
    with tempfile.TemporaryDirectory(prefix="nbdist-variant-") as workdir:
        engines = EngineSet(config, Variant(threads, curve), workdir)
        try:
            engines.start()
            direct = engines.view([r.rank for r in engines.ranks])
            for _ in range(2):  # warm: the view's sockets, the first transcript
                direct.execute(TRIVIAL, block=True)
                nbdist_cell(engines, TRIVIAL)
            idle = idle_cpu(controller_of(engines), IDLE_S)
            view, cell = [], []
            for _ in range(reps):
                tic = time.perf_counter()
                direct.execute(TRIVIAL, block=True)
                view.append((time.perf_counter() - tic) * 1e3)
                tic = time.perf_counter()
                nbdist_cell(engines, TRIVIAL)
                cell.append((time.perf_counter() - tic) * 1e3)
        finally:
            engines.stop()
    return {"view_execute_ms": statistics.median(view), "nbdist_cell_ms": statistics.median(cell), **idle}


def idle_cpu(controller: psutil.Process, seconds: float) -> dict[str, float]:
    """The share of a core the controller's processes take while no cell runs: the hub (and its threaded schedulers),
    and its children (ipyparallel's heart monitor always runs in a process of its own; the schedulers do without
    ``--usethreads``)."""
    procs = [controller, *controller.children(recursive=True)]

    def used() -> list[float]:
        out = []
        for proc in procs:
            try:
                out.append(sum(proc.cpu_times()[:2]))
            except psutil.Error:
                out.append(0.0)
        return out

    before = used()
    time.sleep(seconds)
    after = used()
    return {
        "idle_hub_cpu": (after[0] - before[0]) / seconds,
        "idle_children_cpu": (sum(after[1:]) - sum(before[1:])) / seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=128)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--name", default="controller_variants", help="the results file's name (one per run)")
    args = parser.parse_args()
    out = {}
    for name, heartbeat_ms, threads, curve in VARIANTS:
        row = measure(args.ranks, args.reps, heartbeat_ms, threads, curve)
        out[name] = row
        print(
            f"{args.ranks} stub ranks, {name:>34}: DirectView.execute {row['view_execute_ms']:6.1f} ms, "
            f"nbdist's cell {row['nbdist_cell_ms']:6.1f} ms; idle, a core's share: the hub {row['idle_hub_cpu']:.2f}, "
            f"its child processes {row['idle_children_cpu']:.2f}",
            flush=True,
        )
    first, last = out[VARIANTS[0][0]]["view_execute_ms"], out[VARIANTS[-1][0]]["view_execute_ms"]
    print(f"  noise floor (the same controller, first and last): {abs(first - last):.1f} ms", flush=True)
    save(args.name, {"ranks": args.ranks, "reps": args.reps, "variants": out})


if __name__ == "__main__":
    main()
