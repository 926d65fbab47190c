"""What one rank's step computes and sends, from a step under fake tensors: each operator run once for real on
inputs of its shapes (one operator's tensors at a time, never the model's), and each collective's bytes.

The compute time is the sum of the operators' times on one thread (OMP_NUM_THREADS=1, as every rank runs; each the
median of three runs, the core's cache written over before each: the step meets its operators' inputs cold), plus what
the step spends around its operators in Python (modules, autograd, DTensor's sharding rules, FSDP's hooks): the fake
step's wall time less the time spent in this timer (fake shapes and the timing itself). The collectives are timed later, against
what the live world measures (nbdist.forecast.comm).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

# collectives by the name of their operator: (kind, which argument's bytes count)
_COLLECTIVES = {
    "allreduce_": "all_reduce",
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "broadcast_": "broadcast",
    "send": "send",
    "recv_": "send",
    "all_to_all_single": "all_to_all",
}
_SKIP = {"wait_tensor", "_local_scalar_dense", "barrier", "monitored_barrier_"}
FLUSH = 4 << 20  # bytes written before each timed run: a real step meets an operator's inputs out of the core's cache
BUDGET = 64 << 20  # an operator whose tensors hold more is priced by this machine's rates, not made and run


def real_like(t: Any) -> Any:
    """A real tensor of ``t``'s shape, dtype and device: floats within [0.5, 1.5) (no NaN from sqrt or log, no inf
    from a division), integers zero."""
    if not isinstance(t, torch.Tensor):
        return t
    if t.is_floating_point() or t.is_complex():
        return torch.rand(t.shape, dtype=t.dtype, device=t.device) + 0.5
    return torch.zeros(t.shape, dtype=t.dtype, device=t.device)


def _bytes(args: Any) -> int:
    return max((t.numel() * t.element_size() for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)), default=0)


class OpTimer(TorchDispatchMode):
    """Under FakeTensorMode: time each operator on real tensors of its inputs' shapes (the same shapes once), and
    list the collectives with their largest tensor's bytes. Operators on wrapper tensors (DTensor, FSDP's
    parameters) are passed on: what they run underneath comes back here with plain tensors and is timed then."""

    def __init__(self) -> None:
        super().__init__()
        self.compute_s = 0.0  # the operators' time on real tensors
        self.handled_s = 0.0  # time in this mode's handler: fake shape propagation and the timing (not in a real step)
        self.calls = 0  # the handler's calls: each costs a way into Python and back that a real step does not take
        self.ops = 0
        self.collectives: list[tuple[str, int, int]] = []  # (kind, bytes, the ranks of its group)
        self._seen: dict[tuple[Any, ...], float] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        tic = time.perf_counter()
        self.calls += 1
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        try:
            if name in _COLLECTIVES:
                self.collectives.append((_COLLECTIVES[name], _bytes((args, kwargs)), _group_size((args, kwargs))))
            elif not all(_plain(t) for t in tree_flatten((args, kwargs))[0]):
                return NotImplemented  # the wrapper's own dispatch runs, and what it runs comes back here
            out = func(*args, **kwargs)
            if name not in _SKIP:
                self.compute_s += self._time(func, args, kwargs, out)
            return out
        finally:
            self.handled_s += time.perf_counter() - tic

    def overhead(self, wall: float) -> float:
        """The step's time outside its operators, from the wall time of the step this timer watched."""
        return max(0.0, wall - self.handled_s - self.calls * entry_cost())

    def _time(self, func: Any, args: Any, kwargs: Any, out: Any) -> float:
        flat = tree_flatten((args, kwargs))[0]
        key = (func, *((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else repr(t)[:64] for t in flat))
        if key in self._seen:
            pass
        elif _bytes_all((args, kwargs, out)) > BUDGET:  # too large to make for real: this machine's rates
            self._seen[key] = _roofline(func, args, kwargs, out)
        else:
            from ..compat.torch_private import real_tensors

            with real_tensors():
                try:
                    r_args, r_kwargs = tree_map(real_like, (args, kwargs))
                    func(*r_args, **r_kwargs)  # warm
                    gpu = next((t.device for t in tree_flatten(r_args)[0] if _on_gpu(t)), None)
                    cold = _bytes_all((r_args, r_kwargs)) > FLUSH >> 6  # a small operator's inputs: cache-sized
                    flush = torch.empty(FLUSH >> 2 if cold else 0)
                    walls = []
                    for _ in range(3):
                        flush.fill_(1.0)
                        _sync(gpu)
                        tic = time.perf_counter()
                        func(*r_args, **r_kwargs)
                        _sync(gpu)  # a GPU's operator has only been queued when it returns
                        walls.append(time.perf_counter() - tic)
                    best = sorted(walls)[1]
                except Exception:  # noqa: BLE001 - an operator random inputs do not suit (an index out of range)
                    best = 0.0
            self._seen[key] = best
        self.ops += 1
        return self._seen[key]


def _group_size(args: Any) -> int:
    """The ranks of a collective's group, from its arguments; the world when none names a group."""
    import torch.distributed as dist

    from ..compat.torch_private import group_size_of

    sizes = (group_size_of(a) for a in tree_flatten(args)[0])
    return next((n for n in sizes if n is not None), None) or dist.get_world_size()


def _on_gpu(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cuda"


def _sync(device: Any) -> None:
    if device is not None:
        torch.cuda.synchronize(device)


def _bytes_all(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor))


_RATES: dict[str, dict[str, float]] = {}


def rates(device: Any = None) -> dict[str, float]:
    """The float32 matrix-multiply rate (flop/s) and copy bandwidth (bytes/s) of this process on ``device`` (default:
    its CPU), measured once."""
    key = str(device or "cpu")
    if key not in _RATES:
        from ..compat.torch_private import real_tensors

        gpu = torch.device(key) if key != "cpu" else None
        with real_tensors():
            a, src = torch.rand(1024, 1024, device=key), torch.rand(8 << 20, device=key)
            dst = torch.empty_like(src)
            _RATES[key] = {}
            for name, run, work in (
                ("flops", lambda: a @ a, 2 * 1024**3),
                ("bytes", lambda: dst.copy_(src), 2 * src.numel() * 4),
            ):
                run()
                best = min(_timed(run, gpu) for _ in range(3))
                _RATES[key][name] = work / max(best, 1e-9)
    return _RATES[key]


def _timed(run: Any, gpu: Any = None) -> float:
    _sync(gpu)
    tic = time.perf_counter()
    run()
    _sync(gpu)
    return time.perf_counter() - tic


def _roofline(func: Any, args: Any, kwargs: Any, out: Any) -> float:
    """An operator too large to run here: its flops (torch's flop counter's formulas) at the measured multiply rate,
    or its bytes read and written at the measured copy bandwidth, whichever takes longer."""
    from torch.utils.flop_counter import flop_registry

    flops = 0
    formula = flop_registry.get(func.overloadpacket)
    if formula is not None:
        flops = formula(*args, **kwargs, out_val=out)
    r = rates(next((t.device for t in tree_flatten((args, out))[0] if _on_gpu(t)), None))
    return max(flops / r["flops"], _bytes_all((args, kwargs, out)) / r["bytes"])


_ENTRY: list[float] = []


class _Passing(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.handled_s, self.calls = 0.0, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        tic = time.perf_counter()
        self.calls += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.handled_s += time.perf_counter() - tic


def entry_cost() -> float:
    """Seconds a dispatch mode's handler costs an operator outside the handler itself (the way from the dispatcher
    into Python and back), measured once under fake tensors on a chain of small operators."""
    if not _ENTRY:
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():
            x = torch.ones(8)
            walls = []
            for _ in range(3):
                mode = _Passing()
                tic = time.perf_counter()
                with mode:
                    y = x
                    for _ in range(500):
                        y = y + 1
                walls.append((time.perf_counter() - tic - mode.handled_s) / mode.calls)
        _ENTRY.append(max(0.0, min(walls)))
    return _ENTRY[0]


def _plain(t: Any) -> bool:
    if not isinstance(t, torch.Tensor):
        return True
    from torch._subclasses.fake_tensor import FakeTensor

    return type(t) is FakeTensor
