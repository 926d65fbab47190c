"""Top-k selection (Numba): the k largest |x| of a gradient bucket, exactly, in about one pass.

A threshold is estimated from a stratified sample of blocks, set a little low; entries
at or above it are gathered through a bit-packed candidate mask, and the k-th largest
among them is found by histogram; if fewer than k passed, it retries exactly.
``topk_feedback_into`` does error feedback's update (and DGC's velocity) in the same pass.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .rng import JIT, uniform

# Lowest set bit -> its position, by de Bruijn multiplication (no branch, no loop).
_DEBRUIJN = np.uint64(0x03F79D71B4CB0A89)
_DEBRUIJN_POS = np.zeros(64, np.int64)
for _i in range(64):
    _DEBRUIJN_POS[((1 << _i) * 0x03F79D71B4CB0A89 & 0xFFFFFFFFFFFFFFFF) >> 58] = _i


@njit(cache=True, nogil=True, fastmath=True, inline="always")
def _gather_chunk(
    xs: np.ndarray, start: int, tt: np.float32, bits: np.ndarray, idx: np.ndarray, vals: np.ndarray, j: int
) -> int:
    """Appends the entries of one chunk (len(bits) * 8 entries of x, from ``start``) with
    |x| >= tt to idx and vals (as many as fit) and returns the new count.

    A vectorised compare packs one bit per entry (as sign_pack does) into a small mask
    that stays in cache, then each 64-bit word of it is walked set bit by set bit."""
    cap = idx.size
    for b in range(bits.size):
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
    words = bits.view(np.uint64)
    for w in range(words.size):
        word = words[w]  # bit p of word w is entry w * 64 + p (little-endian bytes)
        while word != 0:
            low = word & (~word + np.uint64(1))
            p = w * 64 + _DEBRUIJN_POS[(low * _DEBRUIJN) >> np.uint64(58)]
            if j < cap:
                idx[j] = start + p
                vals[j] = xs[p]
            j += 1
            word ^= low
    return j


@njit(cache=True, nogil=True, fastmath=True, inline="always")
def _gather_tail(x: np.ndarray, start: int, tt: np.float32, idx: np.ndarray, vals: np.ndarray, j: int) -> int:
    """_gather_chunk for the entries from ``start`` to the end, one by one."""
    cap = idx.size
    for i in range(start, x.size):
        if abs(x[i]) >= tt:
            if j < cap:
                idx[j] = i
                vals[j] = x[i]
            j += 1
    return j


_CHUNK = 4096  # entries per packed mask (512 bytes: it stays in L1)


@JIT
def _gather_at_least(x: np.ndarray, t: float, idx: np.ndarray, vals: np.ndarray) -> int:
    """Writes the indices and values of the entries with |x| >= t into idx and vals (as
    many as fit); returns how many there are. Few entries pass, so this costs about one
    read of x."""
    j = 0
    tt = np.float32(t)
    bits = np.zeros(_CHUNK // 8, np.uint8)
    full = x.size - x.size % _CHUNK
    for start in range(0, full, _CHUNK):
        # a slice view: indexing it lets LLVM vectorise the compare
        j = _gather_chunk(x[start : start + _CHUNK], start, tt, bits, idx, vals, j)
    return _gather_tail(x, full, tt, idx, vals, j)


# Error feedback, fused. These round exactly as the hook's torch ops would (x += g;
# DGC: v.mul_(m).add_(g), x += v): no fastmath, so LLVM may not contract a * b + c into
# one fused multiply-add, whose single rounding would differ.


@njit(cache=True, nogil=True, inline="always")
def _accumulate(xs: np.ndarray, gs: np.ndarray, vs: np.ndarray, m: np.float32) -> None:
    """xs += gs (with a velocity vs of the same size: vs = m * vs + gs, then xs += vs); gs = 0."""
    if vs.size:
        for i in range(xs.size):
            v = vs[i] * m + gs[i]
            vs[i] = v
            xs[i] += v
            gs[i] = 0.0
    else:
        for i in range(xs.size):
            xs[i] += gs[i]
            gs[i] = 0.0


@njit(cache=True, nogil=True)
def _accumulate_gather_at_least(
    x: np.ndarray, g: np.ndarray, v: np.ndarray, m: np.float32, t: float, idx: np.ndarray, vals: np.ndarray
) -> int:
    """_accumulate and _gather_at_least in one pass over memory: each chunk is updated,
    then gathered while it is still in cache."""
    j = 0
    tt = np.float32(t)
    bits = np.zeros(_CHUNK // 8, np.uint8)
    d = x.size
    full = d - d % _CHUNK
    has_v = v.size > 0
    for start in range(0, full, _CHUNK):
        xs = x[start : start + _CHUNK]
        _accumulate(xs, g[start : start + _CHUNK], v[start : start + _CHUNK] if has_v else v, m)
        j = _gather_chunk(xs, start, tt, bits, idx, vals, j)
    _accumulate(x[full:], g[full:], v[full:] if has_v else v, m)
    return _gather_tail(x, full, tt, idx, vals, j)


_SIGN_OFF = np.int32(0x7FFFFFFF)
_TINY = float(np.float32(1e-45))  # the smallest positive float32: |x| >= _TINY means x != 0


@JIT
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


@JIT
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
        off = b * stride + int(uniform(s, np.uint64(b)) * (stride - _BLOCK + 1))
        xs = x[off : off + _BLOCK]
        for i in range(_BLOCK):
            sample[b * _BLOCK + i] = abs(xs[i])
    return sample


@njit(cache=True, nogil=True)  # no fastmath: the same roundings as _accumulate
def _sample_abs_accumulated(
    x: np.ndarray, g: np.ndarray, v: np.ndarray, m: np.float32, blocks: int, seed: int
) -> np.ndarray:
    """_sample_abs of the x that _accumulate(x, g, v, m) would leave, at the same blocks,
    without writing anything: the threshold is known before the one fused pass."""
    d = x.size
    stride = d // blocks
    sample = np.empty(blocks * _BLOCK, np.float32)
    s = np.uint64(seed)
    for b in range(blocks):
        off = b * stride + int(uniform(s, np.uint64(b)) * (stride - _BLOCK + 1))
        for i in range(off, off + _BLOCK):
            step = v[i] * m + g[i] if v.size else g[i]
            sample[b * _BLOCK + i - off] = abs(x[i] + step)
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


@JIT
def _keep_k(cand_vals: np.ndarray, cand_idx: np.ndarray, count: int, k: int, vals: np.ndarray, idx: np.ndarray) -> None:
    """The k candidates (of ``count`` >= k, in index order) largest in magnitude, into vals
    and idx in index order; ties at the k-th magnitude go to the lowest indices."""
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


@JIT
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
    _keep_k(cand_vals, cand_idx, count, k, vals, idx)


@njit(cache=True, nogil=True)
def topk_feedback_into(
    x: np.ndarray,
    g: np.ndarray,
    v: np.ndarray,
    momentum: float,
    k: int,
    seed: int,
    vals: np.ndarray,
    idx: np.ndarray,
    cand_vals: np.ndarray,
    cand_idx: np.ndarray,
) -> None:
    """A top-k step with error feedback, in one pass over memory where the hook's torch
    ops took five: x += g (DGC, with a velocity v: v = momentum * v + g, then x += v),
    g = 0, the top k of x into vals and idx exactly as topk_into would write them, and
    the sent entries cleared from x (and v) -- what is left waits for the next step.

    g (the gradient bucket) is left zeroed, so the mean of the ranks' parts can be added
    straight into it. An empty v means no momentum. The threshold is estimated from a
    sample of the updated values before the pass; if it let too few or too many through,
    topk_into finishes on the updated x, so the result is always exact.
    """
    d = x.size
    m = np.float32(momentum)
    blocks, frac = _threshold_plan_jit(d, k)
    if blocks == 0 or k <= 0 or k >= d or frac >= 1.0:  # small or degenerate: update, then select
        _accumulate(x, g, v, m)
        topk_into(x, k, seed, vals, idx, cand_vals, cand_idx)
    else:
        sample = _sample_abs_accumulated(x, g, v, m, blocks, seed)
        pos = int((1.0 - frac) * (sample.size - 1))
        t = max(np.partition(sample, pos)[pos], _TINY)
        count = _accumulate_gather_at_least(x, g, v, m, t, cand_idx, cand_vals)
        if k <= count <= cand_idx.size:
            _keep_k(cand_vals, cand_idx, count, k, vals, idx)
        else:  # rare: x is updated; select as topk_into does, with its retries
            topk_into(x, k, seed, vals, idx, cand_vals, cand_idx)
    n = min(k, d)
    for j in range(n):
        x[idx[j]] = 0.0
    if v.size:
        for j in range(n):
            v[idx[j]] = 0.0


def topk(x: np.ndarray, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """topk_into with fresh arrays: (values, int32 indices in increasing order)."""
    k = max(0, min(int(k), x.size))
    vals, idx = np.empty(k, x.dtype), np.empty(k, np.int32)
    w = topk_workspace(x.size, k) if k < x.size else 1
    topk_into(x, k, seed, vals, idx, np.empty(w, x.dtype), np.empty(w, np.int32))
    return vals, idx
