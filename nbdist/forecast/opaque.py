"""A layer the forecast cannot follow under fake tensors (it reads a tensor's values: ``.item()``, ``.numpy()``, a
branch on data; or it calls an operator without a shape rule), run as a box: alone, for real, outside the trackers.

The box's forward runs the layer's own code on real tensors of its inputs' shapes, with real parameters of their
shapes, none of it seen by MemTracker or the timer; then it hands the step fake outputs of the shapes the real run
made (an output that was an input stays that input). Its backward gives each input and parameter a gradient of its
own shape. So the step around the box is counted as before: the box's output, the gradients it passes back, its
parameters' gradients and optimizer state; what the layer holds inside is not, and the forecast says it is partial.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .timing import real_like

LIMIT = 256 << 20  # the most a box may make for real: its parameters and inputs (a layer, not the model)


class TooLarge(Exception):
    """The layer's parameters and inputs are too large to make for real here."""


class Box:
    """The layer ``name`` of ``model`` (its forward replaced) run for real, outside the trackers, when it is called."""

    def __init__(self, model: torch.nn.Module, name: str) -> None:
        self.layer = model.get_submodule(name)
        self.forward = self.layer.forward  # the layer's own code (bound before it is replaced)
        self.seconds = 0.0  # the real forwards' time since the last reset: the step's timer does not see it
        self.layer.forward = self.boxed  # type: ignore[method-assign]

    def boxed(self, *args: Any, **kwargs: Any) -> Any:
        flat, spec = tree_flatten((args, kwargs))
        where = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor)]
        held = [p for _, p in self.layer.named_parameters()]
        made = _Run.apply(self, flat, spec, where, *[flat[i] for i in where], *held)
        out = list(self._out)  # what the real run returned: its tensors' places take the fake outputs
        for j, k in enumerate(self._made):
            out[k] = made[j]
        return tree_unflatten(out, self._spec)

    def real(self, flat: list[Any], spec: Any, where: list[int]) -> tuple[list[Any], list[int | None]]:
        """Run the layer on real tensors of the inputs' shapes: each output tensor's (shape, dtype), and which input
        it is (None: a tensor of its own)."""
        from ..compat.torch_private import outside_trackers

        tensors = dict(self.layer.named_parameters()) | dict(self.layer.named_buffers())
        size = sum(t.numel() * t.element_size() for t in [*tensors.values(), *(flat[i] for i in where)])
        if size > LIMIT:
            raise TooLarge(
                f"its parameters and inputs hold {size / 2**20:.1f} MiB, more than the {LIMIT >> 20} MiB a layer may "
                "make for real here"
            )
        with outside_trackers(self.layer, {}):
            real_in = [real_like(a) if i in where else a for i, a in enumerate(flat)]
            real_t = {k: real_like(t) for k, t in tensors.items()}
        with outside_trackers(self.layer, real_t), torch.no_grad():
            args, kwargs = tree_unflatten(real_in, spec)
            tic = time.perf_counter()
            got = self.forward(*args, **kwargs)
            self.seconds += time.perf_counter() - tic
        out, self._spec = tree_flatten(got)
        self._made = [k for k, t in enumerate(out) if isinstance(t, torch.Tensor)]
        self._out = [None if k in self._made else t for k, t in enumerate(out)]  # no real tensor is kept
        inputs = {id(real_in[i]): n for n, i in enumerate(where)}
        return [(tuple(out[k].shape), out[k].dtype) for k in self._made], [inputs.get(id(out[k])) for k in self._made]


class _Run(torch.autograd.Function):
    """The box in the step's autograd graph: fake outputs of the real run's shapes; gradients of the inputs' shapes."""

    @staticmethod
    def forward(ctx: Any, box: Box, flat: list[Any], spec: Any, where: list[int], *tensors: Any) -> Any:  # type: ignore[override]
        metas, same = box.real(flat, spec, where)
        ctx.save_for_backward(*tensors)  # as the layer's own backward would keep them (parameters exist anyway)
        inputs = tensors[: len(where)]
        device = tensors[0].device if tensors else None  # where the step's tensors live (--device)
        return tuple(
            inputs[s].view_as(inputs[s]) if s is not None else torch.empty(shape, dtype=dtype, device=device)
            for (shape, dtype), s in zip(metas, same, strict=True)
        )

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        saved = ctx.saved_tensors
        need = ctx.needs_input_grad[4:]
        return (None, None, None, None, *[torch.zeros_like(t) if n else None for t, n in zip(saved, need, strict=True)])
