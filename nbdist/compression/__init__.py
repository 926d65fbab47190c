"""Gradient compression for DDP communication hooks.

``kernels`` holds the Numba kernels (numpy in, numpy out, no torch). The DDP hooks that
use them are the next step (issue 4); the kernels are tested against numpy references.
"""
