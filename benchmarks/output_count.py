"""A cell's output ended by a count in each rank's reply (as shipped) against an idle status after it (as before), on
stub ranks (engines without torch, made lean as nbdist's ranks are: stub_ranks.py), alternated cell by cell on the
same engines, with ipyparallel's ``DirectView.execute`` beside them: the notebook's CPU a cell (each cell's own, so the
median is robust to the odd slow one), the controller's (its /proc counters, in 10 ms ticks: a mean), and the wall;
and how much of the notebook's CPU went to Python's cyclic garbage collector during the cells (``gc.callbacks``, the
collecting thread's CPU time): the full collections (generation 2), which walk every object the process holds, and
the young ones. Then the counted cell again after ``gc.freeze()`` (every object the notebook held once the world
started moved out of the collector's reach), in a pass of its own after the others, as the alternative.

    python benchmarks/output_count.py [--ranks 64,256] [--reps 30]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from typing import Any

from _common import save
from many_ranks import controller_of
from stub_ranks import LEAN, TRIVIAL, StubLauncher, nbdist_cell

from nbdist.config import StartConfig
from nbdist.world.engineset import EngineSet


class GcTime:
    """The seconds Python's cyclic collector took, young (generations 0 and 1) and full (2), and the full collections,
    by the kind of cell running (``kind``; None: not counted), on any thread (``gc.callbacks``)."""

    def __init__(self, kinds: list[str]) -> None:
        self.kind: str | None = None
        self.took = {k: {"young_s": 0.0, "full_s": 0.0, "full": 0} for k in kinds}
        self._tic = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._tic = time.thread_time()  # a collection runs on the thread that allocated: its CPU, not the wall
        elif self.kind is not None:
            took, full = self.took[self.kind], info["generation"] == 2
            took["full_s" if full else "young_s"] += time.thread_time() - self._tic
            took["full"] += full


def one_size(n: int, reps: int) -> dict[str, dict[str, Any]]:
    config = StartConfig.of(n=n, oversubscribe=True, pin=False, timeout=600)
    with tempfile.TemporaryDirectory(prefix="nbdist-count-") as workdir:
        engines = EngineSet(config, StubLauncher(), workdir)
        try:
            engines.start()
            direct = engines.view([r.rank for r in engines.ranks])
            direct.execute(LEAN, block=True)
            kinds = {
                "counted (as shipped)": lambda: nbdist_cell(engines, TRIVIAL),
                "idle status (before)": lambda: nbdist_cell(engines, TRIVIAL, counted=False),
                "DirectView.execute": lambda: direct.execute(TRIVIAL, block=True),
            }
            for run in kinds.values():
                run()
            controller = controller_of(engines)
            frozen = "counted, after gc.freeze()"
            got: dict[str, dict[str, list[float]]] = {
                k: {"wall": [], "notebook": [], "controller": []} for k in [*kinds, frozen]
            }
            collector = GcTime([*kinds, frozen])
            gc.callbacks.append(collector)
            rounds = [kinds] * reps + [{frozen: kinds["counted (as shipped)"]}] * reps
            for i, round_ in enumerate(rounds):
                if i == reps:
                    objects = len(gc.get_objects())  # what a full collection walks (before the freeze)
                    gc.freeze()
                for kind, run in round_.items():
                    mine, theirs = time.process_time(), sum(controller.cpu_times()[:2])
                    tic = time.perf_counter()
                    collector.kind = kind
                    run()
                    collector.kind = None
                    got[kind]["wall"].append(time.perf_counter() - tic)
                    got[kind]["notebook"].append(time.process_time() - mine)
                    got[kind]["controller"].append(sum(controller.cpu_times()[:2]) - theirs)
        finally:
            gc.callbacks[:] = [c for c in gc.callbacks if not isinstance(c, GcTime)]
            gc.unfreeze()
            engines.stop()
    return {
        kind: {
            "wall_ms": statistics.median(g["wall"]) * 1e3,
            "notebook_cpu_ms": statistics.median(g["notebook"]) * 1e3,
            "notebook_cpu_quartiles_ms": [q * 1e3 for q in statistics.quantiles(g["notebook"], n=4)[::2]],
            "controller_cpu_ms": statistics.fmean(g["controller"]) * 1e3,
            "gc_full_per_cell": collector.took[kind]["full"] / reps,
            "gc_full_ms_per_cell": collector.took[kind]["full_s"] * 1e3 / reps,
            "gc_young_ms_per_cell": collector.took[kind]["young_s"] * 1e3 / reps,
            "objects_after": objects,
        }
        for kind, g in got.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", default="64,256")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    out: dict[str, Any] = {}
    for n in map(int, args.ranks.split(",")):
        out[str(n)] = one_size(n, args.reps)
        for kind, m in out[str(n)].items():
            low, high = m["notebook_cpu_quartiles_ms"]
            print(
                f"{n:>4} stub ranks, {kind:21} wall {m['wall_ms']:7.1f} ms  notebook CPU {m['notebook_cpu_ms']:6.1f} ms "
                f"(quartiles {low:.1f}-{high:.1f})  controller CPU {m['controller_cpu_ms']:5.1f} ms  the notebook's garbage "
                f"collector a cell: {m['gc_full_per_cell']:.2f} full collections, {m['gc_full_ms_per_cell']:.1f} ms in "
                f"them, {m['gc_young_ms_per_cell']:.1f} ms in young ones ({m['objects_after']} objects)",
                flush=True,
            )
    save("output_count", {"reps": args.reps, "sizes": out})


if __name__ == "__main__":
    main()
