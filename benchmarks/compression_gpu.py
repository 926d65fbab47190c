"""The compression kernels' CUDA path (nbdist/compression/torch_kernels.py) against the GPU's own copy bandwidth.

For a 64M-element float32 gradient: sign packing, QSGD quantisation and top-k (1%) on the GPU,
each timed with CUDA events, as effective bandwidth (bytes of gradient read / time), beside
``clone()`` of the same tensor (read + write: the device's practical memory bandwidth) measured
in the same run. Target: every kernel >= 50% of that bandwidth. Without CUDA it says so and
saves that it was skipped.
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

    x = torch.randn(args.elements, device="cuda")
    nbytes = x.numel() * x.element_size()
    copy = stats([2 * nbytes / t for t in _time(lambda: x.clone(), args.rounds)])
    kernels = {
        "sign_pack": lambda: tk.sign_pack(x),
        "qsgd_quantize(s=127)": lambda: tk.qsgd_quantize(x, 127, 0),
        "topk(1%)": lambda: tk.topk(x, x.numel() // 100),
    }
    report = {"device": torch.cuda.get_device_name(0), "elements": x.numel(), "clone_Bps": copy, "kernels": {}}
    print(f"{report['device']}: clone {copy['median'] / 1e9:.0f} GB/s (read + write)")
    for name, fn in kernels.items():
        bw = stats([nbytes / t for t in _time(fn, args.rounds)])
        share = bw["median"] / copy["median"]
        report["kernels"][name] = {"Bps": bw, "share_of_clone": share}
        print(f"{name:>22}: {bw['median'] / 1e9:7.0f} GB/s of gradient = {share:.0%} of clone (target >= 50%)")
    save("compression_gpu", report)


if __name__ == "__main__":
    main()
