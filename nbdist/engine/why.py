"""What %dist_why times on a rank while a training cell runs: each step's phases (the verdict: nbdist/stragglers.py).

``begin()`` installs torch's global hooks; the cell runs unchanged; ``end()`` takes them out. A step ends at each
``Optimizer.step``; its row (``nbdist.log``, keys ``why/...``, no step number of its own, so the cell's own
logging keeps its x axis) holds, in seconds:

- ``step_s``: from the end of the last step to the end of this one;
- ``data_s``: from the end of the last step to the step's first training forward (the loader, host-to-device
  copies, anything the loop does before the model), less the pauses, saves and evaluations counted below;
- ``forward_s`` and ``backward_s``: the outermost module's training forwards, and the ``backward()`` calls
  (which include the wait for DDP's all-reduce to finish: ``exposed_s``);
- ``exposed_s`` / ``backward_compute_s``: from DDP's own timers when the model is a DDP model: the part of
  backward spent waiting for the all-reduce after the gradients were computed, and the computation (on a CPU,
  only in the rows of the steps DDP's timers are read in: ``DDP_ALL``, ``DDP_EVERY``);
- ``hook_s``: time inside a DDP communication hook registered while recording (its Python, on this rank);
- ``collective_s``: FSDP2's waits for its all-gathers and reduce-scatters on this rank (inside the forward and
  backward above; with DDP, ``exposed_s`` says the same);
- ``optimizer_s``: inside ``Optimizer.step``;
- ``gc_s``: garbage collection (``gc.callbacks``); ``save_s``: ``torch.save``; ``eval_s``: forwards without
  gradients or in eval mode (an evaluation inside the loop);
- ``other_s``: the rest of the step (host work between backward and the optimizer: logging, I/O, sleeps).

On a GPU (the training model's parameters on CUDA) the host only queues the work, so ``forward_s``, ``backward_s``,
``optimizer_s`` and ``eval_s`` are the device's times, from CUDA events recorded on the current stream around
them, and DDP's own CUDA timers split backward (``why/cuda`` marks such rows). The GPU may still run a step when
its ``Optimizer.step`` returns, so its row is logged at the next step's end (a loop's last step has no row there).
"""

from __future__ import annotations

import functools
import gc
import time
from typing import Any

from .. import compat
from . import metrics

PHASES = ("data", "forward", "backward", "optimizer", "gc", "save", "eval", "hook", "collective")
ON_DEVICE = ("forward", "backward", "optimizer", "eval")  # timed by CUDA events when the model is on a GPU
# Steps with torch's global module hooks, which find the modules a loop calls at the top (its model, its loss, an
# evaluation's model): they make every submodule's call take torch's slow path (+30 us a forward of a 7-module
# model), so after these steps only the modules found are hooked. One first called at the top later (an evaluation
# every 100 steps with a model of its own) is not timed apart: its time is the host's ('other') or input's.
FIND_STEPS = 2
# DDP's timers are read (25-45 us a step: most of the timer's cost on a CPU) on the first DDP_ALL steps, then on
# every DDP_EVERY-th; the verdict takes compute and communication from those rows (stragglers._typical). On a GPU
# they are read every step (where DDP's forward reads them anyway, and steps are long).
DDP_ALL = 8
DDP_EVERY = 4


class _Hook:
    """A module hook that calls the timer while it runs; a copy of the module (``copy.deepcopy``, an EMA model)
    shares it, and pickling the module (``torch.save(model)``) saves a hook that does nothing."""

    def __init__(self, call: Any) -> None:
        self.call = call

    def __call__(self, *args: Any) -> None:
        if self.call is not None:
            self.call(*args)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Hook:
        return self

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_Hook, (None,))


class Timer:
    def __init__(self) -> None:
        import torch
        from torch.nn.parallel import DistributedDataParallel
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self.sums = dict.fromkeys(PHASES, 0.0)
        self.last_end = time.perf_counter()
        self.first_forward: float | None = None
        self.depth = 0
        self.forward_at: float | None = None
        self.training_forward = False
        self.opt_at = 0.0
        self.gc_at: float | None = None
        self.ddp: list[Any] = []  # DDP models seen: their C++ timers give the exposed all-reduce
        self.steps = 0
        self.cuda: Any = None  # torch.cuda once a training forward ran on a GPU model; False on the CPU
        self.spans: list[tuple[str, Any, Any]] = []  # (phase, start event, end event) of this step on the GPU
        self.started: dict[str, Any] = {}
        self.pending: tuple[dict[str, float], list[tuple[str, Any, Any]]] | None = None  # the last step, on a GPU
        nn = torch.nn.modules.module
        self.outer: list[Any] = []  # the modules called at the top while the global hooks find them
        self.finding = [
            nn.register_module_forward_pre_hook(self._pre),
            nn.register_module_forward_hook(self._post, always_call=True),
        ]
        self.hooks: list[_Hook] = []
        self.handles = [
            register_optimizer_step_pre_hook(self._step_pre),
            register_optimizer_step_post_hook(self._step_post),
        ]
        gc.callbacks.append(self._gc)
        self.saved: dict[tuple[Any, str], Any] = {}
        self._wrap(torch.Tensor, "backward", "backward")
        self._wrap(torch, "save", "save")
        for owner, name in compat.fsdp_waits():
            self._wrap(owner, name, "collective")
        timer = self
        register = DistributedDataParallel.register_comm_hook
        self.saved[(DistributedDataParallel, "register_comm_hook")] = register

        def register_comm_hook(model: Any, state: Any, hook: Any) -> Any:
            @functools.wraps(hook)  # DDP checks the hook's own signature
            def timed(state: Any, bucket: Any) -> Any:
                tic = time.perf_counter()
                try:
                    return hook(state, bucket)
                finally:
                    timer.sums["hook"] += time.perf_counter() - tic

            return register(model, state, timed)

        DistributedDataParallel.register_comm_hook = register_comm_hook  # type: ignore[method-assign,assignment]

    def _wrap(self, owner: Any, name: str, phase: str) -> None:
        original = getattr(owner, name)
        self.saved[(owner, name)] = original
        sums = self.sums
        timer = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            tic = time.perf_counter()
            if phase in ON_DEVICE:
                timer._begin(phase)
            try:
                return original(*args, **kwargs)
            finally:
                sums[phase] += time.perf_counter() - tic
                if phase in ON_DEVICE:
                    timer._end(phase)

        setattr(owner, name, timed)

    def _begin(self, phase: str) -> None:
        if self.cuda:
            self.started[phase] = self.cuda.Event(enable_timing=True)
            self.started[phase].record()

    def _end(self, phase: str) -> None:
        start = self.started.pop(phase, None)
        if self.cuda and start is not None:
            end = self.cuda.Event(enable_timing=True)
            end.record()
            self.spans.append((phase, start, end))

    def _gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self.gc_at = time.perf_counter()
        elif self.gc_at is not None:
            self.sums["gc"] += time.perf_counter() - self.gc_at
            self.gc_at = None

    def _pre(self, module: Any, args: Any) -> None:
        import torch

        if self.depth == 0:
            if self.finding and all(m is not module for m in self.outer):
                self.outer.append(module)
            self.forward_at = time.perf_counter()
            self.training_forward = module.training and torch.is_grad_enabled()
            if self.training_forward and self.first_forward is None:
                self.first_forward = self.forward_at
            if self.training_forward and self.cuda is None:
                self.cuda = _cuda_of(module)
            self._begin("forward" if self.training_forward else "eval")
            if self.training_forward and _is_ddp(module) and all(m is not module for m in self.ddp):
                compat.ddp_time_every_step(module)
                self.ddp.append(module)
            if self.training_forward and self.pending is not None and "why/exposed_s" not in self.pending[0]:
                self.pending[0].update(self._ddp_split())  # the last step's, before DDP's forward resets them
        self.depth += 1

    def _post(self, module: Any, args: Any, output: Any) -> None:
        self.depth = max(0, self.depth - 1)
        if self.depth == 0 and self.forward_at is not None:
            phase = "forward" if self.training_forward else "eval"
            self.sums[phase] += time.perf_counter() - self.forward_at
            self._end(phase)
            self.forward_at = None

    def _step_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.opt_at = time.perf_counter()
        self._begin("optimizer")

    def _step_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._end("optimizer")
        now = time.perf_counter()
        self.sums["optimizer"] += now - self.opt_at
        first = self.first_forward if self.first_forward is not None else now
        s = self.sums
        # what happened before the first forward is data, less the pauses, saves and evaluations in it
        row = {f"why/{p}_s": s[p] for p in PHASES if p != "data" and (p != "collective" or s[p])}
        row["why/data_s"] = max(0.0, first - self.last_end - s["gc"] - s["save"] - s["eval"])
        row["why/step_s"] = now - self.last_end
        if self.cuda:
            # the GPU may still run this step: its row is completed, and logged, at the next step's end (waiting
            # then for this step's events, done by then unless the host is a step ahead); its DDP timers are read
            # at the next step's first forward, where DDP itself reads them
            self._complete()
            self.pending, self.spans = (row, self.spans), []
        else:
            if self.steps < DDP_ALL or self.steps % DDP_EVERY == 0:
                row.update(self._ddp_split())
            _log(row)
        self.steps += 1
        if self.finding and self.steps >= FIND_STEPS and self.depth == 0:
            self._hook_found()
        self.sums.update(dict.fromkeys(PHASES, 0.0))  # in place: the wrapped functions hold this dict
        self.first_forward = None
        self.last_end = time.perf_counter()

    def _hook_found(self) -> None:
        """From now on only the modules found at the top are hooked (torch's fast path for every other module)."""
        for handle in self.finding:
            handle.remove()
        self.finding = []
        self.hooks = [_Hook(self._pre), _Hook(self._post)]
        for module in self.outer:
            self.handles.append(module.register_forward_pre_hook(self.hooks[0]))
            self.handles.append(module.register_forward_hook(self.hooks[1], always_call=True))

    def _complete(self) -> None:
        """Log the last step's row with the seconds the GPU spent in each of its phases."""
        if self.pending is None:
            return
        row, spans = self.pending
        self.pending = None
        if spans:
            spans[-1][2].synchronize()  # the last event recorded: the others are done too (one stream)
        row.update({f"why/{p}_s": 0.0 for p in ON_DEVICE})
        for phase, start, end in spans:
            row[f"why/{phase}_s"] += start.elapsed_time(end) / 1e3
        row["why/cuda"] = 1.0
        _log(row)

    def _ddp_split(self) -> dict[str, float]:
        if len(self.ddp) != 1:
            return {}
        try:
            ints = compat.ddp_timers(self.ddp[0].logger)
        except Exception:  # timers not there (no backward yet)
            return {}
        if self.cuda:  # DDP's CUDA timers: differences of events (its host timestamps are when work was queued)
            compute, comm = ints.get("backward_compute_time"), ints.get("backward_comm_time")
            overlap = ints.get("backward_compute_comm_overlap_time")
            if not (compute and comm and overlap is not None):
                return {}
            return {"why/backward_compute_s": compute / 1e9, "why/exposed_s": max(0, comm - overlap) / 1e9}
        start, end = ints.get("backward_compute_time_start"), ints.get("backward_compute_time_end")
        comm_end = ints.get("backward_comm_time_end")
        if not (start and end and comm_end):
            return {}
        return {"why/backward_compute_s": (end - start) / 1e9, "why/exposed_s": max(0, comm_end - end) / 1e9}

    def close(self) -> int:
        for handle in self.finding + self.handles:
            handle.remove()
        for hook in self.hooks:  # a copy of a module made meanwhile still has them
            hook.call = None
        if self._gc in gc.callbacks:
            gc.callbacks.remove(self._gc)
        for (owner, name), original in self.saved.items():
            setattr(owner, name, original)
        return self.steps


def _log(row: dict[str, float]) -> None:
    # the step itself; the collectives' waits and DDP's split are inside forward and backward
    skip = ("why/step_s", "why/collective_s", "why/cuda", "why/backward_compute_s", "why/exposed_s")
    row["why/other_s"] = max(0.0, row["why/step_s"] - sum(v for k, v in row.items() if k not in skip))
    metrics.record(row)


def _cuda_of(module: Any) -> Any:
    """torch.cuda when the module's parameters are on a GPU (its phases are then timed there), else False."""
    import torch

    param = next(module.parameters(), None)
    return torch.cuda if param is not None and param.is_cuda else False


def _is_ddp(module: Any) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(module, DistributedDataParallel)


_ACTIVE: list[Timer] = []


def begin() -> None:
    """Time the steps of the next cell on this rank."""
    end()
    _ACTIVE.append(Timer())


def end() -> int:
    """Stop timing; the steps timed (0 when nothing was)."""
    steps = 0
    while _ACTIVE:
        steps = _ACTIVE.pop().close()
    return steps
