"""What ``%dist_track`` costs a step (#56): the same training cell untracked, tracked to each tracker of ``--kinds``
(TensorBoard by default; mlflow, wandb offline, trackio local), and tracked to a TensorBoard run made artificially
slow (each batch's write sleeps SLOW_S: nothing may wait on it), alternated in one run at 2 and 16 ranks
(oversubscribed here). Each cell: STEPS steps of a small MLP's forward, backward and SGD step with
``nbdist.log(step=, loss=, lr=)`` every step. The goal: tracked within 1% of untracked. Medians of the cell's wall
time per step, and of the CPU time the notebook's process spent per step (a steadier measure of what tracking takes
from the ranks on a machine they share: wall times of alternated cells here vary by 10-20% from cell to cell);
JSON under results/track.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from _common import save

import nbdist
from nbdist.tracking import runs

STEPS = 3000
SLOW_S = 0.2
SLOW = "slow tensorboard"  # TensorBoard with each batch's write slowed by SLOW_S
SETUP = """
import torch, nbdist
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(32, 64), torch.randn(32, 1)
"""
CELL = """
for step in range({steps}):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    nbdist.log(step=step, loss=loss.item(), lr=0.01)
"""


class _Slow(runs.TensorBoardRun):
    def scalars(self, points):
        time.sleep(SLOW_S)
        super().scalars(points)


def per_step(cluster: nbdist.Cluster, steps: int) -> tuple[float, float]:
    """The cell's wall time per step, and the CPU time the notebook's process spent per step meanwhile (its every
    thread: the cell path's, the tracker's writer): the second is what tracking takes from the ranks' cores."""
    tic, cpu = time.perf_counter(), time.process_time()
    cluster.run(CELL.format(steps=steps), quiet=True).raise_for_error()
    return (time.perf_counter() - tic) / steps, (time.process_time() - cpu) / steps


def _open(kind: str, n: int, rep: int, folder: str) -> None:
    slow = kind == SLOW
    tracker = nbdist.track(
        "tensorboard" if slow else kind, f"n{n}-{rep}-{kind.replace(' ', '-')}", **_place(kind, folder)
    )
    if slow:
        tracker.run.__class__ = _Slow


def _place(kind: str, folder: str) -> dict[str, str]:
    return {"project": "nbdist-bench"} if kind == "trackio" else {"folder": folder}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", default="2,16")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--kinds", default="tensorboard", help="the trackers to measure, comma-separated")
    parser.add_argument("--steps", type=int, default=STEPS, help="steps a cell (long: a cell's own start and end cost)")
    args = parser.parse_args()
    os.environ.setdefault("WANDB_MODE", "offline")
    ways = ["untracked", *args.kinds.split(","), SLOW]
    out: dict[str, dict[str, float]] = {}
    folder = tempfile.mkdtemp(prefix="nbdist-track-bench-")
    os.environ.setdefault("TRACKIO_DIR", os.path.join(folder, "trackio"))
    for n in [int(v) for v in args.ranks.split(",")]:
        times: dict[str, list[float]] = {way: [] for way in ways}
        cpus: dict[str, list[float]] = {way: [] for way in ways}
        with nbdist.start(n=n, oversubscribe=True, timeout=300) as cluster:
            cluster.run(SETUP, setup=True).raise_for_error()
            per_step(cluster, args.steps)  # warm-up
            for rep in range(args.reps):
                for way in ways:
                    if way != "untracked":
                        _open(way, n, rep, folder)
                    wall, cpu = per_step(cluster, args.steps)
                    times[way].append(wall)
                    cpus[way].append(cpu)
                    if way != "untracked":
                        tic = time.perf_counter()
                        nbdist.untrack()
                        times.setdefault(f"{way} close_s", []).append(time.perf_counter() - tic)
                print(f"{n} ranks, rep {rep + 1}: " + ", ".join(f"{w} {times[w][-1] * 1e3:.3f} ms/step" for w in ways))
        med = {w: statistics.median(v) for w, v in times.items()}
        med.update({f"{w} notebook_cpu_s": statistics.median(v) for w, v in cpus.items()})
        out[str(n)] = med
        base = med["untracked"]
        print(
            f"{n} ranks, median per step: untracked {base * 1e3:.3f} ms, "
            + ", ".join(f"{w} {med[w] * 1e3:.3f} ms ({(med[w] / base - 1) * 100:+.1f}%)" for w in ways[1:])
            + "; the notebook's CPU per step: "
            + ", ".join(f"{w} {med[w + ' notebook_cpu_s'] * 1e6:.0f} us" for w in ways)
            + "; closing a run: "
            + ", ".join(f"{w} {med[w + ' close_s']:.2f} s" for w in ways[1:]),
            flush=True,
        )
    save("track", {"steps": args.steps, "slow_s": SLOW_S, "median_s_per_step": out})


if __name__ == "__main__":
    main()
