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


def best_of(fn, reps: int = 15) -> float:
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
    norms = np.empty(K.qsgd_chunks(N), np.float32)
    K.qsgd_quantize(x, 127, 1, q, norms)
    scale = K.sign_pack(x, packed)
    k = N // 100
    w = K.topk_workspace(N, k)
    top_vals, top_idx, cand_vals, cand_idx = (
        np.empty(k, np.float32),
        np.empty(k, np.int32),
        np.empty(w, np.float32),
        np.empty(w, np.int32),
    )
    t = {
        "numpy_copy": best_of(lambda: np.copyto(dst, x)),
        # as the hook runs it: outputs and candidate workspace kept per bucket
        "topk_1pct": best_of(lambda: K.topk_into(x, k, 0, top_vals, top_idx, cand_vals, cand_idx)),
        "topk_1pct_fresh_arrays": best_of(lambda: K.topk(x, k, 0)),
        "sign_pack": best_of(lambda: K.sign_pack(x, packed)),
        "sign_unpack": best_of(lambda: K.sign_unpack(packed, scale, dense)),
        "int8_dequantize": best_of(lambda: K.qsgd_dequantize(q, norms, 127, dense)),
        "qsgd_quantize": best_of(lambda: K.qsgd_quantize(x, 127, 1, q, norms)),
    }
    xt = torch.from_numpy(x)
    t["torch_topk_1pct"] = best_of(lambda: torch.topk(xt.abs(), k), reps=3)
    out = {name: {"s": s, "GB_per_s": gb / s, "vs_copy": t["numpy_copy"] / s} for name, s in t.items()}
    out["topk_speedup_vs_torch"] = t["torch_topk_1pct"] / t["topk_1pct"]
    return out


def checks_bench(rounds: int = 7) -> dict:
    """The cost of the index and length checks in the kernels that decode another rank's payload
    (issue 31): each checked kernel against its unchecked form, defined here as it was before,
    on the same 10M-entry bucket, alternating, median over rounds of each one's best of 5."""
    import numba
    from numba import njit

    from nbdist.compression import kernels as K

    numba.set_num_threads(1)
    jit = njit(nogil=True, fastmath=True)  # the kernels' flags (their cache aside)

    @jit
    def scatter_add_unchecked(values, indices, scale, out):
        f = np.float32(scale)
        for j in range(indices.size):
            out[indices[j]] += values[j] * f

    @jit
    def sign_unpack_add_unchecked(packed, scale, weight, out):
        s = np.float32(weight * scale)
        s2 = np.float32(2.0 * weight * scale)
        full = out.size // 8
        for b in range(full):
            v = packed[b]
            i = b * 8
            for j in range(8):
                out[i + j] += np.float32((v >> (7 - j)) & 1) * s2 - s
        for i in range(full * 8, out.size):
            out[i] += np.float32((packed[i >> 3] >> (7 - (i & 7))) & 1) * s2 - s
        return out

    @jit
    def qsgd_dequantize_add_unchecked(levels, norms, s, weight, out):
        for c in range(norms.size):
            f = np.float32(weight * norms[c] / s)
            start = c * K.QSGD_CHUNK
            ls = levels[start : start + K.QSGD_CHUNK]
            os_ = out[start : start + K.QSGD_CHUNK]
            for i in range(ls.size):
                os_[i] += np.float32(ls[i]) * f
        return out

    rng = np.random.default_rng(0)
    x = rng.standard_normal(N).astype(np.float32)
    dense = np.zeros(N, np.float32)
    packed, q = np.empty(N // 8, np.uint8), np.empty(N, np.int8)
    norms = np.empty(K.qsgd_chunks(N), np.float32)
    K.qsgd_quantize(x, 127, 1, q, norms)
    scale = K.sign_pack(x, packed)
    cases = {}
    for pct in (1, 10):  # top-k's 1% (the default), and a denser 10%
        k = N * pct // 100
        idx = np.sort(rng.choice(N, k, replace=False)).astype(np.int32)
        vals = x[idx]
        cases[f"scatter_add_{pct}pct"] = (
            lambda v=vals, i=idx: K.scatter_add(v, i, 0.5, dense),
            lambda v=vals, i=idx: scatter_add_unchecked(v, i, 0.5, dense),
        )
        parts = [(vals, idx), (x[idx[::-1].copy()], idx[::-1].copy())]

        def decompress(add, parts=parts):  # TopK.decompress of two ranks' parts: zero, then each part
            dense.fill(0.0)
            for v, i in parts:
                add(v, i, 0.5, dense)

        cases[f"topk_decompress_2_ranks_{pct}pct"] = (
            lambda d=decompress: d(K.scatter_add),
            lambda d=decompress: d(scatter_add_unchecked),
        )
    cases["sign_unpack_add"] = (
        lambda: K.sign_unpack_add(packed, scale, 0.5, dense),
        lambda: sign_unpack_add_unchecked(packed, scale, 0.5, dense),
    )
    cases["qsgd_dequantize_add"] = (
        lambda: K.qsgd_dequantize_add(q, norms, 127, 0.5, dense),
        lambda: qsgd_dequantize_add_unchecked(q, norms, 127, 0.5, dense),
    )
    out = {}
    for name, (checked, unchecked) in cases.items():
        a, b = [], []
        for _ in range(rounds):
            a.append(best_of(checked, reps=5))
            b.append(best_of(unchecked, reps=5))
        med_a, med_b = sorted(a)[len(a) // 2], sorted(b)[len(b) // 2]
        out[name] = {"checked_s": med_a, "unchecked_s": med_b, "cost_pct": 100.0 * (med_a / med_b - 1.0)}
    return out


def print_checks(checks: dict) -> None:
    print("decoding another rank's payload on 10M entries, checked against unchecked (medians):")
    for name, r in checks.items():
        print(
            f"  {name:30s} checked {r['checked_s'] * 1e3:7.2f} ms  unchecked {r['unchecked_s'] * 1e3:7.2f} ms"
            f"  cost {r['cost_pct']:+.1f}%"
        )


JIT_PROBE = textwrap.dedent(
    """
    import time, numpy as np
    from nbdist.compression import kernels as K  # imports (torch comes with the package) are not JIT cost
    x = np.random.default_rng(0).standard_normal(100_000).astype(np.float32)
    tic = time.perf_counter()
    q, p, out = np.empty(x.size, np.int8), np.empty(x.size // 8, np.uint8), np.empty(x.size, np.float32)
    K.topk(x, 1000, 0); n = K.qsgd_quantize(x, 127, 0, q, np.empty(K.qsgd_chunks(x.size), np.float32)); K.qsgd_dequantize(q, n, 127, out)
    s = K.sign_pack(x, p); K.sign_unpack(p, s, out); K.randomk_indices(x.size, 1000, 0); K.scatter(x[:10], np.arange(10, dtype=np.int32), out)
    first = time.perf_counter() - tic
    tic = time.perf_counter()
    q, p, out = np.empty(x.size, np.int8), np.empty(x.size // 8, np.uint8), np.empty(x.size, np.float32)
    K.topk(x, 1000, 0); n = K.qsgd_quantize(x, 127, 0, q, np.empty(K.qsgd_chunks(x.size), np.float32)); K.qsgd_dequantize(q, n, 127, out)
    s = K.sign_pack(x, p); K.sign_unpack(p, s, out); K.randomk_indices(x.size, 1000, 0); K.scatter(x[:10], np.arange(10, dtype=np.int32), out)
    print(first - (time.perf_counter() - tic))
    """
)


def jit_bench() -> dict:
    runs = []
    for _ in range(3):  # the first may compile; the later ones load the cache
        out = subprocess.run([sys.executable, "-c", JIT_PROBE], capture_output=True, text=True, check=True)
        runs.append(float(out.stdout.strip().splitlines()[-1]))
    return {"first_process_s": runs[0], "warm_cache_overhead_s": stats(runs[1:]), "engines": jit_in_engines()}


def jit_in_engines(think_s: float = 6.0) -> dict:
    """The same probe as the first code on the ranks of a fresh cluster: engines started
    cold, and engines served from warm processes (which load numba while idle)."""
    import nbdist
    from nbdist.config import default_threads
    from nbdist.launch import pool

    probe = JIT_PROBE.replace("print(", "overhead = (")
    out = {}
    for mode in ("cold", "warm"):
        pool.shutdown()
        if mode == "warm":
            pool.warm(2, default_threads(2))
            time.sleep(think_s)  # the user reading and typing after %load_ext
        with nbdist.start(n=2) as cluster:
            cluster.run(probe, quiet=True).raise_for_error()
            out[mode] = max(cluster.pull("overhead"))
    return out


DDP = textwrap.dedent(
    """
    import statistics, time
    from functools import partial
    from nbdist.compression.base import Compressor
    from nbdist.parallel import apply_ddp
    import sys; sys.path.insert(0, BENCH_DIR)
    from _ddp_loop import make_model, _no_comm_hook
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(64, 512, generator=g), torch.randint(0, 10, (64,), generator=g)
    world = dist.get_world_size()

    def wires_of(spec, model):  # {bucket index: a payload of the size and dtype the spec's hook sent}; gathered?
        state = model.compression_state
        last = state.records[-1]["step"]
        sent = {r["bucket"]: r["bytes_after"] for r in state.records if r["step"] == last}
        dtype, size = (torch.float16, 2) if spec == "fp16" else (torch.float32, 4)
        return {i: torch.zeros(n // size, dtype=dtype) for i, n in sent.items()}, state.compressor.collective == "all_gather"

    def collective_only_hook(spec_wires, bucket):  # the spec's collectives alone: nothing (de)compressed
        wires, gather = spec_wires
        # (DDP's first step has one bucket of every gradient: any payload does for an untimed step)
        wire = wires.get(bucket.index(), wires[0]).zero_()  # written each step, as a payload would be
        if gather:
            fut = dist.all_gather([torch.empty_like(wire) for _ in range(world)], wire, async_op=True).get_future()
        else:
            fut = dist.all_reduce(wire, async_op=True).get_future()
        return fut.then(lambda f: bucket.buffer())

    def sync_hook(state, bucket):  # lock-step alone: a 4-byte all-reduce
        return dist.all_reduce(torch.zeros(1), async_op=True).get_future().then(lambda f: bucket.buffer())

    def train(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for i in range(STEPS + 10):
            if i == 10:
                dist.barrier(); tic = time.perf_counter()
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        dist.barrier()
        return (time.perf_counter() - tic) / STEPS

    results = {}
    wires = {}
    for spec in ORDER:
        base_spec, _, variant = spec.partition("@")
        # The references are apply_ddp models too, so their buckets are the compressed runs' buckets.
        if spec in ("floor", "sync"):  # the same step with no communication / with lock-step only
            model = apply_ddp(make_model(), comm_hook=_no_comm_hook if spec == "floor" else sync_hook, metrics=False)
        elif variant == "collective":  # the same step, the spec's collective alone in its hook
            model = apply_ddp(make_model(), comm_hook=collective_only_hook, hook_state=wires[base_spec], metrics=False)
        else:  # "plain": apply_ddp(model) as users get it (torch's all-reduce, live metrics on)
            model = apply_ddp(make_model(), compression=None if spec == "plain" else base_spec)
        if variant == "torch-ops":  # the alternative to the one Numba pass: the torch ops it replaced
            model.compression_state.compressor.compress_feedback = partial(
                Compressor.compress_feedback, model.compression_state.compressor
            )
        results[spec] = {"step_s": train(model)}
        if spec in ("floor", "sync", "plain") or variant == "collective":  # plain sends what "none" sends
            continue
        totals = model.compression_state.step_totals()[-STEPS:]  # the hook's own times, per step
        for key in ("compress_s", "collective_s", "decompress_s"):
            results[spec][key] = statistics.median(t.get(key, 0.0) for t in totals)
        if variant:
            continue
        wires[spec] = spec_wires, gather = wires_of(spec, model)
        # The step's collectives (one per bucket) on payloads of the same sizes, alone and back to
        # back: what communication costs even if compressing were free and both ranks arrived together.
        outs = {i: [torch.empty_like(w) for _ in range(world)] for i, w in spec_wires.items()}
        dist.barrier(); tic = time.perf_counter()
        for _ in range(20):
            for i, w in spec_wires.items():
                dist.all_gather(outs[i], w) if gather else dist.all_reduce(w)
        results[spec]["bare_collective_s"] = (time.perf_counter() - tic) / 20
    """
)

# The task and settings of notebooks/05_gradient_compression.ipynb (150 steps, SGD lr 0.1,
# momentum 0.9, batch 64 per rank, a teacher network's labels).
CONVERGE = textwrap.dedent(
    """
    from nbdist.parallel import apply_ddp
    def make_model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                   torch.nn.ReLU(), torch.nn.Linear(512, 10))
    g = torch.Generator().manual_seed(0)
    W = torch.randn(256, 10, generator=g)
    X = torch.randn(4096, 256, generator=g)
    Y = (X @ W).argmax(1)
    mine = slice(dist.get_rank(), None, dist.get_world_size())
    Xr, Yr = X[mine], Y[mine]
    final = {}
    for spec in CONVERGE_SPECS:
        model = apply_ddp(make_model(), compression=spec, metrics=False)
        # dgc applies the momentum in the hook (momentum correction): its optimizer has none
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.0 if spec.startswith("dgc") else 0.9)
        losses = []
        for step in range(150):
            i = (step * 64) % (Xr.shape[0] - 64)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(Xr[i:i + 64]), Yr[i:i + 64])
            loss.backward()
            opt.step()
            with torch.no_grad():  # the loss on all data, the same on every rank
                losses.append(torch.nn.functional.cross_entropy(model.module(X), Y).item())
        final[spec] = sum(losses[-10:]) / 10  # momentum makes single points jumpy: the last 10 steps
    """
)

SPECS = ("floor", "sync", "plain", "none", "topk:0.01", "dgc:0.01", "qsgd:127", "fp16")
COMPRESSED = ("none", "topk:0.01", "dgc:0.01", "qsgd:127", "fp16")  # each also runs as "<spec>@collective"
ONE_PASS = ("topk:0.01", "dgc:0.01")  # each also runs as "<spec>@torch-ops"
CONVERGE_SPECS = ("none", "topk:0.01", "dgc:0.01", "qsgd:127", "fp16")


def _variants(spec: str) -> tuple[str, ...]:
    return ((f"{spec}@collective",) if spec in COMPRESSED else ()) + (
        (f"{spec}@torch-ops",) if spec in ONE_PASS else ()
    )


def _rotations(rounds: int) -> list[tuple[str, ...]]:
    """The run order of each round: rotated, so drift does not favour one mode; each
    spec's collective-only step right after it (it needs the spec's payload size)."""
    orders = []
    for r in range(rounds):
        rotated = SPECS[r % len(SPECS) :] + SPECS[: r % len(SPECS)]
        orders.append(tuple(x for s in rotated for x in (s, *_variants(s))))
    return orders


def ddp_bench(rounds: int) -> dict:
    import pathlib

    import nbdist

    runs: list[dict] = []
    with nbdist.start(n=2) as cluster:
        cluster.push({"STEPS": 60, "BENCH_DIR": str(pathlib.Path(__file__).parent)})
        for order in _rotations(rounds):
            cluster.push({"ORDER": order})
            cluster.run(DDP, quiet=True).raise_for_error()
            runs.append(cluster.pull("results", ranks=0)[0])
        cluster.push({"CONVERGE_SPECS": CONVERGE_SPECS})
        cluster.run(CONVERGE, quiet=True).raise_for_error()
        final = cluster.pull("final", ranks=0)[0]
    names = list(runs[0])
    out: dict = {s: {k: stats([r[s][k] for r in runs]) for k in runs[0][s]} for s in names}
    floor = out["floor"]["step_s"]["median"]
    out["sync"]["lock_step_s"] = out["sync"]["step_s"]["median"] - floor
    for s in ("plain", *COMPRESSED):
        r = out[s]
        step = r["step_s"]["median"]
        # the bound: no communication at all, plus the bare collective back to back
        bare = out["none" if s == "plain" else s]["bare_collective_s"]["median"]  # plain: the same buckets
        r["bound_s"] = floor + bare
        r["vs_bound"] = step / r["bound_s"]
        if s in COMPRESSED:  # the same step with the collective alone: compression that cost nothing
            r["collective_step_s"] = out[f"{s}@collective"]["step_s"]["median"]
            r["vs_collective_step"] = step / r["collective_step_s"]
            r["in_step_collective_s"] = r["collective_step_s"] - floor
        if s in ONE_PASS:
            r["torch_ops_step_s"] = out[f"{s}@torch-ops"]["step_s"]["median"]
    for base in ("plain", "none"):
        b = out[base]["step_s"]["median"]
        for s in SPECS:
            out[s][f"vs_{base}"] = out[s]["step_s"]["median"] / b
    out["final_loss"] = {
        s: {"loss": final[s], "vs_none_pct": 100 * (final[s] - final["none"]) / final["none"]} for s in CONVERGE_SPECS
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--ddp-only", action="store_true", help="only the DDP steps (no kernels, JIT or saved JSON)")
    parser.add_argument("--checks-only", action="store_true", help="only the decoding checks' cost (saved JSON)")
    args = parser.parse_args()
    if args.checks_only:
        checks = checks_bench()
        print_checks(checks)
        save("compression_checks", checks)
        return
    if args.ddp_only:
        print_ddp(ddp_bench(args.rounds))
        return
    kern = kernels_bench()
    print("kernels on 10M float32, one thread (GB/s of input; x of a numpy copy):")
    for name in (
        "numpy_copy",
        "topk_1pct",
        "topk_1pct_fresh_arrays",
        "sign_pack",
        "sign_unpack",
        "int8_dequantize",
        "qsgd_quantize",
        "torch_topk_1pct",
    ):
        r = kern[name]
        print(f"  {name:18s} {r['s'] * 1e3:8.1f} ms  {r['GB_per_s']:6.2f} GB/s  {r['vs_copy']:.2f}x copy")
    print(f"  top-k vs torch.topk: {kern['topk_speedup_vs_torch']:.1f}x faster")
    checks = checks_bench()
    print_checks(checks)
    jit = jit_bench()
    print(
        f"JIT: first process {jit['first_process_s']:.2f} s; warm cache overhead median {jit['warm_cache_overhead_s']['median']:.3f} s"
        f" (numba's own first-call set-up is most of it); on the ranks: cold engines {jit['engines']['cold']:.3f} s,"
        f" warm engines {jit['engines']['warm']:.3f} s"
    )
    ddp = ddp_bench(args.rounds)
    print_ddp(ddp)
    save("compression", {"kernels": kern, "checks": checks, "jit": jit, "ddp": ddp})


def print_ddp(ddp: dict) -> None:
    ms = 1e3
    floor = ddp["floor"]["step_s"]["median"]
    print("2-rank gloo DDP, MLP 512-1024-1024-10 (one 6.3 MB bucket), batch 64 per rank, medians:")
    print(f"  floor (no communication)        {floor * ms:6.2f} ms")
    print(
        f"  lock-step (a 4-byte all-reduce) {ddp['sync']['step_s']['median'] * ms:6.2f} ms"
        f"  (+{ddp['sync']['lock_step_s'] * ms:.2f} ms: ranks waiting for each other, which no back-to-back"
        " collective shows)"
    )
    for spec in ("plain", *COMPRESSED):
        r = ddp[spec]
        line = (
            f"  {spec:10s} step {r['step_s']['median'] * ms:6.2f} ms ({r['vs_plain']:.2f}x plain);"
            f" bound floor + bare collective {r['bound_s'] * ms:5.2f} ms -> {r['vs_bound']:.2f}x"
        )
        if "collective_step_s" in r:
            line += f"; the same step with only its collective {r['collective_step_s'] * ms:5.2f} ms -> {r['vs_collective_step']:.2f}x"
        print(line)
        if "compress_s" in r:
            print(
                f"  {'':10s} in the hook: compress {r['compress_s']['median'] * ms:.2f} ms, collective"
                f" {r['collective_s']['median'] * ms:.2f} ms (bare {r['bare_collective_s']['median'] * ms:.2f}),"
                f" decompress {r['decompress_s']['median'] * ms:.2f} ms"
            )
        if "torch_ops_step_s" in r:
            t = ddp[f"{spec}@torch-ops"]
            print(
                f"  {'':10s} error feedback with the torch ops one Numba pass replaced: step"
                f" {t['step_s']['median'] * ms:.2f} ms, compress {t['compress_s']['median'] * ms:.2f} ms,"
                f" decompress {t['decompress_s']['median'] * ms:.2f} ms"
            )
    print("final loss (all data, mean of the last 10 steps) after notebook 05's 150 steps:")
    for spec, r in ddp["final_loss"].items():
        print(f"  {spec:10s} {r['loss']:.4f}  ({r['vs_none_pct']:+.1f}% vs none)")


if __name__ == "__main__":
    main()
