"""One rank's training step under one strategy, and what MemTracker counts in it.

The same code runs a forecast (fake tensors, a fake process group: nothing the size of the model exists) and the
measurement a forecast is checked against (real tensors, a real gloo group), so the two differ only in what the
tensors hold. The strategies are torch's own: DDP, FSDP2's ``fully_shard`` per block, ``parallelize_module`` with
a column/row plan, and a GPipe pipeline of ``split_sequential``'s stages.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..config import STRATEGIES, TP_DEGREE
from ..errors import ConfigError
from ..parallel.pipeline import split_sequential

PARTS = ("parameters", "gradients", "optimizer", "activations", "temporaries", "buffers", "buckets", "other")
_KIND = {
    "Parameter": "parameters",
    "Gradient": "gradients",
    "Optstate": "optimizer",
    "Activation": "activations",
    "Temp": "temporaries",
    "Buffer": "buffers",
    "Other": "other",
}


class Spec:
    """What the person's cell defines, read from its namespace: ``model``, ``batch`` and the optional rest."""

    __slots__ = ("model", "batch", "loss_fn", "optimizer", "tp_plan", "fsdp_blocks", "microbatches")

    def __init__(self, ns: dict[str, Any], *, microbatches: int) -> None:
        missing = [k for k in ("model", "batch") if k not in ns]
        if missing:
            raise ConfigError(
                f"the cell defines no {' and no '.join(missing)}; %%dist_fit runs the cell and reads `model` (a "
                "torch.nn.Module) and `batch` (one rank's input, or (input, target)) from it."
            )
        if not isinstance(ns["model"], torch.nn.Module):
            raise ConfigError(f"`model` is a {type(ns['model']).__name__}, not a torch.nn.Module.")
        self.model: torch.nn.Module = ns["model"]
        self.batch: Any = ns["batch"]
        self.loss_fn: Callable[..., torch.Tensor] | None = ns.get("loss_fn")
        self.optimizer: Callable[..., Any] = ns.get("optimizer") or (lambda p: torch.optim.AdamW(p, lr=1e-3))
        self.tp_plan: dict[str, Any] | None = ns.get("tp_plan")
        blocks = ns.get("fsdp_blocks")  # a module class (its instances) or a list of modules
        if isinstance(blocks, type):
            blocks = [m for m in self.model.modules() if isinstance(m, blocks) and m is not self.model]
        self.fsdp_blocks: list[torch.nn.Module] | None = blocks
        self.microbatches = int(ns.get("microbatches", microbatches))

    def to(self, device: str) -> None:
        """The model and the batch on ``device`` (the cell builds them where it likes, usually the CPU)."""
        if device == "cpu":
            return
        from torch.utils._pytree import tree_map

        self.model.to(device)
        self.batch = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, self.batch)

    def split(self) -> tuple[Any, Any]:
        """(input, target): a batch that is a tuple or list of two is (input, target); else the input alone."""
        if isinstance(self.batch, (tuple, list)) and len(self.batch) == 2:
            return self.batch[0], self.batch[1]
        return self.batch, None

    def loss(self, out: torch.Tensor, target: Any) -> torch.Tensor:
        if self.loss_fn is not None:
            return self.loss_fn(out, target)
        if target is None:
            return out.float().pow(2).mean()
        if not target.is_floating_point():
            return torch.nn.functional.cross_entropy(out.flatten(0, -2), target.flatten())
        return torch.nn.functional.mse_loss(out, target)


def tp_plan_of(model: torch.nn.Module) -> dict[str, Any]:
    """Megatron's MLP plan for every Sequential: its first Linear column-wise, the next row-wise, and so on in pairs."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Sequential):
            continue
        linears = [f"{name}.{k}" if name else k for k, m in mod.named_children() if isinstance(m, torch.nn.Linear)]
        for first, second in zip(linears[0::2], linears[1::2], strict=False):
            plan[first], plan[second] = ColwiseParallel(), RowwiseParallel()
    if not plan:
        raise ConfigError(
            "tensor parallelism needs a plan and none could be made (no torch.nn.Sequential holds two Linear layers); "
            "define `tp_plan = {'fc1': ColwiseParallel(), 'fc2': RowwiseParallel()}` in the cell."
        )
    return plan


def blocks_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    """FSDP's units when the cell names none: each direct child that holds parameters, and each element of a child
    that is a ModuleList or Sequential (a model's ``layers``), the way apply_fsdp is usually given its blocks."""
    out: list[torch.nn.Module] = []
    for child in model.children():
        inner = list(child) if isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential)) else [child]
        out.extend(m for m in inner if any(True for _ in m.parameters()))
    return out


def mesh_of(strategy: str, device: str = "cpu") -> Any:
    """The mesh FSDP and TP need, made before any fake tensor exists (a DeviceMesh reads real rank lists); for the
    2-D mix, ("dp", "tp"): each TP group TP_DEGREE neighbouring ranks, FSDP across the groups."""
    if strategy not in ("fsdp", "tp", "fsdp+tp"):
        return None
    from torch.distributed.device_mesh import init_device_mesh

    n, kind = dist.get_world_size(), device.partition(":")[0]
    if strategy != "fsdp+tp":
        return init_device_mesh(kind, (n,))
    if n < 2 * TP_DEGREE or n % TP_DEGREE:
        raise ConfigError(
            f"fsdp+tp splits the ranks into groups of {TP_DEGREE} for tensor parallelism and shards across the groups: "
            f"it needs a world that is a multiple of {TP_DEGREE}, at least {2 * TP_DEGREE}, not {n}; forecast it at "
            f"-n {2 * TP_DEGREE},{4 * TP_DEGREE}."
        )
    return init_device_mesh(kind, (n // TP_DEGREE, TP_DEGREE), mesh_dim_names=("dp", "tp"))


def wrap(strategy: str, spec: Spec, mesh: Any, *, fake: bool) -> torch.nn.Module:
    """The model as this rank holds it under ``strategy``: DDP, FSDP2 per direct child, TP, or this rank's stage."""
    model = spec.model
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        if fake:
            from ..compat.torch_private import ddp_on_a_fake_group

            return ddp_on_a_fake_group(model, bucket_cap_mb=25.0)
        return DistributedDataParallel(model, bucket_cap_mb=25.0)
    if strategy in ("fsdp", "fsdp+tp"):  # the 2-D mix as torchtitan builds it: TP within a group, then FSDP across
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import parallelize_module

        from ..compat.torch_private import meshes_made_for_real

        if strategy == "fsdp+tp":
            parallelize_module(model, mesh["tp"], spec.tp_plan or tp_plan_of(model))
            mesh = mesh["dp"]
        with meshes_made_for_real():
            for block in spec.fsdp_blocks or blocks_of(model):
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        return model
    if strategy == "tp":
        from torch.distributed.tensor.parallel import parallelize_module

        return parallelize_module(model, mesh, spec.tp_plan or tp_plan_of(model))
    if strategy == "pp":
        if not isinstance(model, torch.nn.Sequential):
            raise ConfigError(
                f"pipeline stages are split from a torch.nn.Sequential; `model` is a {type(model).__name__}: build it "
                "as nn.Sequential(embedding, *blocks, head), or leave pp out of --strategies."
            )
        return split_sequential(model, dist.get_world_size())[dist.get_rank()]
    raise ConfigError(f"strategy {strategy!r} is not one of {', '.join(STRATEGIES)}.")


def stepper(strategy: str, spec: Spec, model: torch.nn.Module) -> Callable[[], None]:
    """One optimizer step of this rank. A pipeline stage runs GPipe: every micro-batch's forward, then every backward;
    its input is what the stages before it make of the batch (computed without keeping anything)."""
    if strategy == "pp" and not any(True for _ in model.parameters()):
        rank, world = dist.get_rank(), dist.get_world_size()
        held = ", ".join(type(m).__name__ for m in model.children())
        raise ConfigError(
            f"pipeline stage {rank} of {world} holds no weights ({held}): the model's layers split {world} ways leave "
            f"it nothing to train; forecast pp at fewer ranks (-n {max(1, world // 2)}) or give the model more layers."
        )
    opt = spec.optimizer(model.parameters())
    x, target = spec.split()
    if strategy != "pp":

        def step() -> None:
            spec.loss(model(x), target).backward()
            opt.step()
            opt.zero_grad()

        step.optimizer = opt  # type: ignore[attr-defined]
        return step
    rank, world = dist.get_rank(), dist.get_world_size()
    micro = spec.microbatches
    with torch.no_grad():
        inp = x
        for stage in split_sequential(spec.model, world)[:rank]:  # type: ignore[arg-type]  # wrap() checked it
            inp = stage(inp)
    xs, ts = inp.chunk(micro), (target.chunk(micro) if target is not None else [None] * micro)

    def pp_step() -> None:
        outs, losses = [], []
        for xm, tm in zip(xs, ts, strict=True):  # the last stage computes each micro-batch's loss as it comes
            outs.append(model(xm.detach().requires_grad_(rank > 0 and xm.is_floating_point())))
            if rank == world - 1:
                losses.append(spec.loss(outs[-1], tm) / micro)
        sent = [("send", o.numel() * o.element_size()) for o in outs] if rank < world - 1 else []
        back = [("send", xm.numel() * xm.element_size()) for xm in xs] if rank > 0 else []
        pp_step.p2p = sent + back  # type: ignore[attr-defined]  # activations on, their gradients back
        for out in losses or outs:  # the outputs stay until the step ends, as a schedule keeps them to return
            out.backward(None if losses else torch.ones_like(out))
        del outs, losses
        opt.step()
        opt.zero_grad()

    pp_step.optimizer = opt  # type: ignore[attr-defined]
    return pp_step


def unseen_collectives(strategy: str, spec: Spec, step: Callable[[], None]) -> list[tuple[str, int, int]]:
    """What a step sends that no operator shows under a fake group: DDP's bucket all-reduces (its reducer calls the
    group from C++; 25 MB buckets) and a pipeline stage's sends (the forecast runs its stage alone)."""
    if strategy == "pp":
        return [(kind, n, dist.get_world_size()) for kind, n in getattr(step, "p2p", [])]
    if strategy != "ddp":
        return []
    cap, out, bucket = 25 * 10**6, [], 0
    for p in reversed([p for p in spec.model.parameters() if p.requires_grad]):
        bucket += p.numel() * p.element_size()
        if bucket >= cap:
            out.append(("all_reduce", bucket, dist.get_world_size()))
            bucket = 0
    return out + ([("all_reduce", bucket, dist.get_world_size())] if bucket else [])


def measure(model: torch.nn.Module, step: Callable[[], None]) -> dict[str, Any]:
    """Two warm-up steps (the optimizer makes its state, DDP rebuilds its buckets), then one step under MemTracker:
    the peak and its parts, in bytes. DDP's buckets, made before any tracked step, are added as a part of their own."""
    from ..compat.torch_private import ddp_bucket_bytes, mem_tracker

    step()
    step()
    tracker = mem_tracker()
    tracker.track_external(model, step.optimizer)  # type: ignore[attr-defined]
    tic = time.perf_counter()
    with tracker:
        step()
    wall = time.perf_counter() - tic
    peak = {dev: parts for dev, parts in tracker.get_tracker_snapshot("peak").items()}
    parts = {p: 0 for p in PARTS}
    total = 0
    for counts in peak.values():
        for kind, n in counts.items():
            name = getattr(kind, "value", kind)
            if name == "Total":
                total += n
            else:
                parts[_KIND.get(name, "other")] += n
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        parts["buckets"] = ddp_bucket_bytes(model)
        total += parts["buckets"]
    return {"peak": total, "parts": parts, "tracked_s": wall}
