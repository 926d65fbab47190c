"""What every compressor shares: the Compressor interface, its Payload, buffers, and the
device dispatch (Numba kernels on the CPU, torch ops where the gradient lives elsewhere).

A compressor turns one bucket's (error-corrected) gradient into a payload for one
collective, says what the receiver will reconstruct from this rank (``sent``, used for
error feedback), and turns the collective's result back into the mean gradient.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError
from . import kernels, torch_kernels

# Every compressor a spec can name ('topk:0.01'), filled by the classes themselves (``spec_names``).
REGISTRY: dict[str, type[Compressor]] = {}

ALL_GATHER = "all_gather"
ALL_REDUCE = "all_reduce"


def mix_seed(base: int, *parts: int) -> int:
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


def uses_torch_ops(t: torch.Tensor) -> bool:
    """Compress this tensor with torch ops (torch_kernels, where it lives) rather than the Numba
    kernels? True off the CPU. (The tests patch it to run the GPU path on the CPU.)"""
    return t.device.type != "cpu"


def dense_buffer(scratch: dict | None, name: str, d: int, like: torch.Tensor) -> torch.Tensor:
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


def scatter_add(values: torch.Tensor, indices: torch.Tensor, weight: float, out: torch.Tensor) -> None:
    if uses_torch_ops(out):
        torch_kernels.scatter_add(values, indices, weight, out)
    else:
        kernels.scatter_add(values.numpy(), indices.numpy(), weight, out.numpy())


def sign_unpack_add(body: torch.Tensor, scale: float, weight: float, out: torch.Tensor) -> None:
    if uses_torch_ops(out):
        torch_kernels.sign_unpack_add(body, scale, weight, out)
    else:
        kernels.sign_unpack_add(body.numpy(), scale, weight, out.numpy())


def qsgd_dequantize(body: torch.Tensor, norms: torch.Tensor, s: int, weight: float, out: torch.Tensor) -> None:
    """out = weight * dequantized body: the first part of a mean, written without zeroing out first."""
    if uses_torch_ops(out):
        torch_kernels.qsgd_dequantize_add(body, norms, s, weight, out.zero_())
    else:
        kernels.qsgd_dequantize(body.numpy(), norms.numpy(), s, out.numpy(), weight)


def qsgd_dequantize_add(body: torch.Tensor, norms: torch.Tensor, s: int, weight: float, out: torch.Tensor) -> None:
    if uses_torch_ops(out):
        torch_kernels.qsgd_dequantize_add(body, norms, s, weight, out)
    else:
        kernels.qsgd_dequantize_add(body.numpy(), norms.numpy(), s, weight, out.numpy())


class CorruptPayload(ValueError):
    """What another rank sent cannot be this bucket's payload (an index past its end, a short body)."""


@contextlib.contextmanager
def decoding(compressor: str, sender: int) -> Iterator[None]:
    """Turn a kernel's refusal of one rank's part into one error naming both ranks and the compressor."""
    try:
        yield
    except (IndexError, ValueError, RuntimeError) as exc:
        said = exc.args[0] % exc.args[1:] if len(exc.args) > 1 and isinstance(exc.args[0], str) else str(exc)
        here = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        raise CorruptPayload(
            f"rank {here} received a corrupt {compressor} payload from rank {sender}: {said}. Every rank must "
            "run the same model and compressor settings; if they do, the payload was damaged on the way."
        ) from None


def mean_of_parts(name: str, got: Received, add: Any) -> torch.Tensor:
    """Mean over ranks of payloads (``got.result``, one per rank) laid out as a float32 header (norm or scale)
    + a body; ``add(body, header, weight, out)`` adds weight x one rank's dense gradient to ``out``."""
    total = got.buffer(got.result[0]).zero_()
    for sender, part in enumerate(got.result):
        with decoding(name, sender):
            header = float(part[:4].view(torch.float32)[0])
            add(part[4:], header, 1.0 / got.world, total)
    return total


class Payload:
    """What one rank hands to the collective, and what the receivers will make of it."""

    __slots__ = ("tensor", "context", "grad_zeroed", "_sent", "_densify")

    def __init__(self, tensor: torch.Tensor, sent: Any = None, context: Any = None, grad_zeroed: bool = False) -> None:
        self.tensor = tensor  # what goes on the wire
        self.context = context  # what decompress needs besides the collective's result
        # compress_feedback left the gradient it was given zeroed (TopK's fused pass):
        # a decompress into that tensor need not zero it again (``out_zeroed``)
        self.grad_zeroed = grad_zeroed
        # sent: what receivers reconstruct from this rank (dense float32), or a function
        # that builds it on demand (sparse compressors never need it in the hook)
        self._sent = None if callable(sent) else sent
        self._densify = sent if callable(sent) else None

    @property
    def sent(self) -> torch.Tensor:
        if self._sent is None:
            self._sent = self._densify()  # type: ignore[misc]
        return self._sent


@dataclass(slots=True)
class Received:
    """What ``Compressor.decompress`` works from: the collective's ``result`` (all_gather: one payload per rank;
    all_reduce: the sum), the bucket's length ``d``, the ``world`` size, what ``compress`` kept for this step
    (``Payload.context``), the bucket's reusable buffers (``scratch``), and where the mean goes: ``out`` (the
    bucket itself, or None for a buffer of the compressor's), ``out_zeroed`` when it holds zeros already
    (``Payload.grad_zeroed``)."""

    result: Any
    d: int
    world: int
    context: Any = None
    scratch: dict | None = None
    out: torch.Tensor | None = None
    out_zeroed: bool = False

    def buffer(self, like: torch.Tensor) -> torch.Tensor:
        """Where the mean goes: ``out``, or the bucket's scratch buffer (on ``like``'s device)."""
        return self.out if self.out is not None else dense_buffer(self.scratch, "total", self.d, like)


class Compressor:
    """The compress/decompress pair behind one DDP comm hook, with no communication of its own.

    ``compress(x)`` turns one bucket's (error-corrected) gradient into a ``Payload`` for
    ``collective`` (all_gather: each rank's payload comes back as a list; all_reduce:
    payloads are summed, so they must line up entry by entry); ``decompress`` turns the
    collective's result into the mean gradient, into ``out`` when given. With
    ``error_feedback``, the hook keeps ``x - sent`` (``keep_residual``) and adds it to the
    next step's gradient. ``shared_seed``: every rank must draw the same random numbers.
    ``warm_up``: the hook sends plain all-reduces for the first ``start_iter`` steps, while DDP
    may still rebuild its buckets (a residual or velocity kept per bucket would then belong
    to another bucket) and while early training is most sensitive to lossy gradients, as
    torch's PowerSGD does; casts (fp16, bf16) and no compression start at once.
    """

    name = "base"
    spec_names: tuple[str, ...] = ()  # the names a spec uses for it ("topk"); a class that sets them registers
    collective = ALL_GATHER
    error_feedback = False
    shared_seed = False  # True: the same random draw on every rank
    momentum = 0.0  # > 0: the hook applies momentum before compressing (DGC's momentum correction)
    warm_up = True  # plain all-reduces for the first start_iter steps

    def compress(self, x: torch.Tensor, *, seed: int, world: int, scratch: dict | None = None) -> Payload:
        raise NotImplementedError

    def decompress(self, got: Received) -> torch.Tensor:
        """The mean gradient from what the collective brought (``Received``); written into ``got.out``
        when the compressor can (the hook passes the bucket), else returned in a buffer of its own."""
        raise NotImplementedError

    def keep_residual(self, x: torch.Tensor, payload: Payload) -> None:
        """Error feedback: turn x (the corrected gradient) into x - sent, in place."""
        x.sub_(payload.sent)

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
        """One error-feedback step: residual += grad (with ``momentum``, DGC's correction:
        velocity = momentum * velocity + grad, then residual += velocity), compress the
        residual, and leave in it (and in the velocity) what was not sent, for the next
        step. Written with torch ops here; TopK fuses it into one pass on the CPU."""
        if velocity is not None:
            residual += velocity.mul_(self.momentum).add_(grad)
        else:
            residual += grad
        payload = self.compress(residual, seed=seed, world=world, scratch=scratch)
        self.keep_residual(residual, payload)  # what was not sent waits for the next step
        if velocity is not None:
            self.keep_residual(velocity, payload)  # momentum factor masking: sent entries stop moving
        return payload

    def describe(self) -> str:
        return self.name

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for spec_name in cls.__dict__.get("spec_names", ()):
            REGISTRY[spec_name] = cls

    @classmethod
    def from_spec(cls, name: str, arg: str | None) -> Compressor:
        """The compressor ``name[:arg]`` names (``make_hook``); ConfigError for an argument it cannot take."""
        return cls()


def spec_number(name: str, arg: str | None, default: float, kind: type = float) -> Any:
    """A spec's parameter as a number (``default`` when absent); ConfigError naming the spec when it is not one."""
    if arg is None:
        return kind(default)
    try:
        return kind(arg)
    except ValueError:
        raise ConfigError(f"{name}:{arg} has a parameter that is not a number; write e.g. {name}:{default}.") from None


class Identity(Compressor):
    """No compression; divides before the all-reduce exactly as torch's allreduce_hook does."""

    name, collective, warm_up = "none", ALL_REDUCE, False
    spec_names = ("none",)

    def compress(self, x: torch.Tensor, *, seed: int, world: int, scratch: dict | None = None) -> Payload:
        return Payload(x.div_(world), x)

    def decompress(self, got: Received) -> torch.Tensor:
        return got.result  # type: ignore[no-any-return]  # all_reduce: the summed means, in the bucket
