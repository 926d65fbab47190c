"""Numba kernels for gradient compression: numpy arrays in and out, no torch.

Randomness comes from a counter-based generator (splitmix64 of seed and element index),
so a kernel's result depends only on its inputs and seed, whatever the thread count,
and every rank can draw the same numbers without communicating.

Speed notes (profiled on one core against a numpy copy of the same array):
the loops are branch-free so LLVM vectorises them (``fastmath`` allows vectorised
reductions), and every kernel that writes a full-size array takes an ``out`` buffer:
a fresh 40 MB array costs more in page faults than the whole computation, so the
hooks keep one buffer per bucket. ``parallel=True`` is not used: each rank runs one
thread per core already, and the parallel runtime adds start-up time to every process.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_INV53 = 1.0 / 9007199254740992.0  # 2**-53
_INV24 = np.float32(1.0 / 16777216.0)  # 2**-24

_jit = njit(cache=True, nogil=True, fastmath=True)  # the kernels' common flags


@njit(cache=True, nogil=True, inline="always")
def _mix(z: np.uint64) -> np.uint64:
    z = z + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


@njit(cache=True, nogil=True, inline="always")
def _uniform(seed: np.uint64, i: np.uint64) -> float:
    """A float64 in [0, 1) for (seed, i): the same on every rank and thread."""
    return float(_mix(_mix(seed) ^ i) >> np.uint64(11)) * _INV53


@njit(cache=True, nogil=True)
def uniforms(seed: int, n: int) -> np.ndarray:
    out = np.empty(n, np.float64)
    s = np.uint64(seed)
    for i in range(n):
        out[i] = _uniform(s, np.uint64(i))
    return out


# ------------------------------------------------------------------ top-k


@_jit
def _gather_at_least(x: np.ndarray, t: float, cap: int) -> tuple[np.ndarray, int]:
    """Indices with |x| >= t (at most cap kept); returns (buffer, min(count, cap)).

    Chunk by chunk: a vectorised compare writes a small byte mask that stays in cache,
    then the mask is read 8 bytes at a time, skipping the (mostly) empty words.
    """
    idx = np.empty(cap + 1, np.int32)
    j = 0
    tt = np.float32(t)
    chunk = 4096
    mask = np.zeros(chunk, np.uint8)
    words = mask.view(np.uint64)
    d = x.size
    for start in range(0, d, chunk):
        xs = x[start : start + chunk]  # a slice view: indexing it lets LLVM vectorise the compare
        n = xs.size
        for i in range(n):
            mask[i] = np.uint8(abs(xs[i]) >= tt)
        for i in range(n, chunk):
            mask[i] = 0
        for w in range(chunk // 8):
            if words[w] != 0:
                base = w * 8
                for b in range(8):
                    if mask[base + b]:
                        if j < cap:
                            idx[j] = start + base + b
                        j += 1
    return idx, min(j, cap)


@_jit
def topk(x: np.ndarray, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The k entries of x largest in magnitude: (values, int32 indices in increasing order).

    A threshold is estimated from a random sample of |x| (set a little low so that at
    least k entries pass), one pass gathers the candidates, and a partition among the
    candidates keeps exactly k. No sort of x.
    """
    d = x.size
    if k >= d:
        return x.copy(), np.arange(d).astype(np.int32)
    if k <= 0:
        return np.empty(0, x.dtype), np.empty(0, np.int32)
    m = min(d, 65536)
    sample = np.empty(m, np.float32)
    s = np.uint64(seed)
    for j in range(m):
        sample[j] = abs(x[int(_uniform(s, np.uint64(j)) * d)])
    # Expected passing fraction k/d; the sample quantile's error is about
    # sqrt(q / m), so aim 4 of those above, plus a small floor.
    q = k / d
    frac = min(1.0, q + 4.0 * np.sqrt(q / m) + 8.0 / d)
    t = 0.0
    if frac < 1.0:
        pos = int((1.0 - frac) * (m - 1))
        t = np.partition(sample, pos)[pos]
    cap = min(d, int(frac * d * 1.5) + 64)
    cand, count = _gather_at_least(x, t, cap)
    if count < k or count >= cap:  # an unlucky sample: fall back to every entry
        cand, count = np.arange(d).astype(np.int32), d
    mags = np.empty(count, np.float32)
    for j in range(count):
        mags[j] = abs(x[cand[j]])
    kth = np.partition(mags, count - k)[count - k]  # the k-th largest magnitude
    greater = 0
    for j in range(count):
        greater += mags[j] > kth
    ties = k - greater  # how many entries equal to the k-th value to keep (lowest indices)
    idx = np.empty(k, np.int32)
    n = 0
    for j in range(count):  # candidates are in index order, so idx comes out sorted
        if mags[j] > kth or (mags[j] == kth and ties > 0):
            if mags[j] == kth:
                ties -= 1
            idx[n] = cand[j]
            n += 1
    vals = np.empty(k, x.dtype)
    for j in range(k):
        vals[j] = x[idx[j]]
    return vals, idx


@_jit
def scatter(values: np.ndarray, indices: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out`` zeroed, then values placed at indices (repeats add up)."""
    out[:] = 0
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


@_jit
def sign_pack(x: np.ndarray, out: np.ndarray) -> float:
    """Writes 1 bit per element (1 = non-negative, most significant bit first, as
    np.packbits) into ``out`` (uint8, (d + 7) // 8); returns the scale mean(|x|)."""
    d = x.size
    full = d // 8
    for b in range(full):
        i = b * 8
        out[b] = (
            (np.uint8(x[i] >= 0) << 7)
            | (np.uint8(x[i + 1] >= 0) << 6)
            | (np.uint8(x[i + 2] >= 0) << 5)
            | (np.uint8(x[i + 3] >= 0) << 4)
            | (np.uint8(x[i + 4] >= 0) << 3)
            | (np.uint8(x[i + 5] >= 0) << 2)
            | (np.uint8(x[i + 6] >= 0) << 1)
            | np.uint8(x[i + 7] >= 0)
        )
    if full * 8 < d:
        v = 0
        for j in range(d - full * 8):
            if x[full * 8 + j] >= 0:
                v |= 1 << (7 - j)
        out[full] = v
    total = 0.0
    for i in range(d):
        total += abs(x[i])
    return total / max(d, 1)


@_jit
def sign_unpack(packed: np.ndarray, scale: float, out: np.ndarray) -> np.ndarray:
    """+scale / -scale per element of ``out`` from sign_pack's bits."""
    s = np.float32(scale)
    s2 = np.float32(2.0 * scale)
    full = out.size // 8
    for b in range(full):
        v = packed[b]
        i = b * 8
        for j in range(8):
            out[i + j] = np.float32((v >> (7 - j)) & 1) * s2 - s
    for i in range(full * 8, out.size):
        out[i] = np.float32((packed[i >> 3] >> (7 - (i & 7))) & 1) * s2 - s
    return out


# ------------------------------------------------------------------ QSGD


@_jit
def qsgd_quantize(x: np.ndarray, s: int, seed: int, out: np.ndarray) -> float:
    """Stochastic rounding of |x_i| / ||x|| to s levels into ``out`` (int8); returns the norm.

    E[level_i] * norm / s = x_i (unbiased up to the 2**-24 resolution of the uniform
    draw). s must be at most 127.
    """
    d = x.size
    total = 0.0
    for i in range(d):
        total += np.float64(x[i]) * np.float64(x[i])
    norm = np.sqrt(total)
    if norm == 0.0:
        out[:] = 0
        return 0.0
    inv = np.float32(s / norm)
    base = _mix(np.uint64(seed))
    for i in range(d):
        a = abs(x[i]) * inv
        lo = np.floor(a)
        u = np.float32(_mix(base ^ np.uint64(i)) >> np.uint64(40)) * _INV24
        level = np.int8(lo + np.float32(u < a - lo))
        out[i] = level if x[i] >= 0 else -level
    return norm


@_jit
def qsgd_dequantize(levels: np.ndarray, norm: float, s: int, out: np.ndarray) -> np.ndarray:
    f = np.float32(norm / s)
    for i in range(levels.size):
        out[i] = np.float32(levels[i]) * f
    return out
