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


# Lowest set bit -> its position, by de Bruijn multiplication (no branch, no loop).
_DEBRUIJN = np.uint64(0x03F79D71B4CB0A89)
_DEBRUIJN_POS = np.zeros(64, np.int64)
for _i in range(64):
    _DEBRUIJN_POS[((1 << _i) * 0x03F79D71B4CB0A89 & 0xFFFFFFFFFFFFFFFF) >> 58] = _i


@_jit
def _gather_at_least(x: np.ndarray, t: float, idx: np.ndarray, vals: np.ndarray) -> int:
    """Writes the indices and values of the entries with |x| >= t into idx and vals (as
    many as fit); returns how many there are.

    Chunk by chunk: a vectorised compare packs one bit per entry (as sign_pack does)
    into a small mask that stays in cache, then each 64-bit word of it is walked set
    bit by set bit. Few entries pass, so this costs about one read of x.
    """
    cap = idx.size
    j = 0
    tt = np.float32(t)
    chunk = 4096
    bits = np.zeros(chunk // 8, np.uint8)
    words = bits.view(np.uint64)
    d = x.size
    full = d - d % chunk
    for start in range(0, full, chunk):
        xs = x[start : start + chunk]  # a slice view: indexing it lets LLVM vectorise the compare
        for b in range(chunk // 8):
            i = b * 8
            bits[b] = (
                np.uint8(abs(xs[i]) >= tt)
                | (np.uint8(abs(xs[i + 1]) >= tt) << 1)
                | (np.uint8(abs(xs[i + 2]) >= tt) << 2)
                | (np.uint8(abs(xs[i + 3]) >= tt) << 3)
                | (np.uint8(abs(xs[i + 4]) >= tt) << 4)
                | (np.uint8(abs(xs[i + 5]) >= tt) << 5)
                | (np.uint8(abs(xs[i + 6]) >= tt) << 6)
                | (np.uint8(abs(xs[i + 7]) >= tt) << 7)
            )
        for w in range(chunk // 64):
            word = words[w]  # bit p of word w is entry w * 64 + p (little-endian bytes)
            while word != 0:
                low = word & (~word + np.uint64(1))
                p = w * 64 + _DEBRUIJN_POS[(low * _DEBRUIJN) >> np.uint64(58)]
                if j < cap:
                    idx[j] = start + p
                    vals[j] = xs[p]
                j += 1
                word ^= low
    for i in range(full, d):  # the tail
        if abs(x[i]) >= tt:
            if j < cap:
                idx[j] = i
                vals[j] = x[i]
            j += 1
    return j


_SIGN_OFF = np.int32(0x7FFFFFFF)
_TINY = float(np.float32(1e-45))  # the smallest positive float32: |x| >= _TINY means x != 0


@_jit
def _kth_largest_key(vals: np.ndarray, k: int) -> np.int32:
    """The k-th largest |v| of float32 vals, as its bit pattern (non-negative floats order
    like their bit patterns, so the key is the pattern with the sign bit cleared).
    A 4096-bin histogram finds the bin that holds it, then only that bin is partitioned."""
    keys = vals.view(np.int32)
    lo = keys[0] & _SIGN_OFF
    hi = lo
    for v in keys:
        lo = min(lo, v & _SIGN_OFF)
        hi = max(hi, v & _SIGN_OFF)
    shift = 0
    while ((hi - lo) >> shift) >= 4096:
        shift += 1
    hist = np.zeros(4096, np.int64)
    for v in keys:
        hist[((v & _SIGN_OFF) - lo) >> shift] += 1
    above = 0
    b = 4095
    while above + hist[b] < k:
        above += hist[b]
        b -= 1
    members = np.empty(hist[b], np.int32)
    m = 0
    for v in keys:
        key = v & _SIGN_OFF
        if (key - lo) >> shift == b:
            members[m] = key
            m += 1
    r = k - above  # the r-th largest inside bin b
    return np.partition(members, m - r)[m - r]


_BLOCK = 32  # contiguous elements per sampled block


@_jit
def _sample_abs(x: np.ndarray, blocks: int, seed: int) -> np.ndarray:
    """|x| at ``blocks`` blocks of _BLOCK contiguous elements, one at a random offset in
    each of ``blocks`` equal strata (stratified: every layer of a bucket is seen).
    Reading blocks instead of single random elements keeps this a few hundred cache
    misses rather than one per sample (which cost more than the whole pass over x)."""
    d = x.size
    stride = d // blocks
    sample = np.empty(blocks * _BLOCK, np.float32)
    s = np.uint64(seed)
    for b in range(blocks):
        off = b * stride + int(_uniform(s, np.uint64(b)) * (stride - _BLOCK + 1))
        xs = x[off : off + _BLOCK]
        for i in range(_BLOCK):
            sample[b * _BLOCK + i] = abs(xs[i])
    return sample


def _threshold_plan(d: int, k: int) -> tuple[int, float]:
    """(sampled blocks, fraction of x the threshold lets through): the threshold is set
    a little low so that at least k entries pass."""
    blocks = min(512, d // (4 * _BLOCK))
    q = k / d
    if blocks < 16:
        return 0, q
    # Blocks hold neighbours that look alike, so count a block as 8 independent
    # draws when setting the margin (about 4 standard errors of the quantile).
    return blocks, min(1.0, q + 4.0 * np.sqrt(q / (blocks * 8)) + 8.0 / d)


_threshold_plan_jit = njit(cache=True, nogil=True)(_threshold_plan)


def topk_workspace(d: int, k: int) -> int:
    """How many candidates topk_into's workspace should hold for a d-vector's top k."""
    _, frac = _threshold_plan(d, k)
    return min(d, int(frac * d * 1.25) + 64)


@_jit
def topk_into(
    x: np.ndarray,
    k: int,
    seed: int,
    vals: np.ndarray,
    idx: np.ndarray,
    cand_vals: np.ndarray,
    cand_idx: np.ndarray,
) -> None:
    """The k entries of x largest in magnitude, written to vals[:k] and idx[:k] (int32
    indices in increasing order; ties at the k-th magnitude go to the lowest indices).

    A threshold is estimated from a stratified sample of |x|, one pass gathers the
    candidates into the workspace (cand_vals, cand_idx: topk_workspace(d, k) entries),
    and a histogram selection among the candidates keeps exactly k. No sort of x. If the
    estimate was off, the pass is repeated with a lower threshold (too few passed) or
    into a workspace of the exact size (too many), so the result is always exact.

    Every array comes from the caller: fresh megabyte-sized arrays on every call cost
    more in page faults than the selection itself (glibc returns them to the system).
    """
    d = x.size
    if k >= d:
        vals[:d] = x
        for i in range(d):
            idx[i] = i
        return
    if k <= 0:
        return
    blocks, frac = _threshold_plan_jit(d, k)
    sample = _sample_abs(x, blocks, seed) if blocks > 0 else np.abs(x)
    m = sample.size
    count = 0
    while True:  # frac grows 4x a round and reaches 1 (the threshold of nonzero entries)
        t = _TINY
        if frac < 1.0:
            pos = int((1.0 - frac) * (m - 1))
            t = max(np.partition(sample, pos)[pos], _TINY)
        # A threshold of zero would let every entry through (an unused layer's zero
        # gradients): only nonzero entries are gathered, and zeros are added below.
        count = _gather_at_least(x, t, cand_idx, cand_vals)
        if count > cand_idx.size:  # more passed than expected: again, into a workspace that fits
            cand_idx = np.empty(count, np.int32)
            cand_vals = np.empty(count, x.dtype)
            count = _gather_at_least(x, t, cand_idx, cand_vals)
        if count >= k or t == _TINY:
            break
        frac = min(1.0, frac * 4.0)  # too few passed: lower the threshold
    if count < k:  # fewer than k nonzero entries: all of them, then zeros at the lowest indices
        zeros = k - count
        c = 0
        n = 0
        for i in range(d):
            if c < count and cand_idx[c] == i:
                idx[n] = i
                vals[n] = cand_vals[c]
                c += 1
                n += 1
            elif zeros > 0:
                idx[n] = i
                vals[n] = x[i]
                zeros -= 1
                n += 1
            if n == k:
                return
    keys = cand_vals[:count].view(np.int32)
    kth = _kth_largest_key(cand_vals[:count], k)
    greater = 0
    for j in range(count):
        greater += (keys[j] & _SIGN_OFF) > kth
    ties = k - greater  # how many entries equal to the k-th value to keep (lowest indices)
    n = 0
    for j in range(count):  # candidates are in index order, so idx comes out sorted
        if n == k:  # the k-th was taken; slot n is written before it is known to be kept
            break
        key = keys[j] & _SIGN_OFF
        take = key > kth
        if key == kth:  # rare: ties at the k-th value, the lowest indices first
            take = ties > 0
            ties -= take
        idx[n] = cand_idx[j]
        vals[n] = cand_vals[j]
        n += take


def topk(x: np.ndarray, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """topk_into with fresh arrays: (values, int32 indices in increasing order)."""
    k = max(0, min(int(k), x.size))
    vals, idx = np.empty(k, x.dtype), np.empty(k, np.int32)
    w = topk_workspace(x.size, k) if k < x.size else 1
    topk_into(x, k, seed, vals, idx, np.empty(w, x.dtype), np.empty(w, np.int32))
    return vals, idx


@_jit
def scatter(values: np.ndarray, indices: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out`` zeroed, then values placed at indices (repeats add up)."""
    out[:] = 0
    for j in range(indices.size):
        out[indices[j]] += values[j]
    return out


@_jit
def scatter_add(values: np.ndarray, indices: np.ndarray, scale: float, out: np.ndarray) -> None:
    """out[indices] += values * scale (repeats add up): one rank's sparse part of a mean."""
    f = np.float32(scale)
    for j in range(indices.size):
        out[indices[j]] += values[j] * f


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


QSGD_CHUNK = 512  # elements per norm: the QSGD paper's "bucket size"


@_jit
def qsgd_quantize(x: np.ndarray, s: int, seed: int, out: np.ndarray, norms: np.ndarray) -> np.ndarray:
    """Stochastic rounding of |x_i| / ||chunk|| to s levels into ``out`` (int8), chunk by
    chunk of QSGD_CHUNK entries, each chunk's L2 norm into ``norms`` (float32,
    ceil(d / QSGD_CHUNK)); returns norms.

    E[level_i] * norm / s = x_i (unbiased up to the 2**-24 resolution of the uniform
    draw). A norm per chunk keeps the variance at most chunk / s**2 of the chunk's
    squared norm; one norm for a whole bucket of d entries would allow d / s**2, which
    for a 400k-entry bucket is noise 2.5x the gradient. s must be at most 127.
    """
    base = _mix(np.uint64(seed))
    for c in range(norms.size):
        start = c * QSGD_CHUNK
        xs = x[start : start + QSGD_CHUNK]
        qs = out[start : start + QSGD_CHUNK]
        total = 0.0
        for i in range(xs.size):
            total += np.float64(xs[i]) * np.float64(xs[i])
        norm = np.float32(np.sqrt(total))  # the receiver scales by this float32 value
        norms[c] = norm
        if norm == 0.0:
            qs[:] = 0
            continue
        inv = np.float32(s) / norm
        for i in range(xs.size):
            a = abs(xs[i]) * inv
            lo = np.floor(a)
            u = np.float32(_mix(base ^ np.uint64(start + i)) >> np.uint64(40)) * _INV24
            level = np.int8(min(lo + np.float32(u < a - lo), np.float32(s)))  # rounding never passes s
            qs[i] = level if xs[i] >= 0 else -level
    return norms


@_jit
def qsgd_dequantize(levels: np.ndarray, norms: np.ndarray, s: int, out: np.ndarray) -> np.ndarray:
    for c in range(norms.size):
        f = np.float32(norms[c] / s)
        start = c * QSGD_CHUNK
        ls = levels[start : start + QSGD_CHUNK]
        os_ = out[start : start + QSGD_CHUNK]
        for i in range(ls.size):
            os_[i] = np.float32(ls[i]) * f
    return out


@_jit
def qsgd_dequantize_add(levels: np.ndarray, norms: np.ndarray, s: int, weight: float, out: np.ndarray) -> np.ndarray:
    """out += weight * dequantized levels: one rank's share of a mean, in one pass."""
    for c in range(norms.size):
        f = np.float32(weight * norms[c] / s)
        start = c * QSGD_CHUNK
        ls = levels[start : start + QSGD_CHUNK]
        os_ = out[start : start + QSGD_CHUNK]
        for i in range(ls.size):
            os_[i] += np.float32(ls[i]) * f
    return out


def qsgd_chunks(d: int) -> int:
    """How many norms qsgd_quantize writes for d entries."""
    return -(-d // QSGD_CHUNK)


@_jit
def sign_unpack_add(packed: np.ndarray, scale: float, weight: float, out: np.ndarray) -> np.ndarray:
    """out += weight * (+scale / -scale per element): one rank's share of a mean, in one pass."""
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
