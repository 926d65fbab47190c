"""The NCCL path: one GPU per local rank. Skipped without CUDA (CI has none); run where a GPU is lent."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices for NCCL"
    ),
]


def test_nccl_world_ddp_and_fsdp_on_gpus():
    import nbdist

    with nbdist.start(n=2, backend="nccl") as cluster:
        assert cluster.backend == "nccl"
        cluster.run(
            "from nbdist.parallel import apply_ddp, apply_fsdp, device, all_reduce_mean, autocast, grad_scaler\n"
            "assert device().index == dist.get_rank()\n"
            "t = torch.ones(2, device=device()) * (dist.get_rank() + 1)\n"
            "dist.all_reduce(t)\n"
            "torch.manual_seed(0)\n"
            "m = apply_ddp(torch.nn.Linear(8, 1))\n"
            "scaler = grad_scaler()\n"
            "with autocast():\n"
            "    loss = m(torch.randn(4, 8, device=device())).square().mean()\n"
            "scaler.scale(loss).backward()\n"
            "f = apply_fsdp(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)))\n"
            "f(torch.randn(4, 8, device=device())).sum().backward()\n"
            "out = (t.cpu().tolist(), all_reduce_mean(float(dist.get_rank())))"
        ).raise_for_error()
        assert cluster.pull("out") == [([3.0, 3.0], 0.5)] * 2
        # A rank blocked in an NCCL collective is released by a real abort.
        r = cluster.run("if dist.get_rank() == 1:\n    raise ValueError('x')\ndist.all_reduce(torch.ones(1, device=device()))")
        assert r[1].status == "error" and r[0].status in ("interrupted", "dead")
        cluster.run("t = torch.ones(1, device=device())\ndist.all_reduce(t)\nv = t.item()").raise_for_error()
        assert cluster.pull("v") == [2.0, 2.0]
