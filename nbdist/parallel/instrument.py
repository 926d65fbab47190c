# No `from __future__ import annotations`: DDP checks a comm hook's annotations as objects.
"""Automatic step metrics for DDP and FSDP models: step time, time in collectives, bytes, samples/s.

``apply_ddp(model, metrics=True)`` adds a forward pre-hook that closes the previous
step and logs it with ``nbdist.log``:

- ``time/step_s``: forward-to-forward time of one step;
- ``comm/time_s``: time in collectives: from the first gradient bucket handed to the
  all-reduce until the last one finished (with a compression hook: the span of its
  collectives, plus the time spent compressing and decompressing);
- ``comm/exposed_s``: the part of it training waited for, after backward's computation
  ended; the rest overlapped backward. On a machine with cores to spare that overlap is
  nearly free; where ranks share cores (2 ranks on 2 cores) the collective's copies and
  sums slow the overlapped backward about as much;
- ``comm/overhead(%)`` = comm/time_s / time/step_s (the dashboard's number);
- ``comm/bytes``: bytes handed to the collectives in the step;
- ``throughput/samples_per_s``: this rank's batch / step time;
- ``time/data_s``: the part of the step spent waiting for the next batch, when it comes
  from ``shard()``'s loader (which times its ``next``); absent for other loaders. The
  dashboard splits each step into compute, exposed communication and this.

Where the times come from: on CPU, DDP's own C++ timers (the reducer records when the
first bucket became ready, when backward's computation ended and when the last bucket's
reduction finished; its runtime-stats sample rate is set to every step), so the
all-reduce stays torch's built-in C++ one and the metrics add no Python to the backward
pass. On a GPU those timers are CUDA events that would synchronise the stream every
step, so there ``timing_hook`` (torch's all-reduce, timed at launch and completion)
is registered instead.

``apply_fsdp(model, metrics=True)`` times FSDP2's own collectives instead: each sharded
module's all-gather and reduce-scatter go through ``TimedAllGather`` / ``TimedReduceScatter``
(FSDP's ``set_custom_all_gather`` / ``set_custom_reduce_scatter``), and ``comm/time_s``
is the sum of their durations, ``comm/bytes`` what this rank handed to them.

With a compression hook (``apply_ddp(model, compression=...)``) the meter reads the
hook's records: ``comm/bytes`` is then what the compressed collectives carried,
``comm/bytes_raw`` the gradient bytes before, ``comm/ratio`` their ratio, and
``comm/compress_s`` / ``comm/decompress_s`` the time spent compressing and
decompressing.
"""

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .. import compat


@dataclass
class LoaderNews:
    """What shard()'s loader told the steps: ``wait_s``, the seconds it waited for batches since the last step
    closed; ``batch``, its count of the batch it handed out last, until a forward takes it (over the loader's life:
    a cell run again after a recovery, or on a grown world, goes on counting)."""

    wait_s: float | None = None
    batch: int | None = None


_DATA = LoaderNews()


def data_waited(seconds: float, batch: int | None = None) -> None:
    """shard()'s loader spent ``seconds`` fetching a batch (closed into the step's ``time/data_s``); ``batch``: its
    count of that batch, which a step that trains on it logs as its step (the dashboard's x axis)."""
    _DATA.wait_s = (_DATA.wait_s or 0.0) + seconds
    _DATA.batch = batch


def _take_data_wait() -> float | None:
    waited = _DATA.wait_s
    if waited is not None:
        _DATA.wait_s = 0.0
    return waited


class StepMeter:
    """Closes each training step at the next forward and logs its metrics with ``nbdist.log``.

    A step opens at a training forward (``on_forward``, registered as the model's forward
    pre-hook) and closes at the next forward of any kind: ``time/step_s`` is forward to
    forward. Time in collectives comes from one of three sources, set by ``instrument``
    / ``instrument_fsdp``: DDP's C++ timers (``ddp_logger``, CPU), ``timing_hook``'s
    launch and completion times (GPU), or FSDP's timed collectives (``fsdp``, ``comm_s``);
    a compression hook's records (``hook_state``) replace bytes and times when present.
    It pickles without its process group and DDP logger.
    """

    __slots__ = (
        "step",
        "start",
        "batch",
        "bytes",
        "first_launch",
        "last_launch",
        "done",
        "process_group",
        "hook_state",
        "seen",
        "open",
        "fsdp",
        "comm_s",
        "ddp_logger",
        "grad_bytes",
        "start_ns",
    )

    def __init__(self, process_group: Any = None, hook_state: Any = None, fsdp: bool = False) -> None:
        self.process_group = process_group
        self.fsdp = fsdp  # FSDP's collectives add their durations to comm_s
        self.comm_s = 0.0
        self.hook_state = hook_state  # a compression hook's state, whose records say what was sent
        self.seen = 0  # how many of its records were already logged
        self.open = False  # a training step started and was not logged yet
        self.step = -1
        self.start = 0.0
        self.batch = 0
        self.bytes = 0
        self.first_launch = 0.0
        self.last_launch = 0.0
        self.done = 0.0
        self.ddp_logger: Any = None  # DDP's C++ logger, whose reducer times the collectives (CPU)
        self.grad_bytes = 0  # what the built-in all-reduce carries per step: every gradient
        self.start_ns = 0  # the step's start on the wall clock DDP's timers use

    def __getstate__(self) -> dict[str, Any]:
        return {k: (None if k in ("process_group", "ddp_logger") else getattr(self, k)) for k in self.__slots__}

    def _ddp_timers(self) -> dict[str, float]:
        """The closing step's collectives as DDP's reducer timed them (nanoseconds, wall clock)."""
        ints = compat.ddp_timers(self.ddp_logger)
        if ints.get("backward_comm_time_start", 0) < self.start_ns:  # no reduction this step (no_sync)
            return {"comm/time_s": 0.0, "comm/exposed_s": 0.0, "comm/bytes": 0}
        exposed = ints["backward_comm_time_end"] - ints["backward_compute_time_end"]
        return {
            "comm/time_s": ints["backward_comm_time"] / 1e9,
            "comm/exposed_s": max(0, exposed) / 1e9,
            "comm/bytes": self.grad_bytes,
        }

    def _compressed(self) -> dict[str, float]:
        """The compression hook's records since the last step, summed."""
        state = self.hook_state
        records = getattr(state, "records", None)
        if records is None:
            return {}
        dropped = getattr(state, "dropped", 0)
        new = records[max(0, self.seen - dropped) :]
        self.seen = dropped + len(records)
        if not new:
            return {}
        sent = sum(r.get("bytes_after", 0) for r in new)
        raw = sum(r.get("bytes_before", 0) for r in new)
        compress = sum(r.get("compress_s", 0.0) for r in new)
        decompress = sum(r.get("decompress_s", 0.0) for r in new)
        row = {"comm/bytes": sent, "comm/bytes_raw": raw, "comm/ratio": raw / sent if sent else 1.0}
        spans = [(r["launch"], r["launch"] + r.get("collective_s", 0.0)) for r in new if "launch" in r]
        if spans:  # hooks that time their phases (PowerSGD's records do not: DDP's timers stand)
            collectives = max(e for _, e in spans) - min(b for b, _ in spans)
            last = max(spans)[1] - max(spans)[0]  # the last bucket launched
            row.update(
                {
                    "comm/compress_s": compress,
                    "comm/decompress_s": decompress,
                    "comm/time_s": compress + collectives + decompress,
                    "comm/exposed_s": last + decompress,
                }
            )
        return row

    def __setstate__(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            setattr(self, k, v)

    def on_forward(self, module: Any, args: tuple) -> None:
        now = time.perf_counter()
        if self.open:  # the forward after a training step closes it (an evaluation forward too)
            self.open = False
            step_s = now - self.start
            row: dict[str, float] = {
                "time/step_s": step_s,
                "comm/time_s": max(0.0, self.done - self.first_launch) if self.done else 0.0,
                "comm/exposed_s": max(0.0, self.done - self.last_launch) if self.done else 0.0,
                "comm/bytes": self.bytes,
                "throughput/samples_per_s": self.batch / step_s if step_s > 0 else 0.0,
            }
            if self.ddp_logger is not None:
                row.update(self._ddp_timers())
            if self.hook_state is not None:
                row.update(self._compressed())
            if self.fsdp:  # collectives in forward too: their durations, summed
                row["comm/time_s"] = self.comm_s
                del row["comm/exposed_s"]
            row["comm/overhead(%)"] = 100.0 * row["comm/time_s"] / step_s if step_s > 0 else 0.0
            waited = _take_data_wait()
            if waited is not None:
                row["time/data_s"] = waited
            from ..engine.metrics import log

            log(step=self.step, **row)
        batch, _DATA.batch = _DATA.batch, None  # a shard loader's batch, taken by the first forward on it
        if not module.training:
            return
        first = args[0] if args else None
        self.batch = int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() > 0 else 0
        self.step = int(batch) if batch is not None else self.step + 1
        self.open = True
        self.start = now
        self.start_ns = time.time_ns()
        self.bytes = 0
        self.first_launch = 0.0
        self.last_launch = 0.0
        self.done = 0.0
        self.comm_s = 0.0
        _take_data_wait()  # what was fetched before this step belongs to no step


def timing_hook(state: StepMeter, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's allreduce_hook (divide, then all-reduce), with launch and completion times recorded."""
    group = state.process_group
    if not state.first_launch:
        state.first_launch = time.perf_counter()  # averaging the bucket is part of the all-reduce's cost
    buf = bucket.buffer().div_(dist.get_world_size(group))
    state.bytes += buf.numel() * buf.element_size()
    if bucket.is_last():
        state.last_launch = time.perf_counter()
    fut = dist.all_reduce(buf, group=group, async_op=True).get_future()

    def done(f: torch.futures.Future) -> torch.Tensor:
        state.done = max(state.done, time.perf_counter())
        return f.value()[0]

    return fut.then(done)


def instrument(model: Any, hook_registered: bool, hook_state: Any = None) -> StepMeter:
    """Attach a StepMeter to a DDP model. On CPU, DDP's own timers time the collectives
    (whatever hook runs them); on a GPU the timing hook does, if no other hook is set.
    A compression hook's state, if given, supplies bytes and times instead."""
    meter = StepMeter(hook_state=hook_state)
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    if on_cpu:
        meter.ddp_logger = compat.ddp_time_every_step(model)  # DDP's reducer times every step, in C++
        if not hook_registered:  # torch's built-in all-reduce carries every gradient
            meter.grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    elif not hook_registered:
        model.register_comm_hook(meter, timing_hook)
    model.register_forward_pre_hook(meter.on_forward)
    model.step_meter = meter
    return meter


# ------------------------------------------------------------------ FSDP


class _Timed:
    """Adds each collective's duration and input bytes to a StepMeter."""

    def __init__(self, meter: StepMeter) -> None:
        self.meter = meter

    def _track(self, work: Any, started: float, nbytes: int) -> Any:
        meter = self.meter
        meter.bytes += nbytes
        if not meter.first_launch:
            meter.first_launch = started
        if work is None:  # ran synchronously
            meter.comm_s += time.perf_counter() - started
            return work

        def finished(f: torch.futures.Future) -> None:
            meter.comm_s += time.perf_counter() - started

        work.get_future().then(finished)
        return work


def _fsdp_comm_classes() -> tuple[type, type]:
    DefaultAllGather, DefaultReduceScatter = compat.fsdp_collective_classes()

    class TimedAllGather(_Timed, DefaultAllGather):  # type: ignore[valid-type,misc]
        def __call__(self, output_tensor: Any, input_tensor: Any, group: Any, async_op: bool = False) -> Any:
            started = time.perf_counter()
            work = DefaultAllGather.__call__(self, output_tensor, input_tensor, group, async_op)
            return self._track(work, started, input_tensor.numel() * input_tensor.element_size())

    class TimedReduceScatter(_Timed, DefaultReduceScatter):  # type: ignore[valid-type,misc]
        def __call__(self, output_tensor: Any, input_tensor: Any, group: Any, op: Any, async_op: bool = False) -> Any:
            started = time.perf_counter()
            work = DefaultReduceScatter.__call__(self, output_tensor, input_tensor, group, op, async_op)
            return self._track(work, started, input_tensor.numel() * input_tensor.element_size())

    return TimedAllGather, TimedReduceScatter


def instrument_fsdp(model: Any) -> StepMeter:
    """Attach a StepMeter to an FSDP2 model: every sharded module's collectives are timed."""
    from torch.distributed.fsdp import FSDPModule

    gather_cls, scatter_cls = _fsdp_comm_classes()
    meter = StepMeter(fsdp=True)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(gather_cls(meter))
            module.set_custom_reduce_scatter(scatter_cls(meter))
    model.register_forward_pre_hook(meter.on_forward)
    model.step_meter = meter
    return meter
