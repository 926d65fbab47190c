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


def measure_here(source: str, strategy: str, microbatches: int = 4, repeats: int = 5) -> dict[str, Any]:
    """Run the cell on this rank, wrap its model under ``strategy``, and measure a step: the peak MemTracker counts
    and its parts, and the median wall time of ``repeats`` more steps."""
    torch.manual_seed(0)
    ns: dict[str, Any] = {"__name__": "__fit__"}
    exec(compile(source, CELL, "exec"), ns)  # noqa: S102 - the person's own cell
    spec = st.Spec(ns, microbatches=microbatches)
    mesh = st.mesh_of(strategy)
    if strategy == "pp":
        model, step = _pipeline(spec)
    else:
        model = st.wrap(strategy, spec, mesh, fake=False)
        step = st.stepper(strategy, spec, model)
    out = st.measure(model, step)
    walls = []
    for _ in range(repeats):
        dist.barrier()
        tic = time.perf_counter()
        step()
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
