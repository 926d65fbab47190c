"""Numba kernels for gradient compression: numpy arrays in and out, no torch.

Randomness comes from a counter-based generator (rng.py), so a kernel's result depends
only on its inputs and seed, whatever the thread count; top-k selection is in topk_select.py.

Speed notes (profiled on one core against a numpy copy of the same array):
the loops are branch-free so LLVM vectorises them (``fastmath`` allows vectorised
reductions), and every kernel that writes a full-size array takes an ``out`` buffer:
a fresh 40 MB array costs more in page faults than the whole computation, so the
hooks keep one buffer per bucket. ``parallel=True`` is not used: each rank runs one
thread per core already, and the parallel runtime adds start-up time to every process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from numba import njit

from .. import compat
from .rng import INV24, JIT, mix, uniform, uniforms
from .topk_select import topk, topk_feedback_into, topk_into, topk_workspace

__all__ = [
    "QSGD_CHUNK",
    "qsgd_chunks",
    "qsgd_dequantize",
    "qsgd_dequantize_add",
    "qsgd_quantize",
    "randomk_indices",
    "scatter",
    "scatter_add",
    "sign_pack",
    "sign_unpack",
    "sign_unpack_add",
    "topk",
    "topk_feedback_into",
    "topk_into",
    "topk_workspace",
    "uniforms",
    "cached",
    "warm_up",
    "warm_up_steps",
]


# The kernels that read what another rank sent (scatter, unpack, dequantize) check its indices
# and lengths: numba does not, and a corrupt payload would write past the end of ``out`` and
# crash the rank. They raise with a %-format and its values (compression/base.py words the error).
@JIT
def scatter(values: np.ndarray, indices: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out`` zeroed, then values placed at indices (repeats add up)."""
    out[:] = 0
    scatter_add(values, indices, 1.0, out)
    return out


@JIT
def scatter_add(values: np.ndarray, indices: np.ndarray, scale: float, out: np.ndarray) -> None:
    """out[indices] += values * scale (repeats add up): one rank's sparse part of a mean."""
    n = out.size
    if values.size < indices.size:
        raise ValueError("%d indices came with %d values", indices.size, values.size)
    if n == 0 and indices.size > 0:
        raise IndexError("index %d (entry %d) is outside the bucket's %d entries", indices[0], 0, n)
    f = np.float32(scale)
    last = np.uint64(max(n, 1) - 1)
    outside = 0
    for j in range(indices.size):
        # Branch-free: an index outside the bucket (negative ones wrap to huge) writes to its last
        # entry, and the call raises after the loop (the bucket is lost either way). +0-2% on the
        # scatter; a branch in the loop cost +14%, a min/max pass of its own +5%.
        u = np.uint64(np.int64(indices[j]))
        outside += int(u > last)
        out[min(u, last)] += values[j] * f
    if outside:
        for j in range(indices.size):
            if indices[j] < 0 or indices[j] >= n:
                raise IndexError("index %d (entry %d) is outside the bucket's %d entries", indices[j], j, n)


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
        r = int(uniform(s, np.uint64(n)) * (j + 1))
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


@JIT
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


@JIT
def sign_unpack(packed: np.ndarray, scale: float, out: np.ndarray) -> np.ndarray:
    """+scale / -scale per element of ``out`` from sign_pack's bits."""
    if packed.size * 8 < out.size:
        raise ValueError("%d bytes of signs hold fewer than the bucket's %d entries", packed.size, out.size)
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


@JIT
def qsgd_quantize(x: np.ndarray, s: int, seed: int, out: np.ndarray, norms: np.ndarray) -> np.ndarray:
    """Stochastic rounding of |x_i| / ||chunk|| to s levels into ``out`` (int8), chunk by
    chunk of QSGD_CHUNK entries, each chunk's L2 norm into ``norms`` (float32,
    ceil(d / QSGD_CHUNK)); returns norms.

    E[level_i] * norm / s = x_i (unbiased up to the 2**-24 resolution of the uniform
    draw). A norm per chunk keeps the variance at most chunk / s**2 of the chunk's
    squared norm; one norm for a whole bucket of d entries would allow d / s**2, which
    for a 400k-entry bucket is noise 2.5x the gradient. s must be at most 127.
    """
    base = mix(np.uint64(seed))
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
            u = np.float32(mix(base ^ np.uint64(start + i)) >> np.uint64(40)) * INV24
            level = np.int8(min(lo + np.float32(u < a - lo), np.float32(s)))  # rounding never passes s
            qs[i] = level if xs[i] >= 0 else -level
    return norms


@JIT
def _check_qsgd(levels: np.ndarray, norms: np.ndarray, out: np.ndarray) -> None:
    if levels.size != out.size or norms.size != (out.size + QSGD_CHUNK - 1) // QSGD_CHUNK:
        raise ValueError(
            "%d levels and %d norms do not describe the bucket's %d entries", levels.size, norms.size, out.size
        )


@JIT
def qsgd_dequantize(levels: np.ndarray, norms: np.ndarray, s: int, out: np.ndarray, weight: float = 1.0) -> np.ndarray:
    """out = weight * dequantized levels (the first rank's share of a mean: no zeroing pass)."""
    _check_qsgd(levels, norms, out)
    for c in range(norms.size):
        f = np.float32(weight * norms[c] / s)
        start = c * QSGD_CHUNK
        ls = levels[start : start + QSGD_CHUNK]
        os_ = out[start : start + QSGD_CHUNK]
        for i in range(ls.size):
            os_[i] = np.float32(ls[i]) * f
    return out


@JIT
def qsgd_dequantize_add(levels: np.ndarray, norms: np.ndarray, s: int, weight: float, out: np.ndarray) -> np.ndarray:
    """out += weight * dequantized levels: one rank's share of a mean, in one pass."""
    _check_qsgd(levels, norms, out)
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


@JIT
def sign_unpack_add(packed: np.ndarray, scale: float, weight: float, out: np.ndarray) -> np.ndarray:
    """out += weight * (+scale / -scale per element): one rank's share of a mean, in one pass."""
    if packed.size * 8 < out.size:
        raise ValueError("%d bytes of signs hold fewer than the bucket's %d entries", packed.size, out.size)
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


def warm_up_steps() -> list[tuple[Any, Callable[[], Any]]]:
    """(kernel, a call of it on tiny arrays of the types the hooks pass), one per kernel: each
    call loads the kernel from numba's cache (or compiles it) and sets up numba's typing
    registries now, not at a training step. The warm process (engine/warm.py) runs them while
    idle, one at a time, so forked ranks start warm and a fork never waits behind a compile."""
    x = np.linspace(-1.0, 1.0, 64).astype(np.float32)
    out = np.empty(64, np.float32)
    levels, norms = np.empty(64, np.int8), np.empty(qsgd_chunks(64), np.float32)
    packed, idx = np.empty(8, np.uint8), np.arange(8, dtype=np.int32)
    vals, cand = np.empty(8, np.float32), np.empty(8, np.float32)
    scale = 0.5
    return [
        (topk_into, lambda: topk(x, 8, 0)),  # topk: topk_into with fresh arrays
        (
            topk_feedback_into,
            lambda: topk_feedback_into(
                x.copy(), out.copy(), np.empty(0, np.float32), 0.9, 8, 0, vals, idx.copy(), cand, idx.copy()
            ),
        ),
        (qsgd_quantize, lambda: qsgd_quantize(x, 127, 0, levels, norms)),
        (
            qsgd_dequantize,
            lambda: (qsgd_dequantize(levels, norms, 127, out), qsgd_dequantize(levels, norms, 127, out, 0.5)),
        ),
        (qsgd_dequantize_add, lambda: qsgd_dequantize_add(levels, norms, 127, 0.5, out)),
        (sign_pack, lambda: sign_pack(x, packed)),
        (sign_unpack, lambda: sign_unpack(packed, scale, out)),
        (sign_unpack_add, lambda: sign_unpack_add(packed, scale, 0.5, out)),
        (randomk_indices, lambda: randomk_indices(64, 8, 0)),
        (scatter, lambda: scatter(x[:8], idx, out)),
        (scatter_add, lambda: scatter_add(x[:8], idx, 0.5, out)),
    ]


def cached() -> bool:
    """Whether every kernel the hooks use is in numba's cache, fresh (so warming up takes
    ~0.35 s, not the ~16 s of compiling them all)."""
    return all(compat.numba_cached(kernel) for kernel, _ in warm_up_steps())


def warm_up() -> None:
    """Load (or compile) every kernel now: all of ``warm_up_steps``."""
    for _, step in warm_up_steps():
        step()
