"""Compressors: the pure part of each hook (no communication), so it can be tested alone.

A compressor turns one bucket's (error-corrected) gradient into a payload for one
collective, says what the receiver will reconstruct from this rank (``sent``, used for
error feedback), and turns the collective's result back into the mean gradient.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from . import kernels, torch_kernels

ALL_GATHER = "all_gather"
ALL_REDUCE = "all_reduce"


def _seed(base: int, *parts: int) -> int:
    """A 63-bit seed mixed from several integers (iteration, bucket, rank)."""
    h = base & 0x7FFFFFFFFFFFFFFF
    for p in parts:
        h = (h * 6364136223846793005 + p + 1442695040888963407) & 0x7FFFFFFFFFFFFFFF
    return h


def buffer(scratch: dict | None, name: str, n: int, dtype: Any) -> np.ndarray:
    """A reusable array from this bucket's scratch space (fresh if there is none).

    Touching a new multi-megabyte array costs more in page faults than the kernels
    themselves, so hooks keep one set of buffers per bucket."""
    if scratch is None:
        return np.empty(n, dtype)
    key = (name, n, np.dtype(dtype).str)
    arr = scratch.get(key)
    if arr is None:
        arr = scratch[key] = np.empty(n, dtype)
    return arr


# "auto": the Numba kernels for CPU tensors, torch ops (torch_kernels) for tensors on
# other devices; "torch": torch ops everywhere (the tests use it to run the GPU path on CPU).
BACKEND = "auto"


def _on_torch(t: torch.Tensor) -> bool:
    return BACKEND == "torch" or t.device.type != "cpu"


def _dense(scratch: dict | None, name: str, d: int, like: torch.Tensor) -> torch.Tensor:
    """A reusable float32 vector of d entries on ``like``'s device."""
    if like.device.type == "cpu":
        return torch.from_numpy(buffer(scratch, name, d, np.float32))
    key = (name, d, str(like.device))
    t = scratch.get(key) if scratch is not None else None
    if t is None:
        t = torch.empty(d, dtype=torch.float32, device=like.device)
        if scratch is not None:
            scratch[key] = t
    return t


def _out(out: torch.Tensor | None, scratch: dict | None, d: int, like: torch.Tensor) -> torch.Tensor:
    """Where a decompressed mean goes: the caller's tensor (the bucket itself) or a scratch buffer."""
    return out if out is not None else _dense(scratch, "total", d, like)


def _scatter_add(values: torch.Tensor, indices: torch.Tensor, weight: float, out: torch.Tensor) -> None:
    if _on_torch(out):
        torch_kernels.scatter_add(values, indices, weight, out)
    else:
        kernels.scatter_add(values.numpy(), indices.numpy(), weight, out.numpy())


def _sign_unpack_add(body: torch.Tensor, scale: float, weight: float, out: torch.Tensor) -> None:
    if _on_torch(out):
        torch_kernels.sign_unpack_add(body, scale, weight, out)
    else:
        kernels.sign_unpack_add(body.numpy(), scale, weight, out.numpy())


def _qsgd_dequantize_add(body: torch.Tensor, norms: torch.Tensor, s: int, weight: float, out: torch.Tensor) -> None:
    if _on_torch(out):
        torch_kernels.qsgd_dequantize_add(body, norms, s, weight, out)
    else:
        kernels.qsgd_dequantize_add(body.numpy(), norms.numpy(), s, weight, out.numpy())


def _mean_of_parts(
    parts: list[torch.Tensor], d: int, world: int, scratch: dict | None, add: Any, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean over ranks of payloads laid out as a float32 header (norm or scale) + a body;
    ``add(body, header, weight, out)`` adds weight x one rank's dense gradient to ``out``."""
    total = _out(out, scratch, d, parts[0])
    total.zero_()
    for part in parts:
        header = float(part[:4].view(torch.float32)[0])
        add(part[4:], header, 1.0 / world, total)
    return total


class Payload:
    """What one rank hands to the collective, and what the receivers will make of it."""

    __slots__ = ("tensor", "context", "_sent", "_densify")

    def __init__(self, tensor: torch.Tensor, sent: Any = None, context: Any = None) -> None:
        self.tensor = tensor  # what goes on the wire
        self.context = context  # what decompress needs besides the collective's result
        # sent: what receivers reconstruct from this rank (dense float32), or a function
        # that builds it on demand (sparse compressors never need it in the hook)
        self._sent = None if callable(sent) else sent
        self._densify = sent if callable(sent) else None

    @property
    def sent(self) -> torch.Tensor:
        if self._sent is None:
            self._sent = self._densify()  # type: ignore[misc]
        return self._sent


class Compressor:
    name = "base"
    collective = ALL_GATHER
    error_feedback = False
    shared_seed = False  # True: the same random draw on every rank
    momentum = 0.0  # > 0: the hook applies momentum before compressing (DGC's momentum correction)

    def compress(self, x: torch.Tensor, *, seed: int, world: int, scratch: dict | None = None) -> Payload:
        raise NotImplementedError

    def decompress(
        self,
        result: Any,
        d: int,
        world: int,
        context: Any = None,
        scratch: dict | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The mean gradient from the collective's result; written into ``out`` when the
        compressor can (the hook passes the bucket), else returned in a buffer of its own."""
        raise NotImplementedError

    def keep_residual(self, x: torch.Tensor, payload: Payload) -> None:
        """Error feedback: turn x (the corrected gradient) into x - sent, in place."""
        x.sub_(payload.sent)

    def describe(self) -> str:
        return self.name


class Identity(Compressor):
    """No compression; divides before the all-reduce exactly as torch's allreduce_hook does."""

    name, collective = "none", ALL_REDUCE

    def compress(self, x: torch.Tensor, *, seed: int, world: int, scratch: dict | None = None) -> Payload:
        return Payload(x.div_(world), x)

    def decompress(
        self,
        result: torch.Tensor,
        d: int,
        world: int,
        context: Any = None,
        scratch: dict | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return result


class TopK(Compressor):
    """The k = ratio * d largest entries by magnitude; values + int32 indices, all_gather."""

    name, error_feedback = "topk", True

    def __init__(self, ratio: float = 0.01) -> None:
        self.ratio = ratio

    def k(self, d: int) -> int:
        return max(1, min(d, int(math.ceil(self.ratio * d))))

    def compress(self, x: torch.Tensor, *, seed: int, world: int, scratch: dict | None = None) -> Payload:
        d, k = x.numel(), self.k(x.numel())
        if _on_torch(x):
            vals, idx = torch_kernels.topk(x, k, seed)
            wire = torch.cat([vals, idx.view(torch.float32)])
        else:  # values then indices, written by the kernel straight into this bucket's wire buffer
            wire_np = buffer(scratch, "wire", 2 * k, np.float32)
            w = kernels.topk_workspace(d, k)
            cand_vals, cand_idx = buffer(scratch, "cand_vals", w, np.float32), buffer(scratch, "cand_idx", w, np.int32)
            kernels.topk_into(x.numpy(), k, seed, wire_np[:k], wire_np[k:].view(np.int32), cand_vals, cand_idx)
            wire = torch.from_numpy(wire_np)
            vals, idx = wire[:k], wire[k:].view(torch.int32)

        def sent() -> torch.Tensor:
            dense = _dense(scratch, "sent", d, x).zero_()
            _scatter_add(vals, idx, 1.0, dense)
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
    ) -> torch.Tensor:
        k = self.k(d)
        total = _out(out, scratch, d, parts[0])
        total.zero_()
        for part in parts:
            _scatter_add(part[:k], part[k:].view(torch.int32), 1.0 / world, total)
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
    ) -> torch.Tensor:
        total = _out(out, scratch, d, result)
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
        if _on_torch(x):
            levels, norms = torch_kernels.qsgd_quantize(x, self.levels, seed)
            wire = torch.cat([norms.view(torch.int8), levels])
        else:
            wire = torch.empty(head + d, dtype=torch.int8)
            kernels.qsgd_quantize(
                x.numpy(), self.levels, seed, wire[head:].numpy(), wire[:head].view(torch.float32).numpy()
            )

        def sent() -> torch.Tensor:
            dense = _dense(scratch, "sent", d, x).zero_()
            _qsgd_dequantize_add(wire[head:], wire[:head].view(torch.float32), self.levels, 1.0, dense)
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
    ) -> torch.Tensor:
        head = 4 * kernels.qsgd_chunks(d)
        total = _out(out, scratch, d, parts[0])
        total.zero_()
        for part in parts:
            _qsgd_dequantize_add(part[head:], part[:head].view(torch.float32), self.levels, 1.0 / world, total)
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
        if _on_torch(x):
            packed, scale = torch_kernels.sign_pack(x)
        else:
            bits = np.empty((d + 7) // 8, np.uint8)  # goes on the wire: fresh
            scale = kernels.sign_pack(x.numpy(), bits)
            packed = torch.from_numpy(bits)

        def sent() -> torch.Tensor:
            dense = _dense(scratch, "sent", d, x).zero_()
            _sign_unpack_add(packed, scale, 1.0, dense)
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
    ) -> torch.Tensor:
        return _mean_of_parts(parts, d, world, scratch, _sign_unpack_add, out)

    def describe(self) -> str:
        return "signsgd" if self.error_feedback else "signsgd:noef"


class Cast(Compressor):
    """fp16 or bf16 on the wire, all-reduced (works on gloo)."""

    collective = ALL_REDUCE

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.name = "fp16" if dtype == torch.float16 else "bf16"

    def compress(self, x: torch.Tensor, *, seed: int, world: int, scratch: dict | None = None) -> Payload:
        small = x.to(self.dtype)
        sent = small.float()
        return Payload(small.div_(world), sent)  # divide first, as torch's fp16 hook does

    def decompress(
        self,
        result: torch.Tensor,
        d: int,
        world: int,
        context: Any = None,
        scratch: dict | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if out is None:
            return result.float()
        return out.copy_(result)


NAMES = ("none", "fp16", "bf16", "topk", "dgc", "randomk", "qsgd", "signsgd", "powersgd")


def parse(spec: str) -> tuple[str, str | None]:
    """'topk:0.01' -> ('topk', '0.01'); names are checked by the caller."""
    name, _, arg = spec.partition(":")
    return name.strip().lower(), (arg.strip() or None)


def resnet18_shapes(num_classes: int = 10) -> list[tuple[int, ...]]:
    """Parameter shapes of the CIFAR ResNet-18 (3x3 stem, no max-pool), built by hand."""
    shapes: list[tuple[int, ...]] = [(64, 3, 3, 3), (64,), (64,)]
    inp = 64
    for out, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        for block in range(2):
            cin = inp if block == 0 else out
            shapes += [(out, cin, 3, 3), (out,), (out,), (out, out, 3, 3), (out,), (out,)]
            if block == 0 and (stride != 1 or cin != out):
                shapes += [(out, cin, 1, 1), (out,), (out,)]
        inp = out
    return shapes + [(num_classes, 512), (num_classes,)]


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
