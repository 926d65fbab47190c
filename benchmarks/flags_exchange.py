"""The preemption flags at a world's first step and at every exchange after (#52): over the world's store (as
shipped, engine/flags.py) against an all-reduce on a gloo group of every rank (as before session 43), alternated in one
world.

A ``loader.steps()`` loop says its part of the flags' exchange at its first step boundary and reads it at the next
(engine/preempt.py); over a group, that group is made at the first boundary, by every rank at once, before the first
step can begin: every world's, a rebuilt one's included. Each trial does what the loop does at its first two
boundaries, by hand, with keys or a group of its own (so each trial starts afresh): it says its part (``group``: the
group made first), takes one DDP step (the recovery benchmark's model), reads the exchange, and takes a second step.
Timed on each rank from a barrier: the first step's start and the two steps' end; the slowest rank's figure counts
(the world goes at its pace). Then the exchange's own cost once the group is made: ``EXCHANGES`` exchanges, each said,
a step, then read, and the time the main thread spent saying and reading, per exchange (the slowest rank's).
JSON under results/flags_exchange.json.
"""

from __future__ import annotations

import argparse
import statistics

from _common import alternated, save

import nbdist
from nbdist.cells.output import Sink

SETUP = """
import time, torch
from nbdist.engine import flags
from nbdist.engine.state import STATE
from nbdist.parallel import apply_ddp
torch.manual_seed(0)
model = apply_ddp(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
x, y = torch.randn(4, 8), torch.randn(4, 1)
EXCHANGES = 20

def step():
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()

def exchange(way, made, key, index):
    rank, size = dist.get_rank(), dist.get_world_size()
    if way == "group":
        return flags.OverGroup(made, rank, size, False, 0, False)
    ex = flags.OverStore(STATE.store, f"{STATE.forming[0]}{key}/", STATE.forming[1], index, rank, size)
    ex.say(False, 0, False)
    return ex

def trial(way, key):
    dist.barrier()
    tic = time.perf_counter()
    made = dist.new_group(backend="gloo") if way == "group" else None
    pending = exchange(way, made, key, 0)
    first = time.perf_counter() - tic
    step()
    pending.read()
    step()
    took = time.perf_counter() - tic
    spent = 0.0
    for index in range(1, EXCHANGES + 1):
        t0 = time.perf_counter()
        pending = exchange(way, made, key, index)
        spent += time.perf_counter() - t0
        step()
        t0 = time.perf_counter()
        pending.read()
        spent += time.perf_counter() - t0
    if made is not None:
        dist.destroy_process_group(made)
    return first, took, spent / EXCHANGES
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", default="16,64")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    out: dict[str, dict] = {}
    for n in (int(x) for x in args.ranks.split(",")):
        with nbdist.start(n, oversubscribe=True, timeout=300, progress=lambda s: None) as c:
            c.run(SETUP, sink=Sink()).raise_for_error()
            count = iter(range(10**6))

            def measure(way: str, c=c, count=count) -> dict[str, float]:
                r = c.run(f"trial({way!r}, 'bench-{next(count)}')", sink=Sink())
                r.raise_for_error()
                told = [eval(rank.result["data"]["text/plain"]) for rank in r.ranks]  # noqa: S307 - our own tuples
                return {
                    "first_s": max(t[0] for t in told),
                    "two_steps_s": max(t[1] for t in told),
                    "exchange_s": max(t[2] for t in told),
                }

            measure("store")  # warm-up: the step's first call
            rows = alternated(["store", "group"], args.rounds, measure)
        out[str(n)] = {way: {k: [s[k] for s in samples] for k in samples[0]} for way, samples in rows.items()}
        for way, samples in rows.items():
            first = statistics.median(s["first_s"] for s in samples)
            two = statistics.median(s["two_steps_s"] for s in samples)
            each = statistics.median(s["exchange_s"] for s in samples)
            print(
                f"{n:3d} ranks, over {'the store' if way == 'store' else 'a group':9s}: first step begins "
                f"{first * 1000:7.1f} ms, two steps {two * 1000:7.1f} ms "
                f"({sorted(round(s['two_steps_s'] * 1000) for s in samples)}); then an exchange costs the main "
                f"thread {each * 1e6:7.0f} us (slowest rank, medians of {len(samples)})"
            )
    save("flags_exchange", out)


if __name__ == "__main__":
    main()
