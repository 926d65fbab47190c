"""DDP communication hooks in PyTorch's own shape: hook(state, bucket) -> Future[Tensor].

compress -> async collective -> decompress in ``.then``. State objects keep per-bucket
error-feedback residuals and per-step byte/time records, and pickle without their
process group. Stateful hooks run a plain all-reduce for the first ``start_iter``
iterations, while DDP is still rebuilding its buckets.
"""

# No `from __future__ import annotations` here: DDP's register_comm_hook compares the
# hook's annotations with dist.GradBucket and Future[Tensor] as objects, not strings.
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from . import kernels


class HookState:
    """Records for every bucket and step: bytes before/after compression and phase times."""

    __slots__ = ("records", "iteration", "start_iter", "process_group", "residuals", "ratio", "seed")

    def __init__(self, ratio: float = 0.01, start_iter: int = 2, seed: int = 0, process_group: Any = None) -> None:
        self.ratio = ratio
        self.start_iter = start_iter
        self.seed = seed
        self.process_group = process_group
        self.iteration = 0
        self.residuals: dict[int, torch.Tensor] = {}
        self.records: list[dict[str, Any]] = []

    def __getstate__(self) -> dict[str, Any]:
        state = {k: getattr(self, k) for k in self.__slots__}
        state["process_group"] = None  # a process group does not pickle
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            setattr(self, k, v)

    def _step(self, bucket: dist.GradBucket) -> None:
        if bucket.is_last():
            self.iteration += 1

    def record(
        self, bucket: dist.GradBucket, before: int, after: int, compress_s: float, **extra: Any
    ) -> dict[str, Any]:
        rec = {
            "step": self.iteration,
            "bucket": bucket.index(),
            "bytes_before": before,
            "bytes_after": after,
            "compress_s": compress_s,
            **extra,
        }
        self.records.append(rec)
        return rec


def _allreduce_mean(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    group = state.process_group
    world = dist.get_world_size(group)
    buf = bucket.buffer().div_(world)  # divide first, as torch's allreduce_hook does
    fut = dist.all_reduce(buf, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def identity_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """No compression: the reference every compressor is compared with (all-reduce, then mean)."""
    buf = bucket.buffer()
    state.record(bucket, buf.numel() * buf.element_size(), buf.numel() * buf.element_size(), 0.0)
    state._step(bucket)
    return _allreduce_mean(state, bucket)


def _cast_hook(dtype: torch.dtype) -> Any:
    def hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        group = state.process_group
        world = dist.get_world_size(group)
        buf = bucket.buffer()
        tic = time.perf_counter()
        small = buf.to(dtype).div_(world)
        state.record(
            bucket, buf.numel() * buf.element_size(), small.numel() * small.element_size(), time.perf_counter() - tic
        )
        state._step(bucket)
        fut = dist.all_reduce(small, group=group, async_op=True).get_future()

        def back(f: torch.futures.Future) -> torch.Tensor:
            buf.copy_(f.value()[0])
            return buf

        return fut.then(back)

    hook.__name__ = f"{str(dtype).split('.')[-1]}_hook"
    return hook


fp16_hook = _cast_hook(torch.float16)
bf16_hook = _cast_hook(torch.bfloat16)


def topk_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Top-k with error feedback: send the k largest of (gradient + residual) by all_gather."""
    if state.iteration < state.start_iter:
        state._step(bucket)
        return _allreduce_mean(state, bucket)
    group = state.process_group
    world = dist.get_world_size(group)
    buf = bucket.buffer()
    d = buf.numel()
    tic = time.perf_counter()
    corrected = buf.detach().cpu().float()
    residual = state.residuals.get(bucket.index())
    if residual is not None and residual.numel() == d:
        corrected += residual
    k = max(1, int(state.ratio * d))
    vals, idx = kernels.topk(corrected.numpy(), k, state.seed + state.iteration)
    sent = torch.zeros(d)
    sent[torch.from_numpy(idx.astype(np.int64))] = torch.from_numpy(vals)
    state.residuals[bucket.index()] = corrected - sent
    payload = torch.cat([torch.from_numpy(vals).float(), torch.from_numpy(idx).view(torch.float32)])
    state.record(bucket, d * buf.element_size(), payload.numel() * 4, time.perf_counter() - tic, k=k)
    state._step(bucket)
    gathered = [torch.empty_like(payload) for _ in range(world)]
    fut = dist.all_gather(gathered, payload, group=group, async_op=True).get_future()

    def decompress(f: torch.futures.Future) -> torch.Tensor:
        total = torch.zeros(d)
        for part in f.value():
            v, i = part[:k], part[k:].view(torch.int32).long()
            total.index_add_(0, i, v)
        buf.copy_(total.div_(world))
        return buf

    return fut.then(decompress)
