"""The compressors behind the hooks: the pure part of each (no communication), testable alone.

Sparse (TopK, DGC, RandomK), quantised (QSGD, Sign) and cast (fp16, bf16); the interface
they share and the device dispatch are in base.py.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from . import base, kernels, torch_kernels
from .base import ALL_GATHER, ALL_REDUCE, Compressor, Identity, Payload

_NO_VELOCITY = np.empty(0, np.float32)  # topk_feedback_into's "no momentum"

__all__ = [
    "ALL_GATHER",
    "ALL_REDUCE",
    "DGC",
    "NAMES",
    "QSGD",
    "Cast",
    "Compressor",
    "Identity",
    "Payload",
    "RandomK",
    "Sign",
    "TopK",
    "parse",
    "powersgd_bytes",
]


class TopK(Compressor):
    """The k = ratio * d largest entries by magnitude; values + int32 indices, all_gather."""

    name, error_feedback = "topk", True

    def __init__(self, ratio: float = 0.01) -> None:
        self.ratio = ratio

    def k(self, d: int) -> int:
        return max(1, min(d, int(math.ceil(self.ratio * d))))

    def compress(self, x: torch.Tensor, *, seed: int, world: int, scratch: dict | None = None) -> Payload:
        d, k = x.numel(), self.k(x.numel())
        if base.uses_torch_ops(x):
            vals, idx = torch_kernels.topk(x, k, seed)
            return self._payload(torch.cat([vals, idx.view(torch.float32)]), k, x, scratch)
        # values then indices, written by the kernel straight into this bucket's wire buffer
        wire, cand_vals, cand_idx = self._buffers(d, k, scratch)
        kernels.topk_into(x.numpy(), k, seed, wire[:k], wire[k:].view(np.int32), cand_vals, cand_idx)
        return self._payload(torch.from_numpy(wire), k, x, scratch)

    def compress_feedback(
        self,
        grad: torch.Tensor,
        residual: torch.Tensor,
        velocity: torch.Tensor | None,
        *,
        seed: int,
        world: int,
        scratch: dict | None = None,
    ) -> Payload:
        """On the CPU, one Numba pass (kernels.topk_feedback_into) does what the torch ops
        of Compressor.compress_feedback do in five, bit for bit, and leaves grad zeroed."""
        fusable = (
            not base.uses_torch_ops(residual)
            and grad.device.type == "cpu"
            and grad.dtype == residual.dtype == torch.float32
            and grad.is_contiguous()
        )
        if not fusable:
            return super().compress_feedback(grad, residual, velocity, seed=seed, world=world, scratch=scratch)
        d = residual.numel()
        k = self.k(d)
        wire, cand_vals, cand_idx = self._buffers(d, k, scratch)
        kernels.topk_feedback_into(
            residual.numpy(),
            grad.numpy(),
            _NO_VELOCITY if velocity is None else velocity.numpy(),
            self.momentum,
            k,
            seed,
            wire[:k],
            wire[k:].view(np.int32),
            cand_vals,
            cand_idx,
        )
        payload = self._payload(torch.from_numpy(wire), k, residual, scratch)
        payload.grad_zeroed = True
        return payload

    @staticmethod
    def _buffers(d: int, k: int, scratch: dict | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """This bucket's wire (k values, then k int32 indices) and the selection's workspace."""
        w = kernels.topk_workspace(d, k)
        return (
            base.buffer(scratch, "wire", 2 * k, np.float32),
            base.buffer(scratch, "cand_vals", w, np.float32),
            base.buffer(scratch, "cand_idx", w, np.int32),
        )

    @staticmethod
    def _payload(wire: torch.Tensor, k: int, like: torch.Tensor, scratch: dict | None) -> Payload:
        vals, idx = wire[:k], wire[k:].view(torch.int32)
        d = like.numel()

        def sent() -> torch.Tensor:
            dense = base.dense_buffer(scratch, "sent", d, like).zero_()
            base.scatter_add(vals, idx, 1.0, dense)
            return dense

        return Payload(wire, sent, context=idx)

    def keep_residual(self, x: torch.Tensor, payload: Payload) -> None:
        x.index_fill_(0, payload.context.long(), 0.0)  # x - sent: the sent entries leave, the rest stays

    def decompress(
        self,
        parts: list[torch.Tensor],
        d: int,
        world: int,
        context: Any = None,
        scratch: dict | None = None,
        out: torch.Tensor | None = None,
        out_zeroed: bool = False,
    ) -> torch.Tensor:
        k = self.k(d)
        total = base.out_buffer(out, scratch, d, parts[0])
        if not (out_zeroed and total is out):
            total.zero_()
        for sender, part in enumerate(parts):
            with base.decoding(self.name, sender):
                base.scatter_add(part[:k], part[k:].view(torch.int32), 1.0 / world, total)
        return total

    def describe(self) -> str:
        return f"topk:{self.ratio:g}"


class DGC(TopK):
    """Top-k with Deep Gradient Compression's momentum correction (Lin et al., ICLR 2018).

    With error feedback alone, an optimizer's momentum acts on the sparse, delayed sum of
    what ranks sent, and top-k at 1% falls far behind. DGC moves momentum before the
    compression: each rank keeps a velocity u = m * u + grad and accumulates u (not the
    gradient) into its residual; top-k of that residual is sent, and the sent entries are
    cleared from both residual and velocity (momentum factor masking). The optimizer must
    then run *without* momentum (``torch.optim.SGD(params, lr)``): the hook applies it.
    Sparsity warm-up and local gradient clipping, DGC's other two parts, are not included.
    """

    name = "dgc"

    def __init__(self, ratio: float = 0.01, momentum: float = 0.9) -> None:
        super().__init__(ratio)
        self.momentum = momentum

    def describe(self) -> str:
        return f"dgc:{self.ratio:g}:{self.momentum:g}"


class RandomK(Compressor):
    """k entries at indices drawn from a seed every rank shares, so values can be all-reduced."""

    name, collective, error_feedback = "randomk", ALL_REDUCE, True

    shared_seed = True  # every rank must pick the same indices

    def __init__(self, ratio: float = 0.01) -> None:
        self.ratio = ratio

    def compress(self, x: torch.Tensor, *, seed: int, world: int, scratch: dict | None = None) -> Payload:
        d = x.numel()
        k = max(1, min(d, int(math.ceil(self.ratio * d))))
        idx = torch.from_numpy(kernels.randomk_indices(d, k, seed).astype(np.int64)).to(x.device)
        vals = x[idx]

        def sent() -> torch.Tensor:
            dense = torch.zeros(d, device=x.device)
            dense[idx] = vals
            return dense

        return Payload(vals.contiguous(), sent, context=idx)

    def keep_residual(self, x: torch.Tensor, payload: Payload) -> None:
        x[payload.context] = 0.0

    def decompress(
        self,
        result: torch.Tensor,
        d: int,
        world: int,
        context: Any = None,
        scratch: dict | None = None,
        out: torch.Tensor | None = None,
        out_zeroed: bool = False,
    ) -> torch.Tensor:
        total = base.out_buffer(out, scratch, d, result)
        total.zero_()
        total[context] = result / world
        return total

    def describe(self) -> str:
        return f"randomk:{self.ratio:g}"


class QSGD(Compressor):
    """Unbiased stochastic rounding to s levels: an int8 per entry plus one float32 norm
    per 512 entries (kernels.QSGD_CHUNK), all_gather."""

    name = "qsgd"

    def __init__(self, levels: int = 127) -> None:
        if not 1 <= levels <= 127:
            raise ValueError(f"qsgd levels ({levels}) must be 1..127 to fit int8")
        self.levels = levels

    def compress(self, x: torch.Tensor, *, seed: int, world: int, scratch: dict | None = None) -> Payload:
        d = x.numel()
        head = 4 * kernels.qsgd_chunks(d)
        # the wire: float32 norms, then int8 levels; fresh, not reused while in flight
        if base.uses_torch_ops(x):
            levels, norms = torch_kernels.qsgd_quantize(x, self.levels, seed)
            wire = torch.cat([norms.view(torch.int8), levels])
        else:
            wire = torch.empty(head + d, dtype=torch.int8)
            kernels.qsgd_quantize(
                x.numpy(), self.levels, seed, wire[head:].numpy(), wire[:head].view(torch.float32).numpy()
            )

        def sent() -> torch.Tensor:
            dense = base.dense_buffer(scratch, "sent", d, x).zero_()
            base.qsgd_dequantize_add(wire[head:], wire[:head].view(torch.float32), self.levels, 1.0, dense)
            return dense

        return Payload(wire, sent)

    def decompress(
        self,
        parts: list[torch.Tensor],
        d: int,
        world: int,
        context: Any = None,
        scratch: dict | None = None,
        out: torch.Tensor | None = None,
        out_zeroed: bool = False,
    ) -> torch.Tensor:
        head = 4 * kernels.qsgd_chunks(d)
        total = base.out_buffer(out, scratch, d, parts[0])
        for sender, part in enumerate(parts):  # the first part is written, the others added: no zeroing pass
            decode = base.qsgd_dequantize if sender == 0 else base.qsgd_dequantize_add
            with base.decoding(self.name, sender):
                decode(part[head:], part[:head].view(torch.float32), self.levels, 1.0 / world, total)
        return total

    def describe(self) -> str:
        return f"qsgd:{self.levels}"


class Sign(Compressor):
    """1 bit per element plus a scale (mean |x|); with error feedback this is EF-signSGD."""

    name = "signsgd"

    def __init__(self, error_feedback: bool = True) -> None:
        self.error_feedback = error_feedback

    def compress(self, x: torch.Tensor, *, seed: int, world: int, scratch: dict | None = None) -> Payload:
        d = x.numel()
        if base.uses_torch_ops(x):
            packed, scale = torch_kernels.sign_pack(x)
        else:
            bits = np.empty((d + 7) // 8, np.uint8)  # goes on the wire: fresh
            scale = kernels.sign_pack(x.numpy(), bits)
            packed = torch.from_numpy(bits)

        def sent() -> torch.Tensor:
            dense = base.dense_buffer(scratch, "sent", d, x).zero_()
            base.sign_unpack_add(packed, scale, 1.0, dense)
            return dense

        head = torch.tensor([scale], dtype=torch.float32).view(torch.uint8).to(x.device)
        return Payload(torch.cat([head, packed]), sent)

    def decompress(
        self,
        parts: list[torch.Tensor],
        d: int,
        world: int,
        context: Any = None,
        scratch: dict | None = None,
        out: torch.Tensor | None = None,
        out_zeroed: bool = False,
    ) -> torch.Tensor:
        return base.mean_of_parts(self.name, parts, d, world, scratch, base.sign_unpack_add, out)

    def describe(self) -> str:
        return "signsgd" if self.error_feedback else "signsgd:noef"


class Cast(Compressor):
    """fp16 or bf16 on the wire, all-reduced (works on gloo)."""

    collective = ALL_REDUCE
    warm_up = False  # nearly lossless and stateless: torch's fp16/bf16 hooks start at once too

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.name = "fp16" if dtype == torch.float16 else "bf16"

    def compress(self, x: torch.Tensor, *, seed: int, world: int, scratch: dict | None = None) -> Payload:
        # torch's fp16_compress_hook / bf16_compress_hook exactly: cast, divide, all-reduce, copy back
        wire = x.to(self.dtype).div_(world)
        return Payload(wire, lambda: wire.float().mul_(world))  # this rank's part, as the sum receives it

    def decompress(
        self,
        result: torch.Tensor,
        d: int,
        world: int,
        context: Any = None,
        scratch: dict | None = None,
        out: torch.Tensor | None = None,
        out_zeroed: bool = False,
    ) -> torch.Tensor:
        if out is None:
            return result.float()
        return out.copy_(result)


NAMES = ("none", "fp16", "bf16", "topk", "dgc", "randomk", "qsgd", "signsgd", "powersgd")


def parse(spec: str) -> tuple[str, str | None]:
    """'topk:0.01' -> ('topk', '0.01'); names are checked by the caller."""
    name, _, arg = spec.partition(":")
    return name.strip().lower(), (arg.strip() or None)


def powersgd_bytes(shapes: list[tuple[int, ...]], rank: int, min_compression_rate: float = 2.0) -> tuple[int, int]:
    """(bytes before, bytes after) for PowerSGD as torch's hook does it: matrices (rows x rest)
    become P (rows x r) and Q (rest x r); vectors, and matrices too small to gain
    ``min_compression_rate``, are all-reduced as they are. float32."""
    before = after = 0
    for shape in shapes:
        n = math.prod(shape)
        before += 4 * n
        if len(shape) <= 1:
            after += 4 * n
            continue
        rows, cols = shape[0], n // shape[0]
        compressed = (rows + cols) * rank
        after += 4 * (compressed if compressed * min_compression_rate < n else n)
    return before, after
