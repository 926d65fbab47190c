"""Compressors that quantise every entry: QSGD (stochastic levels, int8) and signSGD (one bit per entry)."""

from __future__ import annotations

import numpy as np
import torch

from ..errors import ConfigError
from . import base, kernels, torch_kernels
from .base import Compressor, Payload, Received, spec_number

__all__ = ["QSGD", "Sign"]


class QSGD(Compressor):
    """Unbiased stochastic rounding to s levels: an int8 per entry plus one float32 norm
    per 512 entries (kernels.QSGD_CHUNK), all_gather."""

    name = "qsgd"
    spec_names = ("qsgd",)

    @classmethod
    def from_spec(cls, name: str, arg: str | None) -> Compressor:
        levels = spec_number(name, arg, 127, int)
        if not 1 <= levels <= 127:
            raise ConfigError(f"qsgd levels ({levels}) must be 1..127 to fit in int8; e.g. qsgd:127.")
        return cls(levels)

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

    def decompress(self, got: Received) -> torch.Tensor:
        head = 4 * kernels.qsgd_chunks(got.d)
        total = got.buffer(got.result[0])
        for sender, part in enumerate(got.result):  # the first part is written, the others added: no zeroing pass
            decode = base.qsgd_dequantize if sender == 0 else base.qsgd_dequantize_add
            with base.decoding(self.name, sender):
                decode(part[head:], part[:head].view(torch.float32), self.levels, 1.0 / got.world, total)
        return total

    def describe(self) -> str:
        return f"qsgd:{self.levels}"


class Sign(Compressor):
    """1 bit per element plus a scale (mean |x|); with error feedback this is EF-signSGD."""

    name = "signsgd"
    spec_names = ("signsgd",)

    @classmethod
    def from_spec(cls, name: str, arg: str | None) -> Compressor:
        if arg not in (None, "ef", "noef"):
            raise ConfigError(f"signsgd takes 'ef' or 'noef', not {arg!r}; e.g. signsgd (with error feedback).")
        return cls(error_feedback=arg != "noef")

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

    def decompress(self, got: Received) -> torch.Tensor:
        return base.mean_of_parts(self.name, got, base.sign_unpack_add)

    def describe(self) -> str:
        return "signsgd" if self.error_feedback else "signsgd:noef"
