"""What the tests in tests/dist run on the ranks: plain functions, linted and type-checked like nbdist.

``tests.helpers.on_ranks(cluster, fn, ...)`` sends this module's source to the ranks as one cell (no import on
the rank: it works on any host the ranks run on) and calls ``fn`` there; each rank's return value comes back,
with the cell's RunResult (its output and the metric rows the rank logged). The references the tests compare
against (one process, numpy, torch's own hooks) run in the test's process, from the same functions where
they share a model or data.

No ``from __future__ import annotations``: torch reads a comm hook's annotation (``dist.GradBucket``) at
``register_comm_hook`` and refuses a string.
"""

import statistics
import time
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.data import TensorDataset

from nbdist.compression import make_hook
from nbdist.compression.base import Received
from nbdist.parallel import apply_ddp, apply_fsdp, shard

Params = list[torch.Tensor]


def make_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def make_data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    y = (x.sum(1, keepdim=True) > 0).float()
    return TensorDataset(x, y)


def detached(model: torch.nn.Module) -> Params:
    return [p.detach().clone() for p in model.parameters()]


def full(p: torch.Tensor) -> torch.Tensor:
    """A parameter whole: an FSDP shard (a DTensor) gathered, a plain tensor as it is."""
    return p.full_tensor() if isinstance(p, DTensor) else p


def local_part(p: Any) -> torch.Tensor:
    """This rank's part of a DTensor (a tensor-parallel weight's gradient)."""
    return p.to_local() if isinstance(p, DTensor) else p


def compression_state(model: Any) -> Any:
    """The hook state apply_ddp(..., compression=...) leaves on the model."""
    return model.compression_state


def sgd_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, batches: list[Any], first: int, last: int) -> None:
    for step in range(first, last):
        x, y = batches[step % len(batches)]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


# ---------------------------------------------------------------- DDP, metrics, checkpoints (test_ddp.py)


def ddp_steps(batch: int, steps: int) -> Params:
    """DDP on the sharded data for ``steps`` steps; the parameters."""
    loader = shard(make_data(), batch_size=batch, shuffle=False)
    model = apply_ddp(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _step, (x, y) in zip(range(steps), loader, strict=False):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return detached(model.module)


def accumulated() -> list[torch.Tensor]:
    """One step on 8 samples per rank, in 1, 2 and 4 micro-batches with ``accumulate``: the parameters of each."""
    from nbdist.parallel import accumulate

    x, y = make_data()[list(range(dist.get_rank(), 16, 2))]
    results = []
    for micro in (1, 2, 4):
        model = apply_ddp(make_model())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        opt.zero_grad()
        chunk = 8 // micro
        for i in range(micro):
            with accumulate(model, i, micro):
                part = slice(i * chunk, (i + 1) * chunk)
                (torch.nn.functional.mse_loss(model(x[part]), y[part]) / micro).backward()
        opt.step()
        results.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    return results


def bucket_sizes() -> dict[str, list[int]]:
    """The sizes of the buckets DDP hands its hook, with a 25 MB cap and with DDP's default."""

    def seen(cap: float | None) -> list[int]:
        sizes: list[int] = []

        def spy(state: list[int], bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            state.append(bucket.buffer().numel())
            f: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            f.set_result(bucket.buffer())
            return f

        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024))
        model = apply_ddp(net, bucket_cap_mb=cap, comm_hook=spy, hook_state=sizes, metrics=False)
        for _ in range(3):  # DDP rebuilds its buckets after the first step
            model(torch.randn(4, 512)).sum().backward()
        return sizes[-2:] if cap is None else sizes[-1:]

    return {"25": seen(25.0), "default": seen(None)}


def reduced_values() -> tuple[float, list[float], list[Any]]:
    from nbdist.parallel import all_reduce_mean, all_reduce_sum, gather_values

    mean = all_reduce_mean(float(dist.get_rank()))
    total = all_reduce_sum(torch.tensor([1.0, dist.get_rank()]))
    return mean, total.tolist(), gather_values({"rank": dist.get_rank()})


def ddp_with_checkpoints(ckpt: str, last: int, save_at: int | None = None, resume: bool = False) -> dict[str, Any]:
    """Fresh model and SGD with momentum; resume from ``ckpt`` (or start at 0), train to ``last``, saving at
    ``save_at``; the step it started from and the parameters at ``save_at`` and at the end."""
    from nbdist.parallel import load_checkpoint, save_checkpoint

    batches = list(shard(make_data(), batch_size=4, shuffle=False))
    model = apply_ddp(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    first = load_checkpoint(ckpt, model, opt) if resume else 0
    out: dict[str, Any] = {"first": first}
    if save_at is not None:
        sgd_steps(model, opt, batches, first, save_at)
        save_checkpoint(ckpt, model, opt, step=save_at)
        out["saved"], first = detached(model.module), save_at
    sgd_steps(model, opt, batches, first, last)
    out["params"] = detached(model.module)
    return out


def latest_then_load(ckpt: str, saved: Params) -> tuple[int | None, int, bool]:
    """Train a fresh model 2 steps away, then: the latest step ``ckpt`` has, the step loaded, and whether the
    loaded parameters are ``saved``."""
    from nbdist.parallel import latest_step, load_checkpoint

    batches = list(shard(make_data(), batch_size=4, shuffle=False))
    model = apply_ddp(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sgd_steps(model, opt, batches, 2, 4)
    latest = latest_step(ckpt)
    step = load_checkpoint(ckpt, model, opt)
    return latest, step, all(torch.equal(a, b) for a, b in zip(saved, model.module.parameters(), strict=True))


def fsdp_steps() -> int:
    """Five FSDP steps of a model wide enough that shard padding is negligible; its full size in bytes."""

    def wide() -> torch.nn.Sequential:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))

    model = apply_fsdp(wide())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 64), torch.randn(8, 64)
    for _ in range(5):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return sum(p.numel() * p.element_size() for p in wide().parameters())


def fsdp_round_trip(ckpt: str) -> tuple[bool, bool]:
    """Save an FSDP model and Adam after one step, load them into fresh ones: (same parameters, moved from
    the initial ones)."""
    from nbdist.parallel import load_checkpoint, save_checkpoint

    m = apply_fsdp(make_model())
    o = torch.optim.Adam(m.parameters(), lr=0.01)
    x, y = make_data()[:8]
    torch.nn.functional.mse_loss(m(x), y).backward()
    o.step()
    save_checkpoint(ckpt, m, o, step=1)
    m2 = apply_fsdp(make_model())
    o2 = torch.optim.Adam(m2.parameters(), lr=0.01)
    load_checkpoint(ckpt, m2, o2)
    same = all(torch.equal(full(a), full(b)) for a, b in zip(m.parameters(), m2.parameters(), strict=True))
    initial = full(next(apply_fsdp(make_model()).parameters()))
    return same, not torch.equal(full(next(m2.parameters())), initial)


def ddp_with_no_sync() -> int:
    """Eight steps, steps 5 and 6 under no_sync (gradient accumulation); the model's size in bytes."""
    model = apply_ddp(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = make_data()[:8]
    for step in range(8):
        opt.zero_grad()
        if step in (5, 6):  # these backwards do not communicate
            with model.no_sync():
                torch.nn.functional.mse_loss(model(x), y).backward()
        else:
            torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return sum(p.numel() * p.element_size() for p in model.parameters())


def timed_and_plain() -> bool:
    """DDP with nbdist's timing hook (what apply_ddp registers on a GPU) and without: the same parameters?"""
    from torch.nn.parallel import DistributedDataParallel

    from nbdist.parallel.instrument import StepMeter, timing_hook

    x, y = make_data()[:8]
    timed, plain = DistributedDataParallel(make_model()), DistributedDataParallel(make_model())
    meter = StepMeter()
    timed.register_comm_hook(meter, timing_hook)
    timed.register_forward_pre_hook(meter.on_forward)
    for model in (timed, plain):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(4):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    return all(torch.equal(a, b) for a, b in zip(timed.parameters(), plain.parameters(), strict=True))


def overhead_by_skipping() -> float:
    """The communication overhead (%) measured independently: 1 - t(step with communication skipped) / t(step),
    in alternating blocks of 10 steps; the steps of apply_ddp's model log the reported figure meanwhile."""

    def mlp() -> torch.nn.Sequential:
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
            torch.nn.Linear(1024, 10),
        )

    def no_comm(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    measured = apply_ddp(mlp())  # what users run: the step metrics come from here
    skipped = torch.nn.parallel.DistributedDataParallel(mlp())
    skipped.register_comm_hook(None, no_comm)  # the same step with communication skipped
    opts = {m: torch.optim.SGD(m.parameters(), lr=0.01) for m in (measured, skipped)}
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(64, 512, generator=g), torch.randint(0, 10, (64,), generator=g)
    walls: dict[torch.nn.Module, list[float]] = {measured: [], skipped: []}
    for block in range(32):  # alternate blocks of 10 steps, so drift hits both alike
        model = measured if block % 2 == 0 else skipped
        for i in range(10):
            t = time.perf_counter()
            opts[model].zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opts[model].step()
            if i >= 2:
                walls[model].append(time.perf_counter() - t)
    return 100 * (1 - statistics.median(walls[skipped]) / statistics.median(walls[measured]))


def compressed_totals() -> list[dict[str, Any]]:
    """Six top-10% steps (an evaluation forward first); the hook state's totals per step."""
    model = apply_ddp(make_model(), compression="topk:0.1")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = make_data()[:8]
    model.eval()
    model(x)  # an evaluation forward must not shift the accounting
    model.train()
    for _ in range(6):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return compression_state(model).step_totals()  # type: ignore[no-any-return]


def alone_in_a_subgroup() -> tuple[torch.Tensor, torch.Tensor, int]:
    """Each rank alone in its own group with fp16 compression, its own data: (its DDP gradient, the gradient
    of the same model in one process, the size of the group the hook used)."""
    alone = [dist.new_group([0]), dist.new_group([1])][dist.get_rank()]
    model = apply_ddp(make_model(), compression="fp16", process_group=alone)
    x, y = make_data()[dist.get_rank() * 4 : (dist.get_rank() + 1) * 4]  # different data on each rank
    for _ in range(3):  # the hook compresses from its third step (two warm-up steps)
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
    ref = make_model()
    ref.load_state_dict(model.module.state_dict())
    torch.nn.functional.mse_loss(ref(x), y).backward()
    mine = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    local_grad = torch.cat([p.grad.flatten() for p in ref.parameters() if p.grad is not None])
    return mine, local_grad, int(compression_state(model).process_group.size())


def powersgd_steps() -> None:
    model = apply_ddp(make_model(), compression="powersgd:1")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = make_data()[:8]
    for _ in range(6):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def profiled(trace_dir: str) -> None:
    from nbdist.parallel import profile

    model = apply_ddp(make_model(), metrics=False)
    x, y = make_data()[:8]
    with profile(trace_dir):
        for _ in range(2):
            torch.nn.functional.mse_loss(model(x), y).backward()


# ---------------------------------------------------------------- compression hooks in DDP (test_hooks.py)


def train_hooked(steps: int = 6, **ddp: Any) -> tuple[Params, Any]:
    """``steps`` SGD steps of apply_ddp(make_model(), **ddp) on the sharded data: the parameters and the hook's
    state (None without compression)."""
    model = apply_ddp(make_model(), **ddp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _step, (x, y) in zip(range(steps), shard(make_data(), 4, shuffle=False), strict=False):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return detached(model.module), getattr(model, "compression_state", None)


def identity_and_allreduce() -> tuple[Params, Params]:
    """(torch's allreduce_hook, compression 'none'): the parameters of each."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    return train_hooked(comm_hook=allreduce_hook, hook_state=None)[0], train_hooked(compression="none")[0]


def bf16_reference(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's bf16_compress_hook, written out (torch's refuses gloo)."""
    buf = bucket.buffer()
    wire = buf.to(torch.bfloat16).div_(dist.get_world_size())
    fut = dist.all_reduce(wire, async_op=True).get_future()
    return fut.then(lambda f: buf.copy_(f.value()[0]))


def casts_and_torch_hooks() -> tuple[dict[str, Params], dict[str, Params], Params]:
    """(torch's fp16 and bf16 hooks, nbdist's fp16 and bf16, no compression): the parameters of each."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    ref = {n: train_hooked(comm_hook=h, hook_state=None)[0] for n, h in (("fp16", fp16_compress_hook), ("bf16", bf16_reference))}
    mine = {n: train_hooked(compression=n)[0] for n in ("fp16", "bf16")}
    return ref, mine, train_hooked(compression="none")[0]


def step_totals(specs: tuple[str, ...]) -> dict[str, list[dict[str, Any]]]:
    return {s: train_hooked(compression=s)[1].step_totals() for s in specs}


def records_per_spec(specs: tuple[str, ...]) -> dict[str, tuple[Params, list[tuple[int, int, int]]]]:
    """Per compressor: the parameters, and (step, bytes before, bytes after) of each hook record."""
    out = {}
    for spec in specs:
        params, state = train_hooked(compression=spec)
        out[spec] = (params, [(r["step"], r["bytes_before"], r["bytes_after"]) for r in state.records])
    return out


class FakeBucket:
    """What a comm hook reads of DDP's GradBucket: one bucket, the last, holding ``t``."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def buffer(self) -> torch.Tensor:
        return self.t

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True


def hook_means() -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Each compressor's hook on this rank's gradient: (what it returned, what this rank sent)."""
    g = torch.Generator().manual_seed(dist.get_rank())
    grad = torch.randn(100, generator=g)
    res = {}
    for spec in ("topk:0.05", "randomk:0.05", "signsgd", "qsgd:16"):
        hook, state = make_hook(spec, start_iter=0)
        out = hook(state, FakeBucket(grad.clone())).wait().clone()  # type: ignore[arg-type]
        sent = grad - state.residuals[0] if state.compressor.error_feedback else None
        res[spec] = (out, sent)
    return res


def dgc_outputs(d: int, k: int, m: float, steps: int) -> list[torch.Tensor]:
    """What DGC's hook returns at each of ``steps`` steps on this rank's known gradients (seed 100 + rank)."""
    hook, state = make_hook(f"dgc:{k / d}:{m}", start_iter=0)
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    return [hook(state, FakeBucket(torch.randn(d, generator=g))).wait().clone() for _ in range(steps)]  # type: ignore[arg-type]


def one_pass_and_torch_ops() -> tuple[int, dict[str, Params], dict[str, Params]]:
    """topk and dgc trained with the one-pass kernel and with the torch ops it replaces: (the kernel's calls,
    the parameters of each)."""
    from nbdist.compression import compressors
    from nbdist.compression.base import Compressor
    from nbdist.compression.compressors import TopK

    def train(spec: str) -> Params:  # 8449 parameters: the selection's threshold comes from a sample
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 1))
        model = apply_ddp(net, compression=spec, metrics=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(dist.get_rank())
        for _ in range(8):
            opt.zero_grad()
            model(torch.randn(32, 64, generator=g)).square().mean().backward()
            opt.step()
        return detached(model)

    kernel, calls = compressors.kernels.topk_feedback_into, []

    def counted(*args: Any) -> Any:
        calls.append(1)
        return kernel(*args)

    with mock.patch.object(compressors.kernels, "topk_feedback_into", counted):
        fused = {s: train(s) for s in ("topk:0.01", "dgc:0.01")}
    with mock.patch.object(TopK, "compress_feedback", Compressor.compress_feedback):
        torch_ops = {s: train(s) for s in ("topk:0.01", "dgc:0.01")}
    return len(calls), fused, torch_ops


def momentum_task_losses() -> dict[str, float]:
    """Notebook 05's task: 150 steps, lr 0.1, 1% of entries; SGD's momentum 0.9 for none and topk, in the
    hook for dgc. The final full-data loss (mean of the last 10 steps) of each."""

    def mlp() -> torch.nn.Sequential:
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
            torch.nn.Linear(512, 10),
        )

    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 10, generator=g)
    x = torch.randn(4096, 256, generator=g)
    y = (x @ w).argmax(1)
    xr, yr = x[dist.get_rank() :: 2], y[dist.get_rank() :: 2]
    final = {}
    for spec, momentum in (("none", 0.9), ("topk:0.01", 0.9), ("dgc:0.01", 0.0)):
        model = apply_ddp(mlp(), compression=spec, metrics=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
        losses = []
        for step in range(150):
            i = (step * 64) % (xr.shape[0] - 64)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xr[i : i + 64]), yr[i : i + 64]).backward()
            opt.step()
            if step >= 140:
                with torch.no_grad():
                    losses.append(torch.nn.functional.cross_entropy(model.module(x), y).item())
        final[spec] = sum(losses) / len(losses)
    return final


def final_losses() -> dict[str, float]:
    """400 steps of each compressor (lr 0.05, 512 samples): the final full-data loss of each."""
    data = make_data(512)
    batches = list(shard(data, 16, shuffle=False))
    final = {}
    for spec in ("none", "fp16", "bf16", "topk:0.1", "randomk:0.1", "qsgd:127", "signsgd", "powersgd:2"):
        model = apply_ddp(make_model(), compression=spec)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        sgd_steps(model, opt, batches, 0, 400)
        x, y = data[:]
        final[spec] = torch.nn.functional.mse_loss(model(x), y).item()
    return final


def torch_ops_and_numba() -> dict[tuple[str, str], Params]:
    """The torch-op kernels (what CUDA buckets use) forced on the CPU, and the default: parameters per spec."""
    import nbdist.compression.base as base

    out = {}
    for backend in ("torch", "auto"):
        with mock.patch.object(base, "uses_torch_ops", (lambda t: True) if backend == "torch" else base.uses_torch_ops):
            for spec in ("topk:0.1", "dgc:0.1", "signsgd", "qsgd:127"):
                out[backend, spec] = train_hooked(compression=spec)[0]
    return out


def corrupt_topk() -> None:
    """Top-10% DDP where rank 0 receives a payload from rank 1 with an index past the end of the bucket."""
    from nbdist.compression.compressors import TopK

    original = TopK.decompress

    def damaged(self: TopK, got: Received) -> torch.Tensor:
        if dist.get_rank() == 0:
            got.result[1] = got.result[1].clone()
            got.result[1][self.k(got.d) :].view(torch.int32)[0] = 10**9
        return original(self, got)

    with mock.patch.object(TopK, "decompress", damaged):
        train_hooked(compression="topk:0.1")


# ---------------------------------------------------------------- FSDP, pipeline, tensor parallel (test_sharded.py)


def ddp_and_fsdp() -> dict[str, Any]:
    """Five Adam steps under DDP and under FSDP: each one's losses, full parameters and memory report."""
    from nbdist.parallel import memory_report

    out: dict[str, Any] = {}
    for name, wrap in (("ddp", apply_ddp), ("fsdp", apply_fsdp)):
        model: Any = wrap(make_model())
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        losses = []
        for _step, (x, y) in zip(range(5), shard(make_data(), 4, shuffle=False), strict=False):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        params = model.parameters() if name == "fsdp" else model.module.parameters()
        out[name] = (losses, [full(p).detach().clone() for p in params], memory_report(model, opt))
    return out


def make_deep() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
    )


def pipe_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)


def pipeline_grads() -> dict[str, tuple[float | None, Params]]:
    """GPipe and 1F1B over 2 stages, 4 micro-batches: each one's loss (last stage) and this stage's gradients."""
    from nbdist.parallel import make_schedule, pipeline_step

    x, y = pipe_data()
    pipe = {}
    for kind in ("gpipe", "1f1b"):
        sched, part = make_schedule(make_deep(), n_microbatches=4, loss_fn=torch.nn.functional.mse_loss, schedule=kind)
        loss = pipeline_step(sched, x, y)
        pipe[kind] = (loss, [p.grad.clone() for p in part.parameters() if p.grad is not None])
    return pipe


def tp_layers() -> tuple[torch.nn.Linear, torch.nn.Linear, torch.Tensor]:
    torch.manual_seed(0)
    fc1, fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
    g = torch.Generator().manual_seed(5)
    return fc1, fc2, torch.randn(6, 8, generator=g)


def tensor_parallel_grads() -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """The dense MLP split by hand (nbdist's layers) and by torch's parallelize_module: (output, input gradient,
    this rank's weight gradients) of each."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from nbdist.parallel import ColumnParallelLinear, RowParallelLinear, mesh_1d

    fc1, fc2, data = tp_layers()
    col = ColumnParallelLinear.from_dense(fc1)  # each rank: 8 of the 16 hidden units
    row = RowParallelLinear.from_dense(fc2)  # each rank: the matching 8 input columns
    x = data.clone().requires_grad_()
    out = row(torch.relu(col(x)))
    out.square().sum().backward()
    assert x.grad is not None and col.weight.grad is not None and row.weight.grad is not None
    by_hand = (out.detach(), x.grad.clone(), col.weight.grad.clone(), row.weight.grad.clone())

    dense = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    dense.load_state_dict({"0.weight": fc1.weight, "0.bias": fc1.bias, "2.weight": fc2.weight, "2.bias": fc2.bias})
    mlp: Any = parallelize_module(dense, mesh_1d(), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x2 = data.clone().requires_grad_()
    out2 = mlp(x2)
    out2.square().sum().backward()
    assert x2.grad is not None
    return by_hand, (out2.detach(), x2.grad.clone(), local_part(mlp[0].weight.grad).clone())
