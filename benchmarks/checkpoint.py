"""How long training is blocked per checkpoint: synchronous against asynchronous saves, same run.

2 ranks, a DDP MLP of about --mb MB of parameters (fp32) with SGD + momentum (as much optimizer
state again), saved to a temporary folder on this machine's disk. Each rep, in turn:

- ``sync``: ``save_checkpoint(...)``: the call's time is the time training is blocked;
- ``async``: ``save_checkpoint(..., asynchronous=True)``: the call's time (copying the state) is the
  time training is blocked; then how long until ``latest`` names the step (the files complete),
  measured while the ranks run training steps, as they would;
- the time of one training step, for scale.

Medians over --reps of the slower rank. JSON under results/checkpoint.json.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile

from _common import save

import nbdist

SETUP = """
import os, time, torch
from nbdist.parallel import apply_ddp, save_checkpoint, latest_step
from nbdist.parallel import checkpoint as _ckpt
WIDTH, LAYERS = {width}, {layers}
torch.manual_seed(0)
model = apply_ddp(torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]))
opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
x = torch.randn(16, WIDTH)


def train_step():
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


train_step()
tic = time.perf_counter(); train_step(); step_s = time.perf_counter() - tic
mb = sum(p.numel() for p in model.parameters()) * 4 / 2**20
"""

SAVE = """
tic = time.perf_counter()
save_checkpoint(PATH, model, opt, {step}, asynchronous={asynchronous}, keep=1)
blocked = time.perf_counter() - tic
steps_meanwhile = 0
while {asynchronous}:  # train until every rank's files are written (decided together: DDP steps are collective)
    writing = torch.tensor([int(bool(_ckpt._PENDING) and _ckpt._PENDING[0][0].is_alive())])
    dist.all_reduce(writing)
    if not writing.item():
        break
    train_step()
    steps_meanwhile += 1
_ckpt.wait_for_saves()
dist.barrier()
complete = time.perf_counter() - tic
assert latest_step(PATH) == {step}
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--mb", type=int, default=256, help="parameters, MB (the optimizer holds as much again)")
    args = parser.parse_args()
    width = 2048
    layers = max(1, round(args.mb * 2**20 / 4 / (width * width + width)))
    folder = tempfile.mkdtemp(prefix="nbdist-ckpt-bench-")
    per: dict[str, dict[str, list[float]]] = {
        "sync": {"blocked": [], "complete": []},
        "async": {"blocked": [], "complete": [], "steps_meanwhile": []},
    }
    try:
        with nbdist.start(2, timeout=120) as cluster:
            cluster.run(
                f"PATH = {folder + '/ckpt'!r}\n" + SETUP.format(width=width, layers=layers), quiet=True
            ).raise_for_error()
            mb, step_s = cluster.pull("mb")[0], max(cluster.pull("step_s"))
            step = 0
            for _ in range(args.reps):
                for way in ("sync", "async"):
                    step += 1
                    code = SAVE.format(step=step, asynchronous=way == "async")
                    cluster.run(code, quiet=True, timeout=600).raise_for_error()
                    per[way]["blocked"].append(max(cluster.pull("blocked")))
                    per[way]["complete"].append(max(cluster.pull("complete")))
                    if way == "async":
                        per[way]["steps_meanwhile"].append(min(cluster.pull("steps_meanwhile")))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    med = {way: {k: sorted(v)[len(v) // 2] for k, v in d.items()} for way, d in per.items()}
    print(
        f"model {mb:.0f} MB of parameters (+ as much momentum) on each of 2 ranks; one training step {step_s * 1e3:.0f} ms"
    )
    print(f"synchronous save: training blocked {med['sync']['blocked']:.2f} s")
    print(
        f"asynchronous save: training blocked {med['async']['blocked']:.2f} s; files complete after "
        f"{med['async']['complete']:.2f} s, {med['async']['steps_meanwhile']:.0f} training steps done meanwhile"
    )
    save(
        "checkpoint",
        {"ranks": 2, "param_mb": mb, "step_s": step_s, "reps": args.reps, "median_s": med, "samples_s": per},
    )


if __name__ == "__main__":
    main()
