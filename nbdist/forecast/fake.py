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
        # the classes as the cell made them (FSDP2 gives each unit a class of its own: FSDPBlock)
        self.names = {
            id(m): f"layer {name} ({type(m).__name__})" if name else f"the model ({type(m).__name__})"
            for name, m in model.named_modules()
        }
        self.qualified = {id(m): name for name, m in model.named_modules()}
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
        return self.names[id(self.stack[-1])]

    def failing_name(self) -> str | None:
        """The innermost running layer's qualified name ('3.mlp'); '' for the model itself, None for none."""
        return self.qualified[id(self.stack[-1])] if self.stack else None


MAX_BOXES = 8  # layers run as boxes in one forecast before it gives up


def one(
    source: str,
    strategy: str,
    world: int,
    rank: int,
    microbatches: int,
    setup: list[str] | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    """Forecast one rank. A layer that fails under fake tensors is run as a box (nbdist.forecast.opaque) and the
    forecast is tried again, partial; when its real run fails too, that is the model's own error and is said."""
    boxed: dict[str, str] = {}  # layer -> why it runs as a box ('layer 1 (Peek): it reads a tensor's values ...')
    while True:
        out, failed = _attempt(source, strategy, world, rank, microbatches, setup, list(boxed), device)
        if not failed or failed in boxed or len(boxed) >= MAX_BOXES:
            if failed in boxed and "too_large" in out:  # why it was boxed, and why it cannot run alone
                out["error"] = f"{boxed[failed]}; nor can it run alone: {out.pop('too_large')}"
            if boxed and "error" not in out:
                out["partial"] = list(boxed.values())
            return out
        boxed[failed] = out["error"]


def _attempt(
    source: str,
    strategy: str,
    world: int,
    rank: int,
    microbatches: int,
    setup: list[str] | None,
    boxed: list[str],
    device: str,
) -> tuple[dict[str, Any], str | None]:
    """Run the cell, wrap its model, step it twice under fake tensors: MemTracker's counts. Also the layer that
    failed, if one of the model's layers (not the model itself) did."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from . import step as st
    from .opaque import Box, TooLarge
    from .timing import OpTimer

    out: dict[str, Any] = {"strategy": strategy, "world": world, "rank": rank}
    layers: Layers | None = None
    failed: str | None = None
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        mesh = st.mesh_of(strategy, device)
        with FakeTensorMode(allow_non_fake_inputs=True):
            torch.manual_seed(0)
            ns: dict[str, Any] = {"__name__": "__fit__"}
            for i, code in enumerate(setup or []):
                exec(compile(code, f"<setup cell {i + 1}>", "exec"), ns)  # noqa: S102 - the world's own setup cells
            exec(compile(source, CELL, "exec"), ns)  # noqa: S102 - the person's own cell, in a process of its own
            spec = st.Spec(ns, microbatches=microbatches)
            spec.to(device)
            out["params"] = sum(p.numel() * p.element_size() for p in spec.model.parameters())
            out["microbatches"] = spec.microbatches  # the cell may name its own
            boxes = [Box(spec.model, name) for name in boxed]
            layers = Layers(spec.model)
            model = st.wrap(strategy, spec, mesh, fake=True)
            with layers:
                step = st.stepper(strategy, spec, model)
                out.update(st.measure(model, step))
                timer = OpTimer()
                for box in boxes:
                    box.seconds = 0.0
                tic = time.perf_counter()
                with timer:
                    step()
            # a box's forward ran outside the timer, so its wall time is in the overhead; its backward did not run:
            # priced as twice its forward, the usual ratio
            out["overhead_s"] = timer.overhead(time.perf_counter() - tic)
            out["compute_s"] = timer.compute_s + out["overhead_s"] + 2 * sum(b.seconds for b in boxes)
            out["ops"] = timer.ops
            out["collectives"] = timer.collectives + st.unseen_collectives(strategy, spec, step)
    except Exception as exc:  # noqa: BLE001 - each configuration reports its own failure and the rest go on
        from ..errors import ConfigError

        line = _cell_line(exc)
        out["config_error"] = isinstance(exc, ConfigError)
        out["error"] = str(exc) if isinstance(exc, (ConfigError, TooLarge)) else f"{type(exc).__name__}: {exc}".strip()
        out["error"] = out["error"].splitlines()[0] if out["error"] else type(exc).__name__
        if isinstance(exc, TooLarge):
            out["too_large"] = str(exc)
        if type(exc).__name__ in DATA_DEPENDENT:
            out["error"] = (
                "it reads a tensor's values (.item(), .tolist(), a branch on data), which fake tensors do not hold"
            )
        if line is not None:
            out["error"] += f" (cell line {line})"
        where = layers.failing() if layers is not None else ""
        if where and not out["config_error"]:
            out["error"] = f"{where}: {out['error']}"
            failed = layers.failing_name() if layers is not None else None
            if failed == "" and type(exc).__name__ in DATA_DEPENDENT:  # a layer can run alone; the model cannot
                out["error"] += "; move the code that reads them into a layer (a submodule): that layer runs alone"
    finally:
        dist.destroy_process_group()
    return out, failed


def main() -> None:
    request = json.load(sys.stdin)
    if request.get("comm") is None:  # no live world measured it: two gloo processes of this host do
        from .comm import measure_pair

        request["comm"], request["measured_at"] = measure_pair(), 2
    print(json.dumps({"comm": request["comm"], "measured_at": request["measured_at"]}), flush=True)
    for strategy, world in request["configs"]:
        ranks = range(world) if strategy == "pp" else (0,)  # DDP, FSDP and TP ranks hold alike; stages differ
        for rank in ranks:
            got = one(
                request["source"],
                strategy,
                world,
                rank,
                request["microbatches"],
                request.get("setup"),
                request.get("device", "cpu"),
            )
            print(json.dumps(got), flush=True)
