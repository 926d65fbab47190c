"""Fused CUDA kernels (Triton) for sign packing, QSGD and top-k's candidates: one read of the gradient each.

Written with torch ops (``torch_kernels``), sign packing and QSGD take five to eight passes over
memory and a launch per op; on an H200 they ran at 2 to 6% of the card's copy bandwidth
(benchmarks/compression_gpu.py). Here each is one kernel that reads the gradient once and
writes the payload, so the hooks' GPU path is bound by memory, as the CPU path is bound by it
through Numba.

Same contracts and bit layouts as ``torch_kernels`` (which calls these for CUDA tensors when
Triton is importable; it ships with every CUDA build of torch on Linux). Sums are taken per
block and then added by torch in a fixed order, so a result does not change from run to run.
QSGD's random draws come from Triton's Philox generator keyed by the seed and the element's
index: deterministic per seed, unbiased, different from torch's generator.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU build of torch: the torch-op kernels serve
    triton = None

AVAILABLE = triton is not None
SIGN_BYTES = 512  # packed bytes per program (4096 gradient entries)
QSGD_ROWS = 8  # QSGD chunks per program


def usable(x: torch.Tensor) -> bool:
    """Triton compiles for CUDA devices; anything else stays on the torch-op kernels."""
    return AVAILABLE and x.is_cuda and x.dtype == torch.float32 and x.is_contiguous() and x.numel() < 2**31


if AVAILABLE:

    @triton.jit
    def _sign_pack(x_ptr, out_ptr, partial_ptr, n, nbytes, BYTES: tl.constexpr):
        pid = tl.program_id(0)
        byte = pid * BYTES + tl.arange(0, BYTES)
        bit = tl.arange(0, 8)
        offs = byte[:, None] * 8 + bit[None, :]
        inside = offs < n
        v = tl.load(x_ptr + offs, mask=inside, other=-1.0)  # padding packs as 0, as np.packbits
        bits = (v >= 0).to(tl.int32) << (7 - bit)[None, :]
        tl.store(out_ptr + byte, tl.sum(bits, axis=1).to(tl.uint8), mask=byte < nbytes)
        tl.store(partial_ptr + pid, tl.sum(tl.sum(tl.where(inside, tl.abs(v), 0.0), axis=1), axis=0))

    @triton.jit
    def _quantize_quarter(v, norm, s, bits, levels_ptr, offs, inside):
        a = tl.abs(v) * tl.where(norm > 0, s / norm, 0.0)[:, None]
        lo = tl.floor(a)
        u = tl.random.uint_to_uniform_float(bits)
        level = tl.minimum(lo + (u < a - lo).to(tl.float32), s)
        tl.store(levels_ptr + offs, tl.where(v < 0, -level, level).to(tl.int8), mask=inside)

    @triton.jit(do_not_specialize=["seed"])
    def _qsgd_quantize(x_ptr, levels_ptr, norms_ptr, n, chunks, s, seed, ROWS: tl.constexpr, CHUNK: tl.constexpr):
        # Each chunk is taken as four quarters, so that one Philox call (four random words) serves
        # four entries: drawing one word per entry made the kernel compute-bound at a third of the
        # speed of the same kernel without draws (H200).
        Q: tl.constexpr = CHUNK // 4
        pid = tl.program_id(0)
        row = pid * ROWS + tl.arange(0, ROWS)
        offs = row[:, None] * CHUNK + tl.arange(0, Q)[None, :]
        in0, in1, in2, in3 = offs < n, offs + Q < n, offs + 2 * Q < n, offs + 3 * Q < n
        v0 = tl.load(x_ptr + offs, mask=in0, other=0.0)
        v1 = tl.load(x_ptr + offs + Q, mask=in1, other=0.0)
        v2 = tl.load(x_ptr + offs + 2 * Q, mask=in2, other=0.0)
        v3 = tl.load(x_ptr + offs + 3 * Q, mask=in3, other=0.0)
        w0, w1, w2, w3 = v0.to(tl.float64), v1.to(tl.float64), v2.to(tl.float64), v3.to(tl.float64)
        squares = tl.sum(w0 * w0, axis=1) + tl.sum(w1 * w1, axis=1) + tl.sum(w2 * w2, axis=1) + tl.sum(w3 * w3, axis=1)
        norm = tl.sqrt(squares).to(tl.float32)  # in double, as the Numba kernel sums
        r0, r1, r2, r3 = tl.randint4x(seed, offs)
        _quantize_quarter(v0, norm, s, r0, levels_ptr, offs, in0)
        _quantize_quarter(v1, norm, s, r1, levels_ptr, offs + Q, in1)
        _quantize_quarter(v2, norm, s, r2, levels_ptr, offs + 2 * Q, in2)
        _quantize_quarter(v3, norm, s, r3, levels_ptr, offs + 3 * Q, in3)
        tl.store(norms_ptr + row, norm, mask=row < chunks)

    @triton.jit
    def _at_least(x_ptr, out_ptr, n, threshold, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        v = tl.load(x_ptr + offs, mask=inside, other=0.0)
        tl.store(out_ptr + offs, tl.abs(v) >= threshold, mask=inside)


def sign_pack(x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """1 bit per element (1 = non-negative, most significant first) and the scale mean(|x|)."""
    d = x.numel()
    nbytes = -(-d // 8)
    packed = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    if d == 0:
        return packed, 0.0
    programs = -(-nbytes // SIGN_BYTES)
    partial = torch.empty(programs, dtype=torch.float32, device=x.device)
    _sign_pack[(programs,)](x, packed, partial, d, nbytes, BYTES=SIGN_BYTES)
    return packed, float(partial.sum(dtype=torch.float64)) / d


def at_least(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """``x.abs() >= threshold`` as a bool mask, in one read of ``x``."""
    out = torch.empty(x.shape, dtype=torch.bool, device=x.device)
    block = 4096
    _at_least[(-(-x.numel() // block),)](x, out, x.numel(), threshold, BLOCK=block)
    return out


def qsgd_quantize(x: torch.Tensor, s: int, seed: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 levels, float32 norm per ``chunk`` entries): unbiased stochastic rounding."""
    d = x.numel()
    chunks = -(-d // chunk)
    levels = torch.empty(d, dtype=torch.int8, device=x.device)
    norms = torch.empty(chunks, dtype=torch.float32, device=x.device)
    if d:
        grid = (-(-chunks // QSGD_ROWS),)
        seed &= 0x7FFFFFFF  # Philox's key: a 31-bit seed keeps one compiled kernel for every seed
        _qsgd_quantize[grid](x, levels, norms, d, chunks, s, seed, ROWS=QSGD_ROWS, CHUNK=chunk, num_warps=8)
    return levels, norms
