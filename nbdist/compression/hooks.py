"""DDP communication hooks in PyTorch's own shape: hook(state, bucket) -> Future[Tensor].

compress -> async collective -> decompress in ``.then``. ``HookState`` keeps the
error-feedback residual of each bucket and one record per bucket and step (bytes
before and after, seconds compressing, in the collective, decompressing), and pickles
without its process group. Stateful compressors run a plain all-reduce for the first
``start_iter`` iterations, while DDP is still rebuilding its buckets.
"""

# No `from __future__ import annotations` here: DDP's register_comm_hook compares the
# hook's annotations with dist.GradBucket and Future[Tensor] as objects, not strings.
import math
import time
from typing import Any

import torch
import torch.distributed as dist

from .base import ALL_REDUCE, Compressor, Identity, Received, dense_buffer, mix_seed

KEEP_RECORDS = 20_000  # per hook state; older records are dropped in halves (``dropped`` counts them)


class Records:
    """What every compression hook's state shares: one record per bucket and step (``step``,
    ``bucket``, ``bytes_before``, ``bytes_after``, and the seconds it timed), bounded on long
    runs, and ``step_totals()``, which the notebooks and benchmarks read."""

    __slots__ = ("records", "dropped")
    TIMES = ("compress_s", "collective_s", "decompress_s", "hook_s")

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.dropped = 0  # records dropped from the front of ``records``

    def add(self, record: dict[str, Any]) -> dict[str, Any]:
        """Append one bucket's record (and return it, for the hook to complete)."""
        self.records.append(record)
        if len(self.records) > KEEP_RECORDS:
            half = len(self.records) // 2
            del self.records[:half]
            self.dropped += half
        return record

    def step_totals(self) -> list[dict[str, Any]]:
        """Records summed per step: bytes before and after, and each time the hook measured
        (compress, collective and decompress for nbdist's hooks; ``hook_s``, the hook's whole
        span, for torch's PowerSGD, whose phases interleave)."""
        steps: dict[int, dict[str, Any]] = {}
        for r in self.records:
            s = steps.setdefault(r["step"], {"step": r["step"], "bytes_before": 0, "bytes_after": 0})
            s["bytes_before"] += r["bytes_before"]
            s["bytes_after"] += r["bytes_after"]
            for key in self.TIMES:
                if key in r:
                    s[key] = s.get(key, 0.0) + r[key]
        return [steps[k] for k in sorted(steps)]

    def _fields(self) -> tuple[str, ...]:
        return tuple(name for cls in type(self).__mro__ for name in getattr(cls, "__slots__", ()))

    def __getstate__(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self._fields()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            setattr(self, k, v)


class HookState(Records):
    """What a compression hook keeps between calls; readable from the notebook."""

    __slots__ = (
        "compressor",
        "start_iter",
        "seed",
        "process_group",
        "iteration",
        "residuals",
        "velocities",
        "scratch",
    )

    def __init__(
        self, compressor: Compressor | None = None, start_iter: int = 2, seed: int = 0, process_group: Any = None
    ) -> None:
        super().__init__()
        self.compressor = compressor or Identity()
        self.start_iter = start_iter
        self.seed = seed
        self.process_group = process_group
        self.iteration = 0
        self.residuals: dict[int, torch.Tensor] = {}
        self.velocities: dict[int, torch.Tensor] = {}  # per bucket, for compressors with momentum (DGC)
        self.scratch: dict[int, dict] = {}  # reusable buffers per bucket

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["process_group"] = None  # a process group does not pickle
        state["scratch"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.velocities = {}  # absent from states pickled before DGC existed
        super().__setstate__(state)


def _per_bucket(store: dict[int, torch.Tensor], index: int, buf: torch.Tensor) -> torch.Tensor:
    """The float32 vector kept for this bucket (zeros at first, or when the bucket changed)."""
    t = store.get(index)
    if t is None or t.numel() != buf.numel() or t.device != buf.device:
        t = store[index] = torch.zeros(buf.numel(), device=buf.device)
    return t


def compression_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The one hook behind every compressor in ``compressors``: compress the bucket where it lives, send it with
    the compressor's collective, and decompress the mean back into the bucket; each step recorded."""
    group = state.process_group
    world = dist.get_world_size(group)
    buf, index, step = bucket.buffer(), bucket.index(), state.iteration
    if bucket.is_last():
        state.iteration += 1
    tic = time.perf_counter()
    if step < state.start_iter and state.compressor.warm_up:
        return _uncompressed(state, buf, step, index, group, world)
    scratch = _scratch(state, index, buf.numel())
    in_place = buf.dtype == torch.float32 and buf.is_contiguous()  # compressed where it lives, no copy
    payload = _compress(state, buf, step, index, scratch, in_place, group, world)
    wire = payload.tensor.contiguous()
    record = state.add(_record(step, index, buf, wire, compress_s=time.perf_counter() - tic))
    fut, gathered = _send(state.compressor, wire, group, world, record)

    def decompress(f: torch.futures.Future) -> torch.Tensor:
        record["collective_s"] = time.perf_counter() - record["launch"]
        t = time.perf_counter()
        result = f.value()[0] if gathered is None else gathered
        out, zeroed = (buf, payload.grad_zeroed) if in_place else (None, False)
        mean = state.compressor.decompress(Received(result, buf.numel(), world, payload.context, scratch, out, zeroed))
        if mean is not buf:
            buf.copy_(mean.to(device=buf.device, dtype=buf.dtype))
        record["decompress_s"] = time.perf_counter() - t
        return buf

    return fut.then(decompress)


def _record(step: int, index: int, buf: torch.Tensor, wire: torch.Tensor, **more: Any) -> dict[str, Any]:
    """One bucket's step as the dashboard reads it: bytes before and after compression, and the times."""
    return {
        "step": step,
        "bucket": index,
        "bytes_before": buf.numel() * buf.element_size(),
        "bytes_after": wire.numel() * wire.element_size(),
        **more,
    }


def _uncompressed(
    state: HookState, buf: torch.Tensor, step: int, index: int, group: Any, world: int
) -> torch.futures.Future[torch.Tensor]:
    """A warm-up step: the mean by a plain all-reduce, recorded as such."""
    wire = buf.div_(world)
    record = state.add(_record(step, index, buf, wire, compress_s=0.0, warmup=True))
    launch = record["launch"] = time.perf_counter()
    fut = dist.all_reduce(wire, group=group, async_op=True).get_future()

    def reduced(f: torch.futures.Future) -> torch.Tensor:
        record["collective_s"] = time.perf_counter() - launch
        return f.value()[0]

    return fut.then(reduced)


def _scratch(state: HookState, index: int, numel: int) -> dict[str, Any]:
    """This bucket's reusable buffers: fresh multi-megabyte allocations each step cost more in page faults than
    compressing. A bucket that changed size (DDP rebuilds its buckets after the first step) starts afresh."""
    scratch = state.scratch.get(index)
    if scratch is None or scratch.get("numel") != numel:
        scratch = state.scratch[index] = {"numel": numel}
    return scratch


def _compress(
    state: HookState,
    buf: torch.Tensor,
    step: int,
    index: int,
    scratch: dict[str, Any],
    in_place: bool,
    group: Any,
    world: int,
) -> Any:
    """The compressor's payload for this bucket (Numba kernels on the CPU, torch ops on a GPU). With error
    feedback the residual takes the gradient in (x = residual + grad) and keeps what was not sent for the next
    step; DGC's velocity likewise."""
    comp = state.compressor
    seed = mix_seed(state.seed, step, index, 0 if comp.shared_seed else dist.get_rank(group))
    if comp.error_feedback:
        residual = _per_bucket(state.residuals, index, buf)
        velocity = _per_bucket(state.velocities, index, buf) if comp.momentum else None
        grad = buf.detach() if in_place else buf.detach().float()
        return comp.compress_feedback(grad, residual, velocity, seed=seed, world=world, scratch=scratch)
    if in_place:
        x = buf.detach()
    else:
        x = dense_buffer(scratch, "x", buf.numel(), buf)
        x.copy_(buf.detach())
    return comp.compress(x, seed=seed, world=world, scratch=scratch)


def _send(
    comp: Compressor, wire: torch.Tensor, group: Any, world: int, record: dict[str, Any]
) -> tuple[torch.futures.Future, list[torch.Tensor] | None]:
    """Start the compressor's collective on the payload: an all-reduce, or an all-gather (its list)."""
    record["launch"] = time.perf_counter()
    if comp.collective == ALL_REDUCE:
        return dist.all_reduce(wire, group=group, async_op=True).get_future(), None
    gathered = [torch.empty_like(wire) for _ in range(world)]
    return dist.all_gather(gathered, wire, group=group, async_op=True).get_future(), gathered


class PowerSGDHookState(Records):
    """torch's PowerSGDState plus nbdist's records (bytes, and the hook's whole span)."""

    __slots__ = ("psgd", "rank")

    def __init__(self, rank: int = 2, start_iter: int = 2, process_group: Any = None, **kwargs: Any) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

        super().__init__()
        self.rank = rank
        self.psgd = PowerSGDState(
            process_group=process_group, matrix_approximation_rank=rank, start_powerSGD_iter=start_iter, **kwargs
        )  # PowerSGDState drops its group when pickled


def powersgd_hook(state: PowerSGDHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's own powerSGD_hook, the low-rank reference, with bytes and its span recorded."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

    tic = time.perf_counter()
    buf = bucket.buffer()
    before = buf.numel() * buf.element_size()
    if state.psgd.iter < state.psgd.start_powerSGD_iter:
        after = before
    else:
        shapes = [tuple(g.shape) for g in bucket.gradients()]
        _, after = powersgd_bytes(shapes, state.rank, state.psgd.min_compression_rate)
    record = state.add(
        {"step": state.psgd.iter, "bucket": bucket.index(), "bytes_before": before, "bytes_after": after}
    )

    def done(f: torch.futures.Future) -> torch.Tensor:
        record["hook_s"] = time.perf_counter() - tic
        return f.value()

    return powerSGD_hook(state.psgd, bucket).then(done)


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
