"""Cost of live metrics: the same DDP loop with apply_ddp(metrics=True) and metrics=False,
two models trained in alternating blocks of 10 steps in one cell (so the machine's drift
hits both alike), plus how often metric batches reach the notebook during training.
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
models = {flag: apply_ddp(make_model(), metrics=flag) for flag in (True, False)}
opts = {flag: torch.optim.SGD(m.parameters(), lr=0.01) for flag, m in models.items()}
times = {True: [], False: []}
for block in range(2 * BLOCKS):  # alternate blocks of 10 steps: drift hits both alike
    flag = block % 2 == 0
    for i in range(10):
        t = time.perf_counter()
        opts[flag].zero_grad()
        torch.nn.functional.cross_entropy(models[flag](x), y).backward()
        opts[flag].step()
        if block >= 2 and i >= 2:
            times[flag].append(time.perf_counter() - t)
step_on, step_off = statistics.median(times[True]), statistics.median(times[False])
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
        cluster.push({"BENCH_DIR": str(pathlib.Path(__file__).parent), "BLOCKS": 15})
        for _ in range(args.rounds):
            sink = Counter()
            tic = time.perf_counter()
            cluster.run(LOOP, sink=sink).raise_for_error()
            took = time.perf_counter() - tic
            on.append(max(cluster.pull("step_on")))
            off.append(max(cluster.pull("step_off")))
            rates.append(len(sink.batches) / took)  # a lower bound: only half of the steps log
    a, b = stats(on), stats(off)
    # within a round the blocks alternate; across rounds, the median of the paired ratios
    paired = stats([x / y - 1 for x, y in zip(on, off, strict=True)])
    cost = paired["median"]
    r = stats(rates)
    print(
        f"step with live metrics {a['median'] * 1e3:.2f} ms, without {b['median'] * 1e3:.2f} ms: cost {cost:+.1%}"
        f" (median of {len(on)} paired rounds, spread {paired['min']:+.1%} to {paired['max']:+.1%}; target <= 2%)"
    )
    print(f"metric batches reaching the notebook: {r['median']:.1f} per second (target >= 2)")
    save(
        "instrumentation",
        {
            "with_metrics_step_s": a,
            "without_metrics_step_s": b,
            "cost": cost,
            "paired_cost": paired,
            "batches_per_s": r,
        },
    )


if __name__ == "__main__":
    main()
