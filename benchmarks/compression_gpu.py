"""The compression kernels' CUDA path (nbdist/compression/torch_kernels.py) against the GPU's own copy bandwidth.

For a 64M-element float32 gradient: sign packing, QSGD quantisation and top-k (1%) on the GPU,
each timed with CUDA events, as effective bandwidth (bytes of gradient read / time), beside
``clone()`` of the same tensor (read + write: the device's practical memory bandwidth) measured
in the same run. Target: every kernel >= 50% of that bandwidth. The alternative runs beside
each: the same contract written as plain torch ops (sign packing and QSGD with the fused Triton
kernels turned off; top-k as ``torch.topk`` over every entry). Without CUDA it says so and saves
that it was skipped.

On an H200 (2026-11-26, torch 2.11, Triton 3.6; clone 4.0 TB/s): sign_pack 2.08 TB/s (52%, 8.6x
the torch ops), QSGD 1.49 TB/s (37%, 17x; Philox draws bound it: without draws the same kernel
reads 3.2 TB/s), top-k 1% 0.32 TB/s (8%, 2x: a mask pass, a stream compaction, two small top-k
and three host syncs, of which torch's compaction and top-k are the bulk).
"""

from __future__ import annotations

import argparse

from _common import save, stats


def _time(fn, rounds: int) -> list[float]:
    import torch

    fn()  # warm-up: allocations, kernel loading
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--elements", type=int, default=64 * 2**20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device here: the GPU compression benchmark is skipped")
        save("compression_gpu", {"skipped": "no CUDA device"})
        return
    from nbdist.compression import torch_kernels as tk
    from nbdist.compression import triton_kernels

    def torch_ops(fn):
        def run():
            was, triton_kernels.AVAILABLE = triton_kernels.AVAILABLE, False
            try:
                return fn()
            finally:
                triton_kernels.AVAILABLE = was

        return run

    def topk_all(x, k):
        idx = torch.topk(x.abs(), k, sorted=False).indices.sort().values
        return x[idx], idx.to(torch.int32)

    x = torch.randn(args.elements, device="cuda")
    nbytes = x.numel() * x.element_size()
    copy = stats([2 * nbytes / t for t in _time(lambda: x.clone(), args.rounds)])
    k = x.numel() // 100
    kernels = {  # name: (nbdist's kernel, the same written as plain torch ops)
        "sign_pack": (lambda: tk.sign_pack(x), torch_ops(lambda: tk.sign_pack(x))),
        "qsgd_quantize(s=127)": (lambda: tk.qsgd_quantize(x, 127, 0), torch_ops(lambda: tk.qsgd_quantize(x, 127, 0))),
        "topk(1%)": (lambda: tk.topk(x, k), lambda: topk_all(x, k)),
    }
    report = {
        "device": torch.cuda.get_device_name(0),
        "elements": x.numel(),
        "triton": triton_kernels.AVAILABLE,
        "clone_Bps": copy,
        "kernels": {},
    }
    print(f"{report['device']}: clone {copy['median'] / 1e9:.0f} GB/s (read + write)")
    for name, (ours, plain) in kernels.items():
        bw = stats([nbytes / t for t in _time(ours, args.rounds)])
        bw_plain = stats([nbytes / t for t in _time(plain, args.rounds)])
        share = bw["median"] / copy["median"]
        report["kernels"][name] = {
            "Bps": bw,
            "share_of_clone": share,
            "torch_ops_Bps": bw_plain,
            "speedup_over_torch_ops": bw["median"] / bw_plain["median"],
        }
        print(
            f"{name:>22}: {bw['median'] / 1e9:7.0f} GB/s of gradient = {share:.0%} of clone (target >= 50%); "
            f"as torch ops {bw_plain['median'] / 1e9:.0f} GB/s ({bw['median'] / bw_plain['median']:.1f}x)"
        )
    save("compression_gpu", report)


if __name__ == "__main__":
    main()
