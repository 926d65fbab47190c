"""FSDP, pipeline and tensor parallelism on a real 2-rank gloo world, each against an unsplit reference."""

from __future__ import annotations

import textwrap

import torch

from tests.helpers import SETUP, local


def test_fsdp_gives_the_same_losses_and_parameters_as_ddp(cluster):
    cluster.run(SETUP).raise_for_error()
    cluster.run(
        textwrap.dedent(
            """
            from nbdist.parallel import apply_ddp, apply_fsdp, memory_report, shard

            def run(wrap):
                model = wrap(make_model())
                opt = torch.optim.Adam(model.parameters(), lr=0.01)
                losses = []
                for step, (x, y) in zip(range(5), shard(make_data(), 4, shuffle=False)):
                    opt.zero_grad()
                    loss = torch.nn.functional.mse_loss(model(x), y)
                    loss.backward()
                    opt.step()
                    losses.append(loss.item())
                return model, opt, losses

            ddp, ddp_opt, ddp_losses = run(apply_ddp)
            fsdp, fsdp_opt, fsdp_losses = run(apply_fsdp)
            ddp_params = [p.detach().clone() for p in ddp.module.parameters()]
            fsdp_params = [p.full_tensor().detach().clone() for p in fsdp.parameters()]
            mem = {"ddp": memory_report(ddp, ddp_opt), "fsdp": memory_report(fsdp, fsdp_opt)}
            """
        )
    ).raise_for_error()
    for rank in (0, 1):
        res = cluster.pull("ddp_losses", ranks=rank)[0], cluster.pull("fsdp_losses", ranks=rank)[0]
        # reduce-scatter and all-reduce add the same two numbers; Adam amplifies ulps a little.
        torch.testing.assert_close(torch.tensor(res[1]), torch.tensor(res[0]), rtol=0, atol=1e-6)
        for a, b in zip(cluster.pull("ddp_params", ranks=rank)[0], cluster.pull("fsdp_params", ranks=rank)[0], strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
    mem = cluster.pull("mem")
    total_ddp = mem[0]["ddp"]["params"]
    assert sum(m["fsdp"]["params"] for m in mem) == total_ddp  # shards add up to one full copy
    assert all(m["fsdp"]["params"] < m["ddp"]["params"] for m in mem)
    assert all(m["fsdp"]["optim"] < m["ddp"]["optim"] for m in mem)


PIPE = textwrap.dedent(
    """
    def make_deep():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )

    g = torch.Generator().manual_seed(3)
    X = torch.randn(16, 8, generator=g)
    Y = torch.randn(16, 1, generator=g)
    """
)


def test_pipeline_gpipe_and_1f1b_match_the_unsplit_model(cluster):
    cluster.run(SETUP + PIPE).raise_for_error()
    cluster.run(
        textwrap.dedent(
            """
            from nbdist.parallel import make_schedule, pipeline_step
            pipe = {}
            for kind in ("gpipe", "1f1b"):
                sched, part = make_schedule(make_deep(), n_microbatches=4, loss_fn=torch.nn.functional.mse_loss, schedule=kind)
                loss = pipeline_step(sched, X, Y)
                pipe[kind] = (loss, [p.grad.clone() for p in part.parameters()])
            """
        )
    ).raise_for_error()
    ref = local("import torch\n" + PIPE)
    model = ref["make_deep"]()
    # The schedules average the micro-batch losses' gradients; with 4 equal micro-batches
    # that is the full-batch mean loss's gradient.
    losses = [torch.nn.functional.mse_loss(model(x), y) for x, y in zip(ref["X"].chunk(4), ref["Y"].chunk(4), strict=True)]
    full = torch.stack(losses).mean()
    full.backward()
    ref_grads = [p.grad for p in model.parameters()]
    stage0, stage1 = cluster.pull("pipe")
    for kind in ("gpipe", "1f1b"):
        assert stage0[kind][0] is None
        assert abs(stage1[kind][0] - full.item()) < 1e-6
        grads = stage0[kind][1] + stage1[kind][1]
        assert len(grads) == len(ref_grads)
        for a, b in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


TP = textwrap.dedent(
    """
    torch.manual_seed(0)
    fc1, fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
    g = torch.Generator().manual_seed(5)
    X = torch.randn(6, 8, generator=g)
    """
)


def test_tensor_parallel_layers_match_the_dense_layers(cluster):
    cluster.run(TP).raise_for_error()
    cluster.run(
        textwrap.dedent(
            """
            from nbdist.parallel import ColumnParallelLinear, RowParallelLinear
            col = ColumnParallelLinear.from_dense(fc1)          # each rank: 8 of the 16 hidden units
            row = RowParallelLinear.from_dense(fc2)             # each rank: the matching 8 input columns
            x = X.clone().requires_grad_()
            out = row(torch.relu(col(x)))
            out.square().sum().backward()
            by_hand = (out.detach(), x.grad.clone(), col.weight.grad.clone(), row.weight.grad.clone())

            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
            from nbdist.parallel import mesh_1d
            mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
            mlp.load_state_dict({"0.weight": fc1.weight, "0.bias": fc1.bias, "2.weight": fc2.weight, "2.bias": fc2.bias})
            mlp = parallelize_module(mlp, mesh_1d(), {"0": ColwiseParallel(), "2": RowwiseParallel()})
            x2 = X.clone().requires_grad_()
            out2 = mlp(x2)
            out2.square().sum().backward()
            dtensor = (out2.detach(), x2.grad.clone(), mlp[0].weight.grad.to_local().clone())
            """
        )
    ).raise_for_error()
    ref = local("import torch\n" + TP)
    x = ref["X"].clone().requires_grad_()
    out = ref["fc2"](torch.relu(ref["fc1"](x)))
    out.square().sum().backward()
    w1, w2 = ref["fc1"].weight.grad, ref["fc2"].weight.grad
    for rank, ((o, gx, g1, g2), (o2, gx2, g1b)) in enumerate(zip(cluster.pull("by_hand"), cluster.pull("dtensor"), strict=True)):
        # The split changes only the order of two partial sums: float32 rounding, 1e-5.
        torch.testing.assert_close(o, out.detach(), rtol=0, atol=1e-5)
        torch.testing.assert_close(gx, x.grad, rtol=0, atol=1e-5)
        torch.testing.assert_close(g1, w1[rank * 8 : (rank + 1) * 8], rtol=0, atol=1e-5)
        torch.testing.assert_close(g2, w2[:, rank * 8 : (rank + 1) * 8], rtol=0, atol=1e-5)
        torch.testing.assert_close(o2, out.detach(), rtol=0, atol=1e-5)
        torch.testing.assert_close(gx2, x.grad, rtol=0, atol=1e-5)
        torch.testing.assert_close(g1b, w1[rank * 8 : (rank + 1) * 8], rtol=0, atol=1e-5)
