"""The preemption flags' group at a world's first step (#52): made on a thread while the step runs, against made on
the loop's thread before the step begins (as before session 42), alternated in one world.

A ``loader.steps()`` loop's first step boundary starts the flags' exchange (engine/preempt.py) on a gloo group of every
rank, made then: the first step of every world, a rebuilt one included. Each trial here does what the loop does at its
first two boundaries, by hand, on a group of its own (a purpose of its own, so each trial makes its group afresh): it
starts the exchange (``thread``: ``control.start_flight``, as shipped; ``loop``: ``control.control_group`` then the
all-reduce, the way before), takes one DDP step (the recovery benchmark's model), reads the exchange, and takes a
second step. Timed on each rank from a barrier: the first step's start, and the two steps' end; the slowest rank's
figure counts (the world goes at its pace). The trial's group is then freed. JSON under results/flags_group.json.
"""

from __future__ import annotations

import argparse
import statistics

from _common import alternated, save

import nbdist
from nbdist.cells.output import Sink

SETUP = """
import time, torch
from nbdist.engine import control
from nbdist.engine.state import STATE
from nbdist.parallel import apply_ddp
torch.manual_seed(0)
model = apply_ddp(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
x, y = torch.randn(4, 8), torch.randn(4, 1)

def step():
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()

def trial(way, purpose):
    buf = torch.zeros(dist.get_world_size() + 2, dtype=torch.int64)
    dist.barrier()
    tic = time.perf_counter()
    if way == "thread":
        flight = control.start_flight(purpose, buf)
    else:
        flight = control.Flight(buf, dist.group.WORLD, control.start_max(control.control_group(purpose), buf))
    first = time.perf_counter() - tic
    step()
    control.result(flight)
    step()
    took = time.perf_counter() - tic
    group = STATE.control.pop(purpose)
    if way == "loop":
        dist.destroy_process_group(group)
    del group, flight
    return first, took
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
                return {"first_s": max(t[0] for t in told), "two_steps_s": max(t[1] for t in told)}

            measure("thread")  # warm-up: the step's first call
            rows = alternated(["thread", "loop"], args.rounds, measure)
        out[str(n)] = {way: {k: [s[k] for s in samples] for k in samples[0]} for way, samples in rows.items()}
        for way, samples in rows.items():
            first = statistics.median(s["first_s"] for s in samples)
            two = statistics.median(s["two_steps_s"] for s in samples)
            print(f"{n:3d} ranks, group made on {'a thread' if way == 'thread' else 'the loop':9s}: "
                  f"first step begins {first * 1000:7.1f} ms, two steps {two * 1000:7.1f} ms "
                  f"(slowest rank, medians of {len(samples)}; two steps {sorted(round(s['two_steps_s'], 3) for s in samples)})")
    save("flags_group", out)


if __name__ == "__main__":
    main()
