"""Cost of live metrics: the same DDP loop with apply_ddp(metrics=True) and metrics=False,
plus how often metric batches reach the notebook while a model with metrics trains.

Models with metrics on, off, and with torch's own Python ``allreduce_hook`` (no metrics:
what any Python comm hook costs) train in short blocks, the order rotating every round,
all in one cell: the machine's drift hits every mode alike. The cost is the median over
rounds of (on / off - 1), each round comparing blocks run seconds apart; its spread is
given as the interquartile range and a bootstrap 90% interval of the median.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from _common import save, stats

from nbdist.cells.output import Sink

LOOP = """
import time, statistics
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from nbdist.parallel import apply_ddp
import sys; sys.path.insert(0, BENCH_DIR)
from _ddp_loop import make_model
g = torch.Generator().manual_seed(dist.get_rank())
x, y = torch.randn(64, 512, generator=g), torch.randint(0, 10, (64,), generator=g)
models = {"on": apply_ddp(make_model(), metrics=True), "off": apply_ddp(make_model(), metrics=False),
          "python_hook": apply_ddp(make_model(), metrics=False, comm_hook=allreduce_hook, hook_state=None)}
opts = {mode: torch.optim.SGD(m.parameters(), lr=0.01) for mode, m in models.items()}
order = list(models)
block_s = {mode: [] for mode in models}  # one median step time per round and mode
for rnd in range(ROUNDS + 1):  # round 0 warms every model up and is not kept
    for mode in order[rnd % 3:] + order[:rnd % 3]:  # rotate who goes first
        times = []
        for i in range(STEPS + 2):
            t = time.perf_counter()
            opts[mode].zero_grad()
            torch.nn.functional.cross_entropy(models[mode](x), y).backward()
            opts[mode].step()
            if i >= 2:  # the first steps after a switch pay for cold caches
                times.append(time.perf_counter() - t)
        if rnd:
            block_s[mode].append(statistics.median(times))
"""


# The dashboard's refresh: the metrics-on model alone, training for REFRESH_S seconds.
REFRESH = """
model, opt = models["on"], opts["on"]
tic = time.perf_counter()
while time.perf_counter() - tic < REFRESH_S:
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
"""


class Counter(Sink):
    def __init__(self) -> None:
        self.batches: list[float] = []

    def metrics(self, rank, rows):
        if rank == 0:
            self.batches.append(time.perf_counter())


def bootstrap_median(samples: list[float], reps: int = 2000, level: float = 0.90) -> tuple[float, float]:
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(samples, k=len(samples))) for _ in range(reps))
    lo = meds[int((1 - level) / 2 * reps)]
    hi = meds[int((1 + level) / 2 * reps) - 1]
    return lo, hi


def main() -> None:
    import pathlib

    import nbdist

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=60, help="rounds of blocks, one block per mode each")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per block")
    parser.add_argument("--refresh-s", type=float, default=6.0, help="seconds of training to count metric batches")
    args = parser.parse_args()
    with nbdist.start(n=2) as cluster:
        cluster.push({"BENCH_DIR": str(pathlib.Path(__file__).parent), "ROUNDS": args.rounds, "STEPS": args.steps})
        cluster.run(LOOP, quiet=True).raise_for_error()
        per_rank = cluster.pull("block_s")
        cluster.push({"REFRESH_S": args.refresh_s})
        sink = Counter()
        tic = time.perf_counter()
        cluster.run(REFRESH, sink=sink).raise_for_error()
        took = time.perf_counter() - tic
    # both ranks wait for each other every step: a round's figure is the mean of the ranks'
    block = {m: [sum(r[m][i] for r in per_rank) / len(per_rank) for i in range(args.rounds)] for m in per_rank[0]}
    ratios = {m: [a / b - 1 for a, b in zip(block[m], block["off"], strict=True)] for m in ("on", "python_hook")}
    out: dict = {"rounds": args.rounds, "steps_per_block": args.steps}
    for m, r in ratios.items():
        q = statistics.quantiles(r, n=4)
        lo, hi = bootstrap_median(r)
        out[f"{m}_vs_off"] = {
            "median": statistics.median(r),
            "iqr": [q[0], q[2]],
            "ci90_of_median": [lo, hi],
            "samples": r,
        }
    out["step_s"] = {m: stats(v) for m, v in block.items()}
    # metric batches reaching the notebook per second while the metrics-on model trains
    # (the cell's wall time, start-up and the last flush included)
    out["batches_per_s"] = len(sink.batches) / took
    cost = out["on_vs_off"]
    py = out["python_hook_vs_off"]
    print(
        f"step: metrics off {out['step_s']['off']['median'] * 1e3:.2f} ms, on {out['step_s']['on']['median'] * 1e3:.2f} ms,"
        f" torch's Python allreduce_hook {out['step_s']['python_hook']['median'] * 1e3:.2f} ms"
    )
    print(
        f"cost of live metrics: {cost['median']:+.1%} (median of {args.rounds} paired rounds; 90% interval of the median"
        f" {cost['ci90_of_median'][0]:+.1%} to {cost['ci90_of_median'][1]:+.1%}; target <= 2%)"
    )
    print(
        f"for reference, torch's own Python allreduce_hook without metrics: {py['median']:+.1%}"
        f" ({py['ci90_of_median'][0]:+.1%} to {py['ci90_of_median'][1]:+.1%})"
    )
    print(f"metric batches reaching the notebook while training: {out['batches_per_s']:.1f} per second (target >= 2)")
    save("instrumentation", out)


if __name__ == "__main__":
    main()
