"""Gradient compression for DDP communication hooks.

``kernels`` holds the Numba kernels (numpy in, numpy out, no torch); ``hooks`` the DDP
communication hooks built so far (identity, fp16, bf16, top-k with error feedback).
Random-k, QSGD, EF-sign and PowerSGD hooks, the "did you mean" compressor names on
apply_ddp and the benchmarks are still to come (issue 4).
"""
