"""Cost of live metrics: the same DDP loop with apply_ddp(metrics=True) and metrics=False,
alternated in one run, plus how often metric batches reach the notebook during training.
"""

from __future__ import annotations

import argparse
import time

from _common import save, stats

from nbdist.run import Sink

LOOP = """
import time, statistics
from nbdist.parallel import apply_ddp
import sys; sys.path.insert(0, BENCH_DIR)
from _ddp_loop import make_model
g = torch.Generator().manual_seed(dist.get_rank())
x, y = torch.randn(64, 512, generator=g), torch.randint(0, 10, (64,), generator=g)
model = apply_ddp(make_model(), metrics=METRICS)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
times = []
for i in range(STEPS + 10):
    t = time.perf_counter()
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    times.append(time.perf_counter() - t)
step_s = statistics.median(times[10:])
"""


class Counter(Sink):
    def __init__(self) -> None:
        self.batches: list[float] = []

    def metrics(self, rank, rows):
        if rank == 0:
            self.batches.append(time.perf_counter())


def main() -> None:
    import pathlib

    import nbdist

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    on, off, rates = [], [], []
    with nbdist.start(n=2) as cluster:
        cluster.push({"BENCH_DIR": str(pathlib.Path(__file__).parent), "STEPS": 150})
        for _ in range(args.rounds):
            for flag in (True, False):
                cluster.push({"METRICS": flag})
                sink = Counter()
                tic = time.perf_counter()
                cluster.run(LOOP, sink=sink).raise_for_error()
                took = time.perf_counter() - tic
                step = max(cluster.pull("step_s"))
                (on if flag else off).append(step)
                if flag:
                    rates.append(len(sink.batches) / took)
    a, b = stats(on), stats(off)
    cost = a["median"] / b["median"] - 1
    r = stats(rates)
    print(
        f"step with live metrics {a['median'] * 1e3:.2f} ms, without {b['median'] * 1e3:.2f} ms: cost {cost:+.1%} (target <= 2%)"
    )
    print(f"metric batches reaching the notebook: {r['median']:.1f} per second (target >= 2)")
    save("instrumentation", {"with_metrics_step_s": a, "without_metrics_step_s": b, "cost": cost, "batches_per_s": r})


if __name__ == "__main__":
    main()
