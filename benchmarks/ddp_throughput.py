"""DDP throughput in nbdist engines against plain torchrun processes, alternated in one run.

The same loop (benchmarks/_ddp_loop.py: an MLP, 2 ranks x batch 64, gloo, one thread per
rank) runs in both. ``--gpu``: one rank per CUDA device, NCCL, batch 1024 per rank, in both. Reports samples/s, step time and the share of a step spent in
communication (measured by re-running the step with the all-reduce replaced by a no-op hook).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

from _common import save, stats

HERE = pathlib.Path(__file__).resolve().parent


def torchrun_once(ranks: int = 2, gpu: bool = False, batch: int = 64) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={ranks}",
            str(HERE / "_ddp_loop.py"),
            out,
            "cuda" if gpu else "cpu",
            str(batch),
        ]
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
        with open(out) as fh:
            return json.load(fh)


def main() -> None:
    import nbdist

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--gpu", action="store_true", help="one rank per CUDA device, NCCL (both runners)")
    args = parser.parse_args()
    ranks, batch = 2, 64
    if args.gpu:
        import torch

        ranks, batch = torch.cuda.device_count(), 1024
        if ranks < 1:
            raise SystemExit("--gpu: no CUDA device here")
    ours, theirs = [], []
    with nbdist.start(n=ranks, backend="nccl" if args.gpu else None) as cluster:
        cluster.run(f"import sys\nsys.path.insert(0, {str(HERE)!r})\nimport _ddp_loop", quiet=True).raise_for_error()
        for i in range(args.rounds):
            theirs.append(torchrun_once(ranks, args.gpu, batch))
            cluster.run(
                f"from nbdist.parallel import device\nbench = _ddp_loop.measure(batch={batch}, device=str(device()))"
            ).raise_for_error()
            ours.append(cluster.pull("bench", ranks=0)[0])
            print(
                f"round {i + 1}: torchrun {theirs[-1]['samples_per_s']:.0f} samples/s, "
                f"nbdist {ours[-1]['samples_per_s']:.0f} samples/s",
                flush=True,
            )
    t = stats([r["samples_per_s"] for r in theirs])
    o = stats([r["samples_per_s"] for r in ours])
    ratio = o["median"] / t["median"]
    step = stats([r["step_s"] for r in ours])
    comm = stats([r["comm_fraction"] for r in ours])
    comm_t = stats([r["comm_fraction"] for r in theirs])
    print(
        f"\nmedian torchrun: {t['median']:.0f} samples/s;  nbdist: {o['median']:.0f} samples/s  ({ratio:.3f}x; target >= 0.98)"
    )
    print(
        f"nbdist step time {step['median'] * 1e3:.2f} ms, communication {comm['median']:.0%} of a step (torchrun: {comm_t['median']:.0%})"
    )
    save(
        "ddp_throughput_gpu" if args.gpu else "ddp_throughput",
        {
            "ranks": ranks,
            "batch_per_rank": batch,
            "torchrun_samples_per_s": t,
            "nbdist_samples_per_s": o,
            "ratio": ratio,
            "nbdist_step_s": step,
            "nbdist_comm_fraction": comm,
            "torchrun_comm_fraction": comm_t,
        },
    )


if __name__ == "__main__":
    main()
