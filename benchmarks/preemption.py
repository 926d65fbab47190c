"""The preemption check's cost per step: ``loader.steps(N)`` against ``preemptible=False``, same run.

2 ranks, a DDP MLP of several sizes, the loop the README teaches. Three ways, interleaved rep by
rep, their order rotated each rep, so that drift on a shared machine hits them alike:

- ``off``: ``loader.steps(N, preemptible=False)`` (no check: the reference);
- ``on``: ``loader.steps(N)``: a flag all_reduce started each step on nbdist's own gloo group and
  read one step later (engine/preempt.py);
- ``blocking``: the check as it was before (one blocking all_reduce of the flags on the training's
  group and ``.tolist()`` each step), written inline beside ``preemptible=False``.

Per-step times are medians over steps after a warm-up, then medians over --reps. JSON under
results/preemption.json. Target: ``on`` within 2% of ``off``. On a shared 2-core machine the
step times themselves drift by more than that between reps, so the benchmark also times the check
alone (``point_us``: calls of ``preempt.point`` with its exchanges, as ``loader.steps()`` makes them)
and the loader's loop with nothing in it, on and off.
"""

from __future__ import annotations

import argparse

from _common import save

import nbdist

SETUP = """
import time, torch, torch.distributed as dist
from nbdist.parallel import apply_ddp, shard
torch.manual_seed(0)
WIDTH = {width}
model = apply_ddp(torch.nn.Sequential(torch.nn.Linear(64, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH),
                                      torch.nn.ReLU(), torch.nn.Linear(WIDTH, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
X = torch.randn(8192, 64)
loader = shard(torch.utils.data.TensorDataset(X, X.sum(1, keepdim=True)), batch_size=32)


def run(way, steps, warm=20):
    loader.load_state_dict({{"epoch": 0, "batch": 0, "step": 0, "epoch_rng": None}})
    times, last = [], None
    for step, (x, y) in loader.steps(steps + warm, preemptible=(way == "on")):
        if way == "blocking":
            flags = torch.zeros(dist.get_world_size(), dtype=torch.int32)
            dist.all_reduce(flags)
            flags.tolist()
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        now = time.perf_counter()
        if last is not None and step >= warm:
            times.append(now - last)
        last = now
    times.sort()
    return times[len(times) // 2]


def point_us(calls=200000):
    # the check itself, per call (a step boundary), exchanges included: what loader.steps() adds to a step
    from nbdist.engine import preempt
    preempt.reset()
    tic = time.perf_counter()
    for i in range(calls):
        preempt.point(i)
    preempt.settle(calls)
    return 1e6 * (time.perf_counter() - tic) / calls


def empty_loop_us(preemptible, steps=20000):
    # the loop's own cost per step, with nothing in it: what the check adds, undiluted
    loader.load_state_dict({{"epoch": 0, "batch": 0, "step": 0, "epoch_rng": None}})
    tic = time.perf_counter()
    for step, batch in loader.steps(steps, preemptible=preemptible):
        pass
    return 1e6 * (time.perf_counter() - tic) / steps
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--widths", default="64,256,1024")
    args = parser.parse_args()
    results = {}
    with nbdist.start(2, timeout=60) as cluster:
        for width in map(int, args.widths.split(",")):
            cluster.run(SETUP.format(width=width), quiet=True).raise_for_error()
            per: dict[str, list[float]] = {"off": [], "on": [], "blocking": []}
            ways = list(per)
            for rep in range(args.reps):
                for way in ways[rep % 3 :] + ways[: rep % 3]:  # each way first, middle and last in turn
                    cluster.run(f"t = run({way!r}, {args.steps})", quiet=True).raise_for_error()
                    per[way].append(max(cluster.pull("t")))  # the slower rank sets the pace
            med = {way: sorted(v)[len(v) // 2] for way, v in per.items()}
            paired = sorted(on / off for on, off in zip(per["on"], per["off"], strict=True))
            cluster.run("pu = point_us()", quiet=True).raise_for_error()
            point = max(cluster.pull("pu"))
            loop = {}
            for way in ("off", "on"):
                cluster.run(f"u = empty_loop_us({way == 'on'})", quiet=True).raise_for_error()
                loop[way] = max(cluster.pull("u"))
            row = {
                "width": width,
                "step_ms": {way: round(v * 1e3, 4) for way, v in med.items()},
                "on_vs_off_pct": round(100 * (med["on"] / med["off"] - 1), 2),
                "blocking_vs_off_pct": round(100 * (med["blocking"] / med["off"] - 1), 2),
                "on_vs_off_paired_median_pct": round(100 * (paired[len(paired) // 2] - 1), 2),
                "empty_loop_us_per_step": {way: round(v, 3) for way, v in loop.items()},
                "point_us_per_call": round(point, 3),
                "point_vs_off_step_pct": round(100 * point * 1e-6 / med["off"], 4),
                "samples_ms": {way: [round(x * 1e3, 4) for x in v] for way, v in per.items()},
            }
            results[str(width)] = row
            print(
                f"width {width:>5}: step {med['off'] * 1e3:.3f} ms off, {med['on'] * 1e3:.3f} ms with the check "
                f"({row['on_vs_off_pct']:+.1f}%), {med['blocking'] * 1e3:.3f} ms with the blocking check "
                f"({row['blocking_vs_off_pct']:+.1f}%); paired per rep: {row['on_vs_off_paired_median_pct']:+.1f}%; "
                f"the loop alone: {loop['off']:.2f} us a step off, {loop['on']:.2f} us on; the check itself "
                f"{point:.3f} us a call = {row['point_vs_off_step_pct']:.3f}% of a step"
            )
    save("preemption", {"ranks": 2, "steps": args.steps, "reps": args.reps, "results": results})


if __name__ == "__main__":
    main()
