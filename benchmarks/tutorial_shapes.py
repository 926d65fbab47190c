"""PyTorch's tutorial launch shapes: an ``mp.spawn`` DDP program as its authors run it against the same file on
nbdist's ranks, and what ``exit()`` in a cell costs the next cell.

Measured in one run, on one machine:

* ``python prog.py``: the program starts its own 2 processes (each imports torch and forms a world), trains,
  ends: the reference, and what a learner pays for every run outside a notebook;
* ``%dist_run prog.py`` and the same text pasted into a ``%%distributed`` cell, on a world already up: the
  program's ``mp.spawn`` runs ``fn(RANK)`` in each rank (engine/spawned.py); final weights compared bit for bit;
* ``exit()`` in a cell, then a collective: the ranks stay up (before this work, the cell said ok and every rank
  died; the next cell failed and ``%dist_restart`` had to start the world again, about 0.4 s plus the setup).

Usage: OMP_NUM_THREADS=1 python benchmarks/tutorial_shapes.py [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time

import torch
from _common import run_cell, save, shell, stats

PROGRAM = """
import os, sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP


def demo(rank, world_size, out):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = "PORT_NUMBER"
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    data = torch.Generator().manual_seed(rank)
    for _ in range(50):
        opt.zero_grad()
        x = torch.randn(32, 32, generator=data)
        torch.nn.functional.mse_loss(model(x), x[:, :8]).backward()
        opt.step()
    torch.save([p.detach() for p in model.parameters()], f"{out}-rank{rank}.pt")
    dist.barrier()  # no process exits before both have written (tests/torchrun.py)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(demo, args=(2, OUT_PATH), nprocs=2, join=True)
"""


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _program(out: pathlib.Path) -> str:
    return PROGRAM.replace("PORT_NUMBER", _port()).replace("OUT_PATH", repr(str(out)))


def _weights(out: pathlib.Path) -> list[list[torch.Tensor]]:
    return [torch.load(f"{out}-rank{r}.pt") for r in (0, 1)]


def _same(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> bool:
    return all(torch.equal(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    work = pathlib.Path(tempfile.mkdtemp(prefix="nbdist-bench-shapes-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    times: dict[str, list[float]] = {"python prog.py": [], "%dist_run prog.py": [], "pasted cell": [], "exit() + next": []}
    same = {"%dist_run prog.py": True, "pasted cell": True}
    ip = shell()
    run_cell(ip, "%dist_start -n 2")
    try:
        for i in range(args.reps):
            ref = work / f"ref{i}"
            script = work / f"prog{i}.py"
            script.write_text(_program(ref))
            tic = time.perf_counter()
            done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
            times["python prog.py"].append(time.perf_counter() - tic)
            exit_abort = "terminate called without an active exception" in done.stderr  # torch 2.13 at exit
            assert done.returncode == 0 or exit_abort, done.stderr[-2000:]
            reference = _weights(ref)

            mine = work / f"run{i}"
            script.write_text(_program(mine))
            tic = time.perf_counter()
            run_cell(ip, f"%dist_run --quiet {script}")
            times["%dist_run prog.py"].append(time.perf_counter() - tic)
            same["%dist_run prog.py"] &= _same(_weights(mine), reference)

            pasted = work / f"cell{i}"
            tic = time.perf_counter()
            run_cell(ip, f"%%distributed --quiet\n{_program(pasted)}")
            times["pasted cell"].append(time.perf_counter() - tic)
            same["pasted cell"] &= _same(_weights(pasted), reference)

            tic = time.perf_counter()
            run_cell(ip, "%%distributed --quiet\nexit()\nprint('not reached')")
            run_cell(ip, "%%distributed --quiet\n_t = torch.ones(1)\ndist.all_reduce(_t)")
            times["exit() + next"].append(time.perf_counter() - tic)
    finally:
        run_cell(ip, "%dist_stop")
    out = {name: stats(samples) for name, samples in times.items()}
    ref_s = out["python prog.py"]["median"]
    print(f"{'':<22}{'median s':>10}{'vs python prog.py':>20}   same weights as python prog.py")
    for name, row in out.items():
        ratio = f"{ref_s / row['median']:.0f}x faster" if name in same and row["median"] else ""
        print(f"{name:<22}{row['median']:>10.3f}{ratio:>20}   {same.get(name, '')}")
    save("tutorial_shapes", {"times": out, "bit_for_bit": same, "reps": args.reps})


if __name__ == "__main__":
    main()
