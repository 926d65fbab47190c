"""The compression kernels written with torch ops, for gradients that live on a GPU.

Same contracts as ``kernels`` (the Numba versions used on the CPU), but tensors in and
tensors out on the input's device, so a CUDA bucket is compressed where it lives
instead of being copied to the host and back. Bit layouts match the Numba kernels
(sign bits most significant first, as ``np.packbits``; QSGD norms per QSGD_CHUNK
entries), so payloads decode the same on either path. The random draws differ (torch's
generator instead of the counter-based one); both are unbiased.

On the CPU the Numba kernels are faster; the hooks pick these only for other devices
(``base.uses_torch_ops``; the tests patch it to run this path without a GPU). On CUDA, sign
packing and QSGD run as one fused Triton kernel each (``triton_kernels``), and top-k selects
from the entries above a threshold estimated on a sample instead of sorting all of them.
"""

from __future__ import annotations

import torch

from . import triton_kernels
from .kernels import QSGD_CHUNK

_SHIFTS = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0], dtype=torch.uint8)


def _generator(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed & 0x7FFFFFFFFFFFFFFF)


SAMPLE = 65536  # entries looked at to estimate top-k's threshold
SAMPLED_FROM = 16 * SAMPLE  # below this many entries, torch.topk over all of them is as fast


def topk(x: torch.Tensor, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The k entries largest in magnitude: (values, int32 indices in increasing order)."""
    d = x.numel()
    k = max(0, min(k, d))
    idx = above_estimate(x, k) if d >= SAMPLED_FROM and 0 < k * 8 <= d else None
    if idx is None:
        idx = torch.topk(x.abs(), k, sorted=False).indices.sort().values
    return x[idx], idx.to(torch.int32)


def above_estimate(x: torch.Tensor, k: int) -> torch.Tensor | None:
    """The indices of the k entries of ``x`` largest in magnitude, selected among the entries at
    or above a threshold that an evenly strided sample puts a little below the k-th largest:
    those candidates are a few percent more than k, found in one pass (and already in index
    order), and the surplus is dropped by a top-k over the candidates alone. Exact whenever the
    candidates number at least k, which the margin (10% and 4 standard deviations of the sample's
    count) makes near certain; otherwise (or when the candidates are far too many) None, and the
    caller selects from all."""
    d = x.numel()
    sample = x[:: d // SAMPLE].abs()
    m = sample.numel()
    expect = m * k / d
    j = min(m, int(expect * 1.1 + 4 * expect**0.5) + 1)
    threshold = float(torch.topk(sample, j, sorted=False).values.min())
    mask = triton_kernels.at_least(x, threshold) if triton_kernels.usable(x) else x.abs() >= threshold
    candidates = mask.nonzero().squeeze(1)
    surplus = candidates.numel() - k
    if surplus < 0 or surplus > 3 * k:  # too few, or a sample of ties (zeros) gave a useless threshold
        return None
    if surplus:
        keep = torch.ones(candidates.numel(), dtype=torch.bool, device=x.device)
        keep[torch.topk(x[candidates].abs(), surplus, largest=False, sorted=False).indices] = False
        candidates = candidates[keep]
    return candidates


def scatter_add(values: torch.Tensor, indices: torch.Tensor, scale: float, out: torch.Tensor) -> torch.Tensor:
    """out[indices] += values * scale."""
    return out.index_add_(0, indices.long(), values * scale)


def sign_pack(x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """1 bit per element (1 = non-negative, most significant first) and the scale mean(|x|)."""
    if triton_kernels.usable(x):
        return triton_kernels.sign_pack(x)
    d = x.numel()
    bits = torch.zeros(-(-d // 8) * 8, dtype=torch.uint8, device=x.device)
    bits[:d] = x >= 0
    packed = (bits.view(-1, 8) << _SHIFTS.to(x.device)).sum(dim=1, dtype=torch.uint8)
    return packed, float(x.abs().mean()) if d else 0.0


def sign_unpack_add(packed: torch.Tensor, scale: float, weight: float, out: torch.Tensor) -> torch.Tensor:
    """out += weight * (+scale / -scale per element)."""
    d = out.numel()
    bits = ((packed.unsqueeze(1) >> _SHIFTS.to(packed.device)) & 1).reshape(-1)[:d]
    return out.add_(bits.to(out.dtype) * (2.0 * weight * scale) - weight * scale)


def qsgd_chunks(d: int) -> int:
    return -(-d // QSGD_CHUNK)


def qsgd_quantize(x: torch.Tensor, s: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 levels, float32 norm per QSGD_CHUNK entries): unbiased stochastic rounding."""
    if triton_kernels.usable(x):
        return triton_kernels.qsgd_quantize(x, s, seed, QSGD_CHUNK)
    d = x.numel()
    chunks = qsgd_chunks(d)
    padded = torch.zeros(chunks * QSGD_CHUNK, dtype=torch.float32, device=x.device)
    padded[:d] = x
    rows = padded.view(chunks, QSGD_CHUNK)
    norms = rows.double().pow(2).sum(dim=1).sqrt().float()
    scale = torch.where(norms > 0, s / norms, torch.zeros_like(norms)).unsqueeze(1)
    a = rows.abs() * scale
    lo = a.floor()
    u = torch.rand(rows.shape, generator=_generator(seed, x.device), device=x.device)
    level = torch.clamp(lo + (u < a - lo).float(), max=s)
    levels = (level * torch.sign(rows).where(rows != 0, torch.ones_like(rows))).to(torch.int8)
    return levels.reshape(-1)[:d], norms


def qsgd_dequantize_add(
    levels: torch.Tensor, norms: torch.Tensor, s: int, weight: float, out: torch.Tensor
) -> torch.Tensor:
    """out += weight * dequantized levels."""
    d = out.numel()
    chunks = norms.numel()
    padded = torch.zeros(chunks * QSGD_CHUNK, dtype=torch.float32, device=out.device)
    padded[:d] = levels.to(torch.float32)
    padded.view(chunks, QSGD_CHUNK).mul_((norms * (weight / s)).unsqueeze(1))
    return out.add_(padded[:d])
