"""The GPU path: NCCL worlds, binding, the kernel's own CUDA, the compression kernels on CUDA, GPU memory.

Skipped without CUDA (CI has none); run where a GPU is lent: ``pytest -m gpu tests``. A single GPU
runs all but the tests that need one GPU per rank.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs_gpus(n: int):
    return pytest.mark.skipif(GPUS < n, reason=f"needs {n} CUDA device(s); this machine has {GPUS}")


@needs_gpus(1)
def test_cuda_initialised_in_the_kernel_does_not_reach_the_ranks():
    """Notebook launchers that fork the kernel fail here ("Cannot re-initialize CUDA in forked
    subprocess"); nbdist's ranks are fresh processes, so the kernel's CUDA is not theirs."""
    import nbdist

    torch.zeros(1, device="cuda")  # the kernel initialises CUDA first
    assert torch.cuda.is_initialized()
    with nbdist.start(n=1) as cluster:
        assert cluster.backend == "nccl"  # one rank, one GPU of its own
        cluster.run(
            "import nbdist\n"
            "from nbdist.parallel import device\n"
            "t = torch.ones(4, device=device())\n"
            "dist.all_reduce(t)\n"
            "big = torch.empty(64 * 2**20, dtype=torch.uint8, device=device())\n"
            "nbdist.log(step=0, loss=1.0)\n"
            "out = (t.sum().item(), str(device()))"
        ).raise_for_error()
        assert cluster.pull("out") == [(4.0, "cuda:0")]
        row = cluster.status()[0]
        assert row["device"] == "cuda:0" and torch.cuda.get_device_name(0) in row["gpu"]
        used = int(row["gpu"].split(", ")[1].split("/")[0])
        assert used >= 64, row["gpu"]  # the 64 MiB tensor, as %dist_status shows it
        rows = cluster.last.metrics[0]
        assert rows[-1]["memory/gpu_MiB"] >= 64


@needs_gpus(1)
def test_two_ranks_share_one_gpu_over_gloo():
    import nbdist

    with nbdist.start(n=2) as cluster:
        assert cluster.backend == "gloo"  # rank 1 has no GPU of its own: nccl would refuse the duplicate
        cluster.run(
            "t = torch.full((3,), float(dist.get_rank() + 1), device='cuda:0')\n"
            "dist.all_reduce(t)\n"
            "from nbdist.parallel import device\n"
            "out = (t.tolist(), t.device.type, str(device()))"
        ).raise_for_error()
        assert cluster.pull("out") == [([3.0] * 3, "cuda", "cpu")] * 2


@needs_gpus(1)
def test_compression_kernels_on_cuda_send_what_the_cpu_kernels_send():
    """Same payloads bit for bit where the compressor is deterministic (top-k indices, packed signs)."""
    from nbdist.compression import kernels
    from nbdist.compression import torch_kernels as tk

    x = torch.randn(1_000_003, generator=torch.Generator().manual_seed(0))
    values, idx = tk.topk(x.cuda(), 1000)
    ref_values, ref_idx = kernels.topk(x.numpy(), 1000)
    assert np.array_equal(idx.cpu().numpy(), np.sort(ref_idx)) and values.device.type == "cuda"
    packed, scale = tk.sign_pack(x.cuda())
    ref_packed = np.empty(-(-x.numel() // 8), np.uint8)
    ref_scale = kernels.sign_pack(x.numpy(), ref_packed)
    assert np.array_equal(packed.cpu().numpy(), ref_packed)
    assert scale == pytest.approx(ref_scale, rel=1e-5)


HOOKS_ON_CUDA = """
import copy
from nbdist.parallel import apply_ddp, device
grads = {}
for spec in ("signsgd:noef", "topk:0.1", "qsgd:127"):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 16))  # one bucket, > 2**20 entries
    ref = copy.deepcopy(net).to(device())
    m = apply_ddp(net, compression=spec, metrics=False)
    x = torch.randn(64, 1024, device=device())
    for _ in range(3):  # two warm-up steps reduce uncompressed; the third is compressed
        m.zero_grad()
        m(x).square().mean().backward()
    ref(x).square().mean().backward()
    grads[spec] = [torch.cat([p.grad.flatten() for p in net.parameters()]).cpu() for net in (m.module, ref)]
"""


@needs_gpus(1)
def test_compression_hooks_compress_a_cuda_bucket_where_it_lives():
    """The DDP hooks on a CUDA bucket (the fused Triton kernels, the sampled top-k): on one rank the
    mean of one payload is what the compressor sent, checked against the uncompressed gradient."""
    import nbdist

    with nbdist.start(n=1) as cluster:
        cluster.run(HOOKS_ON_CUDA).raise_for_error()
        grads = cluster.pull("grads")[0]
    got, want = grads["signsgd:noef"]
    scale = want.abs().mean().item()
    torch.testing.assert_close(got.abs(), torch.full_like(got, scale), rtol=1e-5, atol=0)
    clear = want.abs() > 1e-6 * scale  # signs of (near) zeros may differ between two CUDA runs
    assert torch.equal(got[clear] > 0, want[clear] > 0)
    got, want = grads["topk:0.1"]
    kept = got != 0
    assert abs(int(kept.sum()) - want.numel() // 10) <= 1
    torch.testing.assert_close(got[kept], want[kept], rtol=1e-6, atol=0)
    assert want[kept].abs().min() >= want[~kept].abs().max()  # the largest in magnitude were sent
    got, want = grads["qsgd:127"]
    assert (got - want).abs().max() <= want.norm() / 127 and not torch.equal(got, want)


@needs_gpus(2)
def test_with_no_arguments_one_rank_per_gpu_and_nccl():
    import nbdist

    with nbdist.start() as cluster:
        assert cluster.world_size == GPUS and cluster.backend == "nccl"
        assert cluster.chosen.startswith(f"{GPUS} ranks = {GPUS} GPUs visible on ")
        assert cluster.chosen.endswith("; backend nccl")
        assert [row["device"] for row in cluster.status()] == [f"cuda:{i}" for i in range(GPUS)]


@needs_gpus(2)
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


@needs_gpus(1)
def test_the_world_panel_shows_what_a_gpu_rank_holds_on_its_device(tmp_path, monkeypatch):
    """The panel's route (server/worlds.py) asks each local GPU rank for its report, idle ones too, and
    shows the memory its allocator holds beside the device's total."""
    import time

    import nbdist
    from nbdist.cells import pointers
    from nbdist.server import worlds

    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path))
    with nbdist.start(n=1) as cluster:
        cluster.run(
            "from nbdist.parallel import device\nbig = torch.empty(256 * 2**20, dtype=torch.uint8, device=device())"
        ).raise_for_error()
        pointers.point(cluster.membership.workdir, "a-kernel")
        deadline, row = time.monotonic() + 30, {}
        while time.monotonic() < deadline:  # a hang guard: the first look asks, a later one reads
            [row] = worlds.world("a-kernel", "")["ranks"]
            if row["gpu_MiB"] is not None:
                break
            time.sleep(0.3)
        assert row["state"] == "idle" and row["device"] == "cuda:0", row
        assert row["gpu_MiB"] >= 256, row
        assert row["gpu_total_MiB"] == round(torch.cuda.get_device_properties(0).total_memory / 2**20)


@needs_gpus(1)
def test_a_killed_rank_on_a_gpu_is_rebuilt_from_the_living_one(tmp_path, on="cuda:0"):
    """Peer recovery with the model, its optimizer state, its BatchNorm buffers and its dropout draws on the GPU
    (two ranks share it over gloo, so each wraps its model in DDP itself: nbdist's device() is the CPU for a
    shared GPU): a rank killed mid-loop is rebuilt from the other's memory and the run ends equal to one run
    without a kill. The CUDA generator must come back with the part: dropout draws from it."""
    from tests.integration import test_peer_loops as loops

    ddp = "torch.nn.parallel.DistributedDataParallel("
    setup = loops.SETUP.replace("apply_ddp(", ddp).replace("torch.nn.Linear(32, 1)))", f"torch.nn.Linear(32, 1)).to({on!r}))")
    assert setup.count(on) == 1 and ddp in setup
    cell = loops.PLAIN.replace("in loader:", f"in loader:\n        x, y = x.to({on!r}), y.to({on!r})")
    cell += f"assert all(t.device == torch.device({on!r}) for t in [x, *model.parameters(), *model.buffers()])\n"
    rng = np.random.default_rng(loops.SEED)
    victim, after = int(rng.integers(0, 2)), int(rng.integers(3, 44))
    print(f"seed {loops.SEED}: rank {victim} killed after batch {after}")
    line, (final, reference), computed = loops.run_with_a_kill(tmp_path, setup, cell, victim, after)
    print(line)
    assert "memory (nothing recomputed)" in line and "not from a living rank" not in line, line
    for rank in (0, 1):
        for i, (mine, theirs) in enumerate(zip(final[rank], reference[rank], strict=True)):
            assert torch.equal(mine, theirs), (loops.SEED, rank, i, (mine - theirs).abs().max())
    assert 48 <= computed[1 - victim] <= 49, computed


@pytest.fixture(scope="module")
def two_ranks():
    import nbdist

    with nbdist.start(n=2) as cluster:  # one GPU: they share it over gloo
        yield cluster


@needs_gpus(1)
@pytest.mark.parametrize(
    "fault, devices, want, ranks",
    [
        ("none", ("cuda:0", "cuda:0"), "balanced", None),
        ("device", ("cuda:0", "cuda:0"), "compute", [1]),  # its GPU spins 20 ms in the forward, its host does not
        ("data", ("cuda:0", "cuda:0"), "data", [1]),
        ("device", ("cuda:0", "cpu"), "compute", [0]),  # a GPU rank beside a CPU rank (gloo), its GPU slowed
    ],
    ids=["balanced", "slow-gpu", "data", "slow-gpu-vs-cpu"],
)
def test_why_times_a_gpu_rank_on_its_gpu(two_ranks, fault, devices, want, ranks):
    """%dist_why on GPU ranks: the host only queues the forward, so the phases come from CUDA events, and DDP's own
    CUDA timers split backward; a rank whose device is slow is compute skew on it, not a wait elsewhere."""
    import nbdist
    from tests.why_cases import cell

    culprit = ranks[0] if ranks else -1
    verdict = nbdist.why(cell(fault, culprit, seed=0, steps=30, devices=devices), two_ranks)
    print(verdict.text)
    assert verdict.cause == want and verdict.figures.get("ranks") == ranks, verdict.text
    rows = two_ranks.last.metrics
    gpu = [r for r, dev in enumerate(devices) if dev.startswith("cuda")]
    assert all(row.get("why/cuda") == 1.0 for r in gpu for row in rows[r] if "why/step_s" in row)
    if fault == "device":
        spun = [row["why/forward_s"] for row in rows[culprit] if "why/step_s" in row][2:]
        assert min(spun) >= 0.005, spun  # the spin is in the forward's device time
        if ranks == [1]:
            assert "on its GPU (CUDA events)" in verdict.text


@needs_gpus(1)
def test_a_warm_process_with_cuda_initialised_refuses_to_fork_and_the_ranks_start_cold(tmp_path, monkeypatch, capfd):
    """CUDA initialised in the warm process (planted by a sitecustomize): a forked rank could not use CUDA, so it
    refuses to fork, says so, and the ranks start cold and use the GPU."""
    import os

    import psutil

    import nbdist
    from nbdist.config import default_threads
    from nbdist.launch import pool

    (tmp_path / "sitecustomize.py").write_text(
        "import sys\nif 'nbdist.engine.warm' in sys.orig_argv:\n    import torch\n    torch.zeros(1, device='cuda')\n"
    )
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    pool.shutdown()
    server = pool.warm(1, default_threads(1))
    try:
        with nbdist.start(n=1) as cluster:
            assert psutil.Process(cluster.ranks[0].pid).ppid() != server
            cluster.run("t = torch.ones(2, device='cuda')\ndist.all_reduce(t)\nv = t.sum().item()").raise_for_error()
            assert cluster.pull("v") == [2.0]
    finally:
        pool.shutdown()
    said = capfd.readouterr().err
    assert "cannot fork ranks safely: CUDA is initialised in it" in said, said


@needs_gpus(1)
@pytest.mark.parametrize("start", ["fork", "forkserver", "spawn"])
def test_the_device_asked_by_get_device_module_is_seen_before_a_fork_and_each_start_method_gets_the_gpu(
    tmp_path, monkeypatch, capfd, start
):
    """pytorch/pytorch#190708: ``torch.get_device_module().device_count()`` leaves torch.cuda.is_initialized() False
    and a forked child dies with 'CUDA error: initialization error'. Planted in the warm process only: it refuses,
    naming the driver, and the ranks come from a fork server. A clean fork server maps no driver (no false alarm),
    and ranks made by every start method use the GPU."""
    import os

    import psutil

    import nbdist
    from nbdist.config import default_threads
    from nbdist.engine import warm
    from nbdist.launch import pool

    pool.shutdown()
    if start == "fork":
        (tmp_path / "sitecustomize.py").write_text(
            "import sys\n"
            "if 'nbdist.engine.warm' in sys.orig_argv and '--lean' not in sys.orig_argv:\n"
            "    import torch\n"
            "    torch.get_device_module().device_count()\n"
        )
        monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        server = pool.warm(1, default_threads(1))
    try:
        with nbdist.start(n=1, start=start) as cluster:
            for p in pool.pids():  # a server that forked ranks has no driver mapped
                assert warm.accelerator_driver(f"/proc/{p}/maps") == "", psutil.Process(p).cmdline()
            cluster.run("t = torch.ones(2, device='cuda')\ndist.all_reduce(t)\nv = t.sum().item()").raise_for_error()
            assert cluster.pull("v") == [2.0]
    finally:
        pool.shutdown()
    said = capfd.readouterr().err
    if start == "fork":
        assert f"the warm process (pid {server}) cannot fork ranks safely: an accelerator's driver" in said, said
        assert "libcuda.so" in said and "They start from a fork server of their own instead" in said, said
    else:
        assert "cannot fork ranks safely" not in said, said


_REAL_RANK = """
import json, sys, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from nbdist.forecast.real import measure_here
dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
got = measure_here(sys.argv[1], sys.argv[2], repeats=1, device="cuda:0", fake_group=True)
print(json.dumps({"peak": got["peak"], "reserved_peak": got["reserved_peak"]}))
"""


@needs_gpus(1)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_forecast_on_the_gpu_comes_within_10_percent_of_a_real_rank_s_reserved_peak(strategy):
    """The issue's GPU check: %%dist_fit --device cuda (fake tensors on the GPU, nothing allocated) against one rank of
    a 2-rank world run for real on the GPU under the fake process group (torchtitan's real mode), in a process of its
    own: the caching allocator's reserved peak (torch.cuda.max_memory_reserved), and MemTracker's count, each within
    10%. About 1.3 GiB a rank for DDP, so the allocator's fixed costs (cuBLAS's workspace) stay small beside it."""
    import json
    import subprocess
    import sys

    import nbdist

    src = (
        "import torch\nmodel = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(4)])\n"
        "batch = torch.randn(256, 4096)\n"
    )
    fc = nbdist.fit(src, strategies=strategy, world_sizes=(2,), device="cuda")
    assert fc.memory == torch.cuda.get_device_properties(0).total_memory  # the GPU's memory, when none is given
    done = subprocess.run(
        [sys.executable, "-c", _REAL_RANK, src, strategy], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    real = json.loads(done.stdout.strip().splitlines()[-1])
    got = fc.peak(strategy, 2)
    print(f"{strategy}: forecast {got / 2**20:.1f} MiB, reserved {real['reserved_peak'] / 2**20:.1f} MiB, "
          f"MemTracker {real['peak'] / 2**20:.1f} MiB")
    assert abs(got / real["peak"] - 1) <= 0.10, (got, real)
    assert abs(got / real["reserved_peak"] - 1) <= 0.10, (got, real)
