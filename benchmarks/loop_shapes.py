"""Batches computed again after a kill, per loop shape (#50): recovery from the living rank's memory against what
these loops got before it covered them, in the same run.

Each shape trains a small DDP model on 2 ranks (``--max-restarts 1``, 32 batches a rank, 20 ms of sleep a batch
standing in for work); rank 1 is SIGKILLed from outside after batch ``--kill-at``, and the cell recovers by itself.
Counted on rank 0 (it lived): the batches it computed beyond the 32, and kill -> the cell's end.

- ``peer``: ``--recover-from peer``, the default;
- ``start over``: ``--recover-from checkpoint`` with no checkpoint saved: the setup is replayed and the cell runs
  from its first line, as a plain ``for``, ``enumerate`` or two optimizers were recovered before #50 (only
  ``loader.steps()`` with one optimizer went on from the living rank).

Shapes: ``loader.steps(32)``, ``for x, y in loader`` (two epochs of 16, ``range(loader.epoch, 2)``),
``enumerate(loader)``, a GAN's two optimizers, gradient accumulation (a step every 4 batches), and ``range(2)``
around the loader's loop (which recovery refuses, saying what to write). Also what keeping the parts costs a batch
of a plain ``for`` (``--max-restarts 1`` against 0, no sleep). JSON under results/loop_shapes.json.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import tempfile
import threading
import time

from _common import save, stats

import nbdist
from nbdist.cells.output import Sink

SETUP = """
import time, torch
from nbdist.parallel import apply_ddp, shard
torch.manual_seed(0)
model = apply_ddp(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))
opt = torch.optim.Adam(model.parameters(), lr=0.01)
G = apply_ddp(torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8)))
D = apply_ddp(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LeakyReLU(0.2), torch.nn.Linear(16, 1)))
optG, optD = torch.optim.Adam(G.parameters(), lr=1e-3), torch.optim.Adam(D.parameters(), lr=1e-3)
_g = torch.Generator().manual_seed(1)
X = torch.randn({n}, 8, generator=_g)
loader = shard(torch.utils.data.TensorDataset(X, X.sum(1, keepdim=True)), batch_size=8, seed=2)
bce = torch.nn.functional.binary_cross_entropy_with_logits
computed = globals().get("computed", 0)
"""
STEP = "loss = torch.nn.functional.mse_loss(model(x), y); opt.zero_grad(); loss.backward(); opt.step()"
MARK = "computed += 1; open(PROGRESS, 'w').write(str(loader.step)) if dist.get_rank() == 1 else None; time.sleep(SLEEP)"
GAN = """
    fake = G(torch.randn(len(x), 4))
    d_loss = bce(D(torch.cat([x, fake.detach()])), torch.cat([torch.ones(len(x), 1), torch.zeros(len(x), 1)]))
    optD.zero_grad(); d_loss.backward(); optD.step()
    g_loss = bce(D(fake), torch.ones(len(x), 1)); optG.zero_grad(); g_loss.backward(); optG.step()
"""
SHAPES = {  # the cell, the samples (32 batches a rank on 2 ranks, in one epoch or two)
    "loader.steps(32)": (f"for step, (x, y) in loader.steps(32):\n    {STEP}\n    {MARK}\n", 512),
    "for x, y in loader": (f"for epoch in range(loader.epoch, 2):\n  for x, y in loader:\n    {STEP}\n    {MARK}\n", 256),
    "enumerate(loader)": (f"for i, (x, y) in enumerate(loader, loader.batch):\n    {STEP}\n    {MARK}\n", 512),
    "a GAN's two optimizers": (f"for x, y in loader:{GAN}    {MARK}\n", 512),
    "gradient accumulation": (
        "for i, (x, y) in enumerate(loader, loader.batch):\n"
        "    loss = torch.nn.functional.mse_loss(model(x), y); loss.backward()\n"
        f"    if (i + 1) % 4 == 0:\n        opt.step(); opt.zero_grad()\n    {MARK}\n",
        512,
    ),
    "range(2) around it": (f"for epoch in range(2):\n  for x, y in loader:\n    {STEP}\n    {MARK}\n", 256),
}
SOURCES = {"peer": "peer", "start over": "checkpoint"}
BATCHES = 32


def once(cell: str, n: int, source: str, kill_at: int, sleep: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp, nbdist.start(
        2, max_restarts=1, recover_from=source, oversubscribe=True, timeout=90
    ) as c:
        progress = os.path.join(tmp, "progress")
        c.run(f"PROGRESS, SLEEP = {progress!r}, {sleep}\n" + SETUP.format(n=n), setup=True).raise_for_error()
        pid, killed = c.engines.ranks[1].pid, []

        def killer() -> None:
            while True:
                try:
                    if int(open(progress).read() or -1) >= kill_at:
                        break
                except (OSError, ValueError):
                    pass
                time.sleep(0.002)
            os.kill(pid, signal.SIGKILL)
            killed.append(time.perf_counter())

        thread = threading.Thread(target=killer, daemon=True)
        thread.start()
        result = c.run(cell, sink=Sink()).raise_for_error()
        end = time.perf_counter()
        thread.join(10)
        [line] = result.recovered
        computed = c.pull("computed", ranks=[0])[0]
    return {
        "again": computed - BATCHES,
        "kill_to_end_s": end - killed[0],
        "from_memory": "memory (nothing recomputed)" in line,
        "line": re.sub(r" in \d+\.\d s", "", line),
    }


def overhead(reps: int, steps: int = 400) -> dict:
    """ms a batch of a plain for, no sleep: --max-restarts 1 (parts kept and mirrored) against 0."""
    cell = f"import time\n_t = time.perf_counter()\nfor x, y in loader:\n    {STEP}\nper_batch = (time.perf_counter() - _t) / len(loader)\n"
    out: dict[str, list[float]] = {"kept": [], "not kept": []}
    for _ in range(reps):
        for name, restarts in (("kept", 1), ("not kept", 0)):
            with nbdist.start(2, max_restarts=restarts, oversubscribe=True, timeout=90) as c:
                c.run(SETUP.format(n=steps * 16), setup=True).raise_for_error()
                c.run(cell).raise_for_error()  # warm
                c.run(cell).raise_for_error()
                out[name].append(max(c.pull("per_batch")) * 1e3)
        print(f"ms a batch: kept {out['kept'][-1]:.3f}, not kept {out['not kept'][-1]:.3f}")
    result = {k: stats(v) for k, v in out.items()}
    base = result["not kept"]["median"]
    return {**result, "cost_pct": 100 * (result["kept"]["median"] - base) / base}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kill-at", type=int, default=22)
    parser.add_argument("--sleep", type=float, default=0.02)
    parser.add_argument("--reps", type=int, default=3, help="rounds of the overhead measure")
    parser.add_argument("--shapes", default=";".join(SHAPES), help="which, separated by ';'")
    args = parser.parse_args()
    results: dict = {"kill_at": args.kill_at, "batches": BATCHES, "shapes": {}}
    for shape in args.shapes.split(";"):
        cell, n = SHAPES[shape]
        results["shapes"][shape] = {}
        for name, source in SOURCES.items():
            got = once(cell, n, source, args.kill_at, args.sleep)
            results["shapes"][shape][name] = got
            print(f"{shape:24} {name:10} batches again {got['again']:3d}  kill -> end {got['kill_to_end_s']:.1f} s")
    results["overhead"] = overhead(args.reps)
    save("loop_shapes", results)


if __name__ == "__main__":
    main()
