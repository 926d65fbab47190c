"""Compression benchmarks: kernel throughput against a numpy copy and torch.topk, JIT warm
start, and 2-rank DDP step time with compression against none (same MLP as ddp_throughput).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap
import time

import numpy as np
from _common import save, stats

N = 10_000_000


def best_of(fn, reps: int = 7) -> float:
    fn()  # warm (and compile)
    times = []
    for _ in range(reps):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return min(times)


def kernels_bench() -> dict:
    import numba
    import torch

    from nbdist.compression import kernels as K

    numba.set_num_threads(1)  # per core
    torch.set_num_threads(1)
    x = np.random.default_rng(0).standard_normal(N).astype(np.float32)
    dst = np.empty_like(x)
    gb = x.nbytes / 1e9
    # outputs preallocated, as the hooks keep them per bucket (and as the copy's destination is)
    q, packed, dense = np.empty(N, np.int8), np.empty(N // 8, np.uint8), np.empty(N, np.float32)
    norm = K.qsgd_quantize(x, 127, 1, q)
    scale = K.sign_pack(x, packed)
    k = N // 100
    t = {
        "numpy_copy": best_of(lambda: np.copyto(dst, x)),
        "topk_1pct": best_of(lambda: K.topk(x, k, 0)),
        "sign_pack": best_of(lambda: K.sign_pack(x, packed)),
        "sign_unpack": best_of(lambda: K.sign_unpack(packed, scale, dense)),
        "int8_dequantize": best_of(lambda: K.qsgd_dequantize(q, norm, 127, dense)),
        "qsgd_quantize": best_of(lambda: K.qsgd_quantize(x, 127, 1, q)),
    }
    xt = torch.from_numpy(x)
    t["torch_topk_1pct"] = best_of(lambda: torch.topk(xt.abs(), k), reps=3)
    out = {name: {"s": s, "GB_per_s": gb / s, "vs_copy": t["numpy_copy"] / s} for name, s in t.items()}
    out["topk_speedup_vs_torch"] = t["torch_topk_1pct"] / t["topk_1pct"]
    return out


JIT_PROBE = textwrap.dedent(
    """
    import time, numpy as np
    from nbdist.compression import kernels as K  # imports (torch comes with the package) are not JIT cost
    x = np.random.default_rng(0).standard_normal(100_000).astype(np.float32)
    tic = time.perf_counter()
    q, p, out = np.empty(x.size, np.int8), np.empty(x.size // 8, np.uint8), np.empty(x.size, np.float32)
    K.topk(x, 1000, 0); n = K.qsgd_quantize(x, 127, 0, q); K.qsgd_dequantize(q, n, 127, out)
    s = K.sign_pack(x, p); K.sign_unpack(p, s, out); K.randomk_indices(x.size, 1000, 0); K.scatter(x[:10], np.arange(10, dtype=np.int32), out)
    first = time.perf_counter() - tic
    tic = time.perf_counter()
    q, p, out = np.empty(x.size, np.int8), np.empty(x.size // 8, np.uint8), np.empty(x.size, np.float32)
    K.topk(x, 1000, 0); n = K.qsgd_quantize(x, 127, 0, q); K.qsgd_dequantize(q, n, 127, out)
    s = K.sign_pack(x, p); K.sign_unpack(p, s, out); K.randomk_indices(x.size, 1000, 0); K.scatter(x[:10], np.arange(10, dtype=np.int32), out)
    print(first - (time.perf_counter() - tic))
    """
)


def jit_bench() -> dict:
    runs = []
    for _ in range(3):  # the first may compile; the later ones load the cache
        out = subprocess.run([sys.executable, "-c", JIT_PROBE], capture_output=True, text=True, check=True)
        runs.append(float(out.stdout.strip().splitlines()[-1]))
    return {"first_process_s": runs[0], "warm_cache_overhead_s": stats(runs[1:])}


DDP = textwrap.dedent(
    """
    import time
    from nbdist.parallel import apply_ddp
    import sys; sys.path.insert(0, BENCH_DIR)
    from _ddp_loop import make_model
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(64, 512, generator=g), torch.randint(0, 10, (64,), generator=g)
    results = {}
    for spec in SPECS:
        model = apply_ddp(make_model(), compression=spec)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for i in range(STEPS + 10):
            if i == 10:
                dist.barrier(); tic = time.perf_counter()
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        dist.barrier()
        results[spec] = {"step_s": (time.perf_counter() - tic) / STEPS, "final_loss": loss.item()}
    """
)


def ddp_bench(rounds: int) -> dict:
    import pathlib

    import nbdist

    specs = ("none", "topk:0.01", "qsgd:127", "fp16")
    per: dict[str, list[dict]] = {s: [] for s in specs}
    with nbdist.start(n=2) as cluster:
        cluster.push({"SPECS": specs, "STEPS": 60, "BENCH_DIR": str(pathlib.Path(__file__).parent)})
        for _ in range(rounds):
            cluster.run(DDP, quiet=True).raise_for_error()
            res = cluster.pull("results", ranks=0)[0]
            for s in specs:
                per[s].append(res[s])
    out = {s: {"step_s": stats([r["step_s"] for r in per[s]]), "final_loss": per[s][-1]["final_loss"]} for s in specs}
    base = out["none"]["step_s"]["median"]
    for s in specs:
        out[s]["vs_none"] = out[s]["step_s"]["median"] / base
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    kern = kernels_bench()
    print("kernels on 10M float32, one thread (GB/s of input; x of a numpy copy):")
    for name in (
        "numpy_copy",
        "topk_1pct",
        "sign_pack",
        "sign_unpack",
        "int8_dequantize",
        "qsgd_quantize",
        "torch_topk_1pct",
    ):
        r = kern[name]
        print(f"  {name:18s} {r['s'] * 1e3:8.1f} ms  {r['GB_per_s']:6.2f} GB/s  {r['vs_copy']:.2f}x copy")
    print(f"  top-k vs torch.topk: {kern['topk_speedup_vs_torch']:.1f}x faster")
    jit = jit_bench()
    print(
        f"JIT: first process {jit['first_process_s']:.2f} s; warm cache overhead median {jit['warm_cache_overhead_s']['median']:.3f} s"
    )
    ddp = ddp_bench(args.rounds)
    print("2-rank gloo DDP, MLP 512-1024-1024-10, batch 64 per rank:")
    for spec, r in ddp.items():
        print(
            f"  {spec:10s} step {r['step_s']['median'] * 1e3:6.1f} ms  ({r['vs_none']:.2f}x none)  final loss {r['final_loss']:.4f}"
        )
    save("compression", {"kernels": kern, "jit": jit, "ddp": ddp})


if __name__ == "__main__":
    main()
