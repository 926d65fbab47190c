"""The kernels' shared parts: their Numba flags and a counter-based random generator.

``uniform(seed, i)`` is splitmix64 of seed and index: a kernel's draws depend only on its
seed, whatever the thread count, and every rank can draw the same numbers without
communicating.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_INV53 = 1.0 / 9007199254740992.0  # 2**-53
INV24 = np.float32(1.0 / 16777216.0)  # 2**-24

JIT = njit(cache=True, nogil=True, fastmath=True)  # the kernels' common flags


@njit(cache=True, nogil=True, inline="always")
def mix(z: np.uint64) -> np.uint64:
    z = z + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


@njit(cache=True, nogil=True, inline="always")
def uniform(seed: np.uint64, i: np.uint64) -> float:
    """A float64 in [0, 1) for (seed, i): the same on every rank and thread."""
    return float(mix(mix(seed) ^ i) >> np.uint64(11)) * _INV53


@njit(cache=True, nogil=True)
def uniforms(seed: int, n: int) -> np.ndarray:
    out = np.empty(n, np.float64)
    s = np.uint64(seed)
    for i in range(n):
        out[i] = uniform(s, np.uint64(i))
    return out
