"""Numba kernels for gradient compression: numpy arrays in and out, no torch.

Randomness comes from a counter-based generator (splitmix64 of seed and element index),
so a kernel's result depends only on its inputs and seed, whatever the thread count,
and every rank can draw the same numbers without communicating.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_INV53 = 1.0 / 9007199254740992.0  # 2**-53


@njit(cache=True, nogil=True, inline="always")
def _mix(z: np.uint64) -> np.uint64:
    z = z + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


@njit(cache=True, nogil=True, inline="always")
def _uniform(seed: np.uint64, i: np.uint64) -> float:
    """A float in [0, 1) for (seed, i): the same on every rank and thread."""
    return float(_mix(_mix(seed) ^ i) >> np.uint64(11)) * _INV53


@njit(cache=True, nogil=True)
def uniforms(seed: int, n: int) -> np.ndarray:
    out = np.empty(n, np.float64)
    s = np.uint64(seed)
    for i in range(n):
        out[i] = _uniform(s, np.uint64(i))
    return out


# ------------------------------------------------------------------ top-k


@njit(cache=True, nogil=True)
def _count_at_least(x: np.ndarray, t: float) -> int:
    c = 0
    for i in range(x.size):
        if abs(x[i]) >= t:
            c += 1
    return c


@njit(cache=True, nogil=True)
def _gather_at_least(x: np.ndarray, t: float, count: int) -> np.ndarray:
    idx = np.empty(count, np.int32)
    j = 0
    for i in range(x.size):
        if abs(x[i]) >= t:
            idx[j] = i
            j += 1
    return idx


@njit(cache=True, nogil=True)
def topk(x: np.ndarray, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The k entries of x largest in magnitude: (values, int32 indices in increasing order).

    A threshold is estimated from a sample of |x| (set a little low so that at least k
    entries pass), one pass gathers the candidates, and an exact partition among the
    few candidates keeps exactly k. No full sort of x.
    """
    d = x.size
    if k >= d:
        idx = np.arange(d).astype(np.int32)
        return x.copy(), idx
    if k <= 0:
        return np.empty(0, x.dtype), np.empty(0, np.int32)
    m = min(d, 4096)
    sample = np.empty(m, np.float64)
    s = np.uint64(seed)
    for j in range(m):
        sample[j] = abs(x[int(_uniform(s, np.uint64(j)) * d)])
    sample.sort()
    # aim for about 1.5k + a margin of candidates
    frac = min(1.0, (1.5 * k + 3.0 * np.sqrt(k) + 8.0) / d)
    pos = int((1.0 - frac) * (m - 1))
    t = sample[pos] if frac < 1.0 else 0.0
    count = _count_at_least(x, t)
    if count < k:  # the sample was unlucky: take everything
        t = 0.0
        count = d
    cand = _gather_at_least(x, t, count)
    mags = np.empty(count, np.float64)
    for j in range(count):
        mags[j] = abs(x[cand[j]])
    keep = np.argsort(-mags, kind="mergesort")[:k]  # only the candidates are sorted
    idx = np.sort(cand[keep])
    vals = np.empty(k, x.dtype)
    for j in range(k):
        vals[j] = x[idx[j]]
    return vals, idx


@njit(cache=True, nogil=True)
def scatter(values: np.ndarray, indices: np.ndarray, d: int) -> np.ndarray:
    """A dense vector of length d with values at indices (zeros elsewhere); repeats add up."""
    out = np.zeros(d, values.dtype)
    for j in range(indices.size):
        out[indices[j]] += values[j]
    return out


# ------------------------------------------------------------------ random-k


@njit(cache=True, nogil=True)
def randomk_indices(d: int, k: int, seed: int) -> np.ndarray:
    """k distinct indices of range(d), increasing, the same for a given seed on every rank."""
    if k >= d:
        return np.arange(d).astype(np.int32)
    # Floyd's algorithm on the counter-based generator.
    chosen = set()
    s = np.uint64(seed)
    n = 0
    for j in range(d - k, d):
        r = int(_uniform(s, np.uint64(n)) * (j + 1))
        n += 1
        if r in chosen:
            chosen.add(j)
        else:
            chosen.add(r)
    out = np.empty(k, np.int32)
    i = 0
    for v in chosen:
        out[i] = v
        i += 1
    return np.sort(out)


# ------------------------------------------------------------------ sign


@njit(cache=True, nogil=True, parallel=True)
def sign_pack(x: np.ndarray) -> tuple[np.ndarray, float]:
    """1 bit per element (1 = non-negative), packed 8 to a byte, and the scale mean(|x|)."""
    d = x.size
    nbytes = (d + 7) // 8
    out = np.zeros(nbytes, np.uint8)
    for b in prange(nbytes):
        v = 0
        for j in range(8):
            i = b * 8 + j
            if i < d and x[i] >= 0:
                v |= 1 << (7 - j)
        out[b] = v
    total = 0.0
    for i in prange(d):
        total += abs(x[i])
    return out, total / max(d, 1)


@njit(cache=True, nogil=True, parallel=True)
def sign_unpack(packed: np.ndarray, d: int, scale: float) -> np.ndarray:
    """+scale / -scale per element, from sign_pack's bits."""
    out = np.empty(d, np.float32)
    for i in prange(d):
        bit = (packed[i // 8] >> (7 - i % 8)) & 1
        out[i] = scale if bit else -scale
    return out


# ------------------------------------------------------------------ QSGD


@njit(cache=True, nogil=True, parallel=True)
def qsgd_quantize(x: np.ndarray, s: int, seed: int) -> tuple[np.ndarray, float]:
    """Stochastic rounding of |x_i| / ||x|| to s levels: int8 signed levels and the norm.

    E[level_i] * norm / s = x_i exactly (unbiased). s must be at most 127.
    """
    d = x.size
    norm = 0.0
    for i in prange(d):
        norm += float(x[i]) * float(x[i])
    norm = np.sqrt(norm)
    out = np.zeros(d, np.int8)
    if norm == 0.0:
        return out, 0.0
    sd = np.uint64(seed)
    for i in prange(d):
        a = abs(float(x[i])) / norm * s
        lo = np.floor(a)
        level = lo + (1.0 if _uniform(sd, np.uint64(i)) < a - lo else 0.0)
        out[i] = np.int8(level if x[i] >= 0 else -level)
    return out, norm


@njit(cache=True, nogil=True, parallel=True)
def qsgd_dequantize(levels: np.ndarray, norm: float, s: int) -> np.ndarray:
    d = levels.size
    out = np.empty(d, np.float32)
    for i in prange(d):
        out[i] = levels[i] * norm / s
    return out
