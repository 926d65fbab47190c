"""FSDP, pipeline and tensor parallelism on a real 2-rank gloo world, each against an unsplit reference.
What the ranks run is in programs.py; the references run here, from the same models and data."""

from __future__ import annotations

import torch

from tests.dist import programs
from tests.helpers import on_ranks


def test_fsdp_gives_the_same_losses_and_parameters_as_ddp(cluster):
    _, per_rank = on_ranks(cluster, programs.ddp_and_fsdp)
    for out in per_rank:
        (ddp_losses, ddp_params, _), (fsdp_losses, fsdp_params, _) = out["ddp"], out["fsdp"]
        # reduce-scatter and all-reduce add the same two numbers; Adam amplifies ulps a little.
        torch.testing.assert_close(torch.tensor(fsdp_losses), torch.tensor(ddp_losses), rtol=0, atol=1e-6)
        for a, b in zip(ddp_params, fsdp_params, strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
    mem = [{name: out[name][2] for name in ("ddp", "fsdp")} for out in per_rank]
    total_ddp = mem[0]["ddp"]["params"]
    assert sum(m["fsdp"]["params"] for m in mem) == total_ddp  # shards add up to one full copy
    assert all(m["fsdp"]["params"] < m["ddp"]["params"] for m in mem)
    assert all(m["fsdp"]["optim"] < m["ddp"]["optim"] for m in mem)


def test_pipeline_gpipe_and_1f1b_match_the_unsplit_model(cluster):
    _, (stage0, stage1) = on_ranks(cluster, programs.pipeline_grads)
    model = programs.make_deep()
    x, y = programs.pipe_data()
    # The schedules average the micro-batch losses' gradients; with 4 equal micro-batches
    # that is the full-batch mean loss's gradient.
    losses = [torch.nn.functional.mse_loss(model(xs), ys) for xs, ys in zip(x.chunk(4), y.chunk(4), strict=True)]
    full = torch.stack(losses).mean()
    full.backward()
    ref_grads = [p.grad for p in model.parameters()]
    for kind in ("gpipe", "1f1b"):
        assert stage0[kind][0] is None
        assert abs(stage1[kind][0] - full.item()) < 1e-6
        grads = stage0[kind][1] + stage1[kind][1]
        assert len(grads) == len(ref_grads)
        for a, b in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_tensor_parallel_layers_match_the_dense_layers(cluster):
    _, per_rank = on_ranks(cluster, programs.tensor_parallel_grads)
    fc1, fc2, data = programs.tp_layers()
    x = data.clone().requires_grad_()
    out = fc2(torch.relu(fc1(x)))
    out.square().sum().backward()
    w1, w2 = fc1.weight.grad, fc2.weight.grad
    for rank, ((o, gx, g1, g2), (o2, gx2, g1b)) in enumerate(per_rank):
        # The split changes only the order of two partial sums: float32 rounding, 1e-5.
        torch.testing.assert_close(o, out.detach(), rtol=0, atol=1e-5)
        torch.testing.assert_close(gx, x.grad, rtol=0, atol=1e-5)
        torch.testing.assert_close(g1, w1[rank * 8 : (rank + 1) * 8], rtol=0, atol=1e-5)
        torch.testing.assert_close(g2, w2[:, rank * 8 : (rank + 1) * 8], rtol=0, atol=1e-5)
        torch.testing.assert_close(o2, out.detach(), rtol=0, atol=1e-5)
        torch.testing.assert_close(gx2, x.grad, rtol=0, atol=1e-5)
        torch.testing.assert_close(g1b, w1[rank * 8 : (rank + 1) * 8], rtol=0, atol=1e-5)
