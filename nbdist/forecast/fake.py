"""The forecast's own process: a person's cell run under fake tensors and a fake process group, once per strategy,
world size and (for a pipeline) stage. Nothing the size of the model is allocated, and the notebook's kernel and
world are never touched: a model that would not fit, or a cell that fails, fails here.

Read a request (JSON) on stdin; write one JSON line per forecast rank on stdout.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from typing import Any

CELL = "<%%dist_fit cell>"
DATA_DEPENDENT = ("DataDependentOutputException", "DynamicOutputShapeException", "GuardOnDataDependentSymNode")


def _cell_line(exc: BaseException) -> int | None:
    lines = [f.lineno for f in traceback.extract_tb(exc.__traceback__) if f.filename == CELL]
    return lines[-1] if lines else None


class Layers:
    """Which of the model's layers is running (the innermost), so that an error under fake tensors names it: a layer
    whose code reads a tensor's values (``.item()``, ``.numpy()``, an operator without a shape rule) cannot be
    forecast, and the person needs to know which."""

    def __init__(self, model: Any) -> None:
        self.names = {id(m): f"layer {name}" if name else "the model" for name, m in model.named_modules()}
        self.stack: list[Any] = []
        self._handles: list[Any] = []

    def __enter__(self) -> Layers:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        def enter(module: Any, args: Any) -> None:
            if id(module) in self.names:
                self.stack.append(module)

        def leave(module: Any, args: Any, output: Any) -> None:  # returns None: the output stays the module's
            if self.stack and self.stack[-1] is module:
                self.stack.pop()

        self._handles = [register_module_forward_pre_hook(enter), register_module_forward_hook(leave)]
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()

    def failing(self) -> str:
        """'layer 3.mlp.0 (Linear)', 'the model (Net)', or '' when no layer of the model was running."""
        if not self.stack:
            return ""
        m = self.stack[-1]
        return f"{self.names[id(m)]} ({type(m).__name__})"


def one(
    source: str, strategy: str, world: int, rank: int, microbatches: int, setup: list[str] | None = None
) -> dict[str, Any]:
    """Forecast one rank: run the cell, wrap its model, step it twice under fake tensors; MemTracker's counts."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from . import step as st
    from .timing import OpTimer

    out: dict[str, Any] = {"strategy": strategy, "world": world, "rank": rank}
    layers: Layers | None = None
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        mesh = st.mesh_of(strategy)
        with FakeTensorMode(allow_non_fake_inputs=True):
            torch.manual_seed(0)
            ns: dict[str, Any] = {"__name__": "__fit__"}
            for i, code in enumerate(setup or []):
                exec(compile(code, f"<setup cell {i + 1}>", "exec"), ns)  # noqa: S102 - the world's own setup cells
            exec(compile(source, CELL, "exec"), ns)  # noqa: S102 - the person's own cell, in a process of its own
            spec = st.Spec(ns, microbatches=microbatches)
            out["params"] = sum(p.numel() * p.element_size() for p in spec.model.parameters())
            out["microbatches"] = spec.microbatches  # the cell may name its own
            model = st.wrap(strategy, spec, mesh, fake=True)
            with Layers(spec.model) as layers:
                step = st.stepper(strategy, spec, model)
                out.update(st.measure(model, step))
                timer = OpTimer()
                tic = time.perf_counter()
                with timer:
                    step()
            out["overhead_s"] = timer.overhead(time.perf_counter() - tic)
            out["compute_s"], out["ops"] = timer.compute_s + out["overhead_s"], timer.ops
            out["collectives"] = timer.collectives + st.unseen_collectives(strategy, spec, step)
    except Exception as exc:  # noqa: BLE001 - each configuration reports its own failure and the rest go on
        from ..errors import ConfigError

        line = _cell_line(exc)
        out["config_error"] = isinstance(exc, ConfigError)
        out["error"] = str(exc) if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}".strip()
        out["error"] = out["error"].splitlines()[0] if out["error"] else type(exc).__name__
        if type(exc).__name__ in DATA_DEPENDENT:
            out["error"] = (
                "it reads a tensor's values (.item(), .tolist(), a branch on data), which fake tensors do not hold"
            )
        if line is not None:
            out["error"] += f" (cell line {line})"
        where = layers.failing() if layers is not None else ""
        if where and not out["config_error"]:
            out["error"] = f"{where}: {out['error']}"
    finally:
        dist.destroy_process_group()
    return out


def main() -> None:
    request = json.load(sys.stdin)
    if request.get("comm") is None:  # no live world measured it: two gloo processes of this host do
        from .comm import measure_pair

        request["comm"], request["measured_at"] = measure_pair(), 2
    print(json.dumps({"comm": request["comm"], "measured_at": request["measured_at"]}), flush=True)
    for strategy, world in request["configs"]:
        ranks = range(world) if strategy == "pp" else (0,)  # DDP, FSDP and TP ranks hold alike; stages differ
        for rank in ranks:
            got = one(request["source"], strategy, world, rank, request["microbatches"], request.get("setup"))
            print(json.dumps(got), flush=True)
