"""What a forecast is checked against: the same cell and strategy on a rank of a real world (gloo), measured by the
same counter (MemTracker in real mode), and the step's wall time. A pipeline runs torch's own GPipe schedule
(``nbdist.parallel.pipeline``), not the forecast's imitation of it."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from . import step as st
from .fake import CELL


def measure_here(
    source: str, strategy: str, microbatches: int = 4, repeats: int = 5, device: str = "cpu", fake_group: bool = False
) -> dict[str, Any]:
    """Run the cell on this rank, wrap its model under ``strategy`` with its tensors on ``device``, and measure a
    step: the peak MemTracker counts and its parts, the device's reserved peak (CUDA), and the median wall time of
    ``repeats`` more steps. ``fake_group``: this rank alone, under a fake process group (torchtitan's real mode; DDP
    then wrapped as the forecast wraps it, since a fake group's broadcasts carry nothing)."""
    torch.manual_seed(0)
    ns: dict[str, Any] = {"__name__": "__fit__"}
    exec(compile(source, CELL, "exec"), ns)  # noqa: S102 - the person's own cell
    spec = st.Spec(ns, microbatches=microbatches)
    spec.to(device)
    mesh = st.mesh_of(strategy, device)
    if strategy == "pp":
        model, step = _pipeline(spec)
    else:
        model = st.wrap(strategy, spec, mesh, fake=fake_group)
        step = st.stepper(strategy, spec, model)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    out = st.measure(model, step)
    if cuda:
        out["reserved_peak"] = torch.cuda.max_memory_reserved(device)  # the allocator's, from before the first step
    walls = []
    for _ in range(repeats):
        if not fake_group:
            dist.barrier()
        tic = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize(device)
        walls.append(time.perf_counter() - tic)
    out["step_s"] = statistics.median(walls)
    return out


def _pipeline(spec: st.Spec) -> tuple[torch.nn.Module, Any]:
    from ..parallel.pipeline import make_schedule, pipeline_step

    x, target = spec.split()
    if target is None:
        target = torch.zeros(())
        loss = lambda out, _t: spec.loss(out, None)  # noqa: E731
    else:
        loss = spec.loss
    sched, part = make_schedule(spec.model, spec.microbatches, loss, "gpipe")  # type: ignore[arg-type]
    opt = spec.optimizer(part.parameters())

    def step() -> None:
        pipeline_step(sched, x, target.expand(x.shape[0]) if target.dim() == 0 else target)
        opt.step()
        opt.zero_grad()

    step.optimizer = opt  # type: ignore[attr-defined]
    return part, step
