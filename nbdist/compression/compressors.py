"""The compressors behind the hooks: the pure part of each (no communication), testable alone.

Sparse (TopK, DGC, RandomK) and cast (fp16, bf16); the quantised ones (QSGD, Sign) are in
quantizers.py; the interface they share, the device dispatch and the registry are in base.py.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..errors import ConfigError
from . import base, kernels, torch_kernels
from .base import ALL_GATHER, ALL_REDUCE, Compressor, Identity, Payload, Received, spec_number

_NO_VELOCITY = np.empty(0, np.float32)  # topk_feedback_into's "no momentum"

__all__ = [
    "ALL_GATHER",
    "ALL_REDUCE",
    "DGC",
    "Cast",
    "Compressor",
    "Identity",
    "Payload",
    "RandomK",
    "TopK",
]


def _ratio(name: str, arg: str | None) -> float:
    ratio = spec_number(name, arg, 0.01)
    if not 0 < ratio <= 1:
        raise ConfigError(f"{name} ratio ({ratio}) must be in (0, 1]; e.g. {name}:0.01 keeps 1%.")
    return float(ratio)


class TopK(Compressor):
    """The k = ratio * d largest entries by magnitude; values + int32 indices, all_gather."""

    name, error_feedback = "topk", True
    spec_names = ("topk",)

    def __init__(self, ratio: float = 0.01) -> None:
        self.ratio = ratio

    @classmethod
    def from_spec(cls, name: str, arg: str | None) -> Compressor:
        return cls(_ratio(name, arg))

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

    def decompress(self, got: Received) -> torch.Tensor:
        k = self.k(got.d)
        total = got.buffer(got.result[0])
        if not (got.out_zeroed and total is got.out):
            total.zero_()
        for sender, part in enumerate(got.result):
            with base.decoding(self.name, sender):
                base.scatter_add(part[:k], part[k:].view(torch.int32), 1.0 / got.world, total)
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
    spec_names = ("dgc",)

    def __init__(self, ratio: float = 0.01, momentum: float = 0.9) -> None:
        super().__init__(ratio)
        self.momentum = momentum

    @classmethod
    def from_spec(cls, name: str, arg: str | None) -> Compressor:
        ratio_arg, _, momentum_arg = (arg or "").partition(":")
        ratio, momentum = spec_number(name, ratio_arg or None, 0.01), spec_number(name, momentum_arg or None, 0.9)
        if not 0 < ratio <= 1 or not 0 <= momentum < 1:
            raise ConfigError(
                f"dgc:{arg} needs a ratio in (0, 1] and a momentum in [0, 1); e.g. dgc:0.01 "
                "(1%, momentum 0.9) or dgc:0.01:0.95."
            )
        return cls(ratio, momentum)

    def describe(self) -> str:
        return f"dgc:{self.ratio:g}:{self.momentum:g}"


class RandomK(Compressor):
    """k entries at indices drawn from a seed every rank shares, so values can be all-reduced."""

    name, collective, error_feedback = "randomk", ALL_REDUCE, True
    spec_names = ("randomk",)

    @classmethod
    def from_spec(cls, name: str, arg: str | None) -> Compressor:
        return cls(_ratio(name, arg))
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

    def decompress(self, got: Received) -> torch.Tensor:
        total = got.buffer(got.result).zero_()
        total[got.context] = got.result / got.world
        return total

    def describe(self) -> str:
        return f"randomk:{self.ratio:g}"


class Cast(Compressor):
    """fp16 or bf16 on the wire, all-reduced (works on gloo)."""

    collective = ALL_REDUCE
    warm_up = False  # nearly lossless and stateless: torch's fp16/bf16 hooks start at once too
    spec_names = ("fp16", "bf16")

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.name = "fp16" if dtype == torch.float16 else "bf16"

    @classmethod
    def from_spec(cls, name: str, arg: str | None) -> Compressor:
        return cls(torch.float16 if name == "fp16" else torch.bfloat16)

    def compress(self, x: torch.Tensor, *, seed: int, world: int, scratch: dict | None = None) -> Payload:
        # torch's fp16_compress_hook / bf16_compress_hook exactly: cast, divide, all-reduce, copy back
        wire = x.to(self.dtype).div_(world)
        return Payload(wire, lambda: wire.float().mul_(world))  # this rank's part, as the sum receives it

    def decompress(self, got: Received) -> torch.Tensor:
        if got.out is None:
            return got.result.float()
        return got.out.copy_(got.result)
