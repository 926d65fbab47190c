"""What ``%dist_track`` costs a step (#56): the same training cell untracked, tracked to TensorBoard, and tracked to a
TensorBoard run made artificially slow (each batch's write sleeps SLOW_S: nothing may wait on it), alternated in one
run at 2 and 16 ranks (oversubscribed here). Each cell: STEPS steps of a small MLP's forward, backward and SGD step
with ``nbdist.log(step=, loss=, lr=)`` every step. The goal: tracked within 1% of untracked. Medians of the cell's
wall time per step; JSON under results/track.json.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from _common import save

import nbdist
from nbdist.tracking import runs

STEPS = 400
SLOW_S = 0.2
SETUP = """
import torch, nbdist
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(32, 64), torch.randn(32, 1)
"""
CELL = f"""
for step in range({STEPS}):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    nbdist.log(step=step, loss=loss.item(), lr=0.01)
"""


class _Slow(runs.TensorBoardRun):
    def scalars(self, points):
        time.sleep(SLOW_S)
        super().scalars(points)


def per_step(cluster: nbdist.Cluster) -> float:
    tic = time.perf_counter()
    cluster.run(CELL, quiet=True).raise_for_error()
    return (time.perf_counter() - tic) / STEPS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", default="2,16")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    out: dict[str, dict[str, float]] = {}
    folder = tempfile.mkdtemp(prefix="nbdist-track-bench-")
    for n in [int(v) for v in args.ranks.split(",")]:
        times: dict[str, list[float]] = {"untracked": [], "tensorboard": [], "slow tensorboard": []}
        with nbdist.start(n=n, oversubscribe=True, timeout=300) as cluster:
            cluster.run(SETUP, setup=True).raise_for_error()
            per_step(cluster)  # warm-up
            for rep in range(args.reps):
                for way in ("untracked", "tensorboard", "slow tensorboard"):
                    if way != "untracked":
                        tracker = nbdist.track("tensorboard", f"n{n}-{rep}-{way.replace(' ', '-')}", folder)
                        if way.startswith("slow"):
                            tracker.run.__class__ = _Slow
                    times[way].append(per_step(cluster))
                    if way != "untracked":
                        tic = time.perf_counter()
                        nbdist.untrack()
                        times.setdefault(f"{way} close_s", []).append(time.perf_counter() - tic)
                print(
                    f"{n} ranks, rep {rep + 1}: "
                    + ", ".join(
                        f"{w} {times[w][-1] * 1e3:.3f} ms/step"
                        for w in ("untracked", "tensorboard", "slow tensorboard")
                    ),
                    flush=True,
                )
        med = {w: statistics.median(v) for w, v in times.items()}
        out[str(n)] = med
        base = med["untracked"]
        print(
            f"{n} ranks, median per step: untracked {base * 1e3:.3f} ms, tensorboard {med['tensorboard'] * 1e3:.3f} ms "
            f"({(med['tensorboard'] / base - 1) * 100:+.1f}%), slow tensorboard {med['slow tensorboard'] * 1e3:.3f} ms "
            f"({(med['slow tensorboard'] / base - 1) * 100:+.1f}%); closing a run {med['tensorboard close_s']:.2f} s, "
            f"a slow one {med['slow tensorboard close_s']:.2f} s"
        )
    save("track", {"steps": STEPS, "slow_s": SLOW_S, "median_s_per_step": out})


if __name__ == "__main__":
    main()
