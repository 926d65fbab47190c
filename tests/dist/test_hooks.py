"""Compression hooks inside a real 2-rank gloo DDP."""

from __future__ import annotations

import textwrap

import torch

from tests.helpers import SETUP

SPECS = ("fp16", "bf16", "topk:0.1", "dgc:0.1", "randomk:0.1", "qsgd:127", "signsgd", "powersgd:1")

LOOP = textwrap.dedent(
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from nbdist.parallel import apply_ddp, shard

    def run(steps=6, **kwargs):
        model = apply_ddp(make_model(), **kwargs)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step, (x, y) in zip(range(steps), shard(make_data(), 4, shuffle=False)):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        return [p.detach().clone() for p in model.module.parameters()], getattr(model, "compression_state", None)
    """
)


def test_identity_compressor_matches_allreduce_hook_bit_for_bit(cluster):
    cluster.run(SETUP + LOOP).raise_for_error()
    cluster.run("ref, _ = run(comm_hook=allreduce_hook, hook_state=None)\nmine, _ = run(compression='none')").raise_for_error()
    for ref, mine in zip(cluster.pull("ref"), cluster.pull("mine"), strict=True):
        for a, b in zip(ref, mine, strict=True):
            assert torch.equal(a, b)


def test_fp16_and_bf16_match_torchs_own_hooks_bit_for_bit_from_the_first_step(cluster):
    # Stateless casts need no warm-up: from step 0 they are torch's fp16/bf16_compress_hook.
    cluster.run(SETUP + LOOP).raise_for_error()
    # torch's bf16_compress_hook refuses gloo, so bf16's reference is its body written out
    cluster.run(
        textwrap.dedent(
            """
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

            def bf16_reference(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
                buf = bucket.buffer()
                wire = buf.to(torch.bfloat16).div_(dist.get_world_size())
                fut = dist.all_reduce(wire, async_op=True).get_future()
                return fut.then(lambda f: buf.copy_(f.value()[0]))

            ref = {n: run(comm_hook=h, hook_state=None)[0] for n, h in (("fp16", fp16_compress_hook), ("bf16", bf16_reference))}
            mine = {n: run(compression=n)[0] for n in ("fp16", "bf16")}
            plain = run(compression="none")[0]
            """
        )
    ).raise_for_error()
    for ref, mine, plain in zip(cluster.pull("ref"), cluster.pull("mine"), cluster.pull("plain"), strict=True):
        for name in ("fp16", "bf16"):
            for a, b in zip(ref[name], mine[name], strict=True):
                assert torch.equal(a, b), name
        # and the casts are really on the wire: fp32 all-reduces end elsewhere
        for name in ("fp16", "bf16"):
            assert not all(torch.equal(a, b) for a, b in zip(ref[name], plain, strict=True)), name


def test_every_hook_state_sums_its_records_per_step(cluster):
    # One record interface for every compressor, PowerSGD (torch's own hook) included.
    cluster.run(SETUP + LOOP).raise_for_error()
    cluster.push({"SPECS": SPECS})
    cluster.run("totals = {s: run(compression=s)[1].step_totals() for s in SPECS}").raise_for_error()
    for totals in cluster.pull("totals"):
        for spec, per_step in totals.items():
            assert [t["step"] for t in per_step] == list(range(6)), spec
            assert all(t["bytes_after"] <= t["bytes_before"] for t in per_step), spec
            if spec.startswith("powersgd"):
                assert all(t["hook_s"] > 0 for t in per_step)
                assert per_step[-1]["bytes_after"] < per_step[-1]["bytes_before"]  # after its 2 warm-up steps
            else:
                assert all(t["collective_s"] > 0 and "compress_s" in t for t in per_step), spec


def test_every_compressor_keeps_replicas_identical_and_reports_the_bytes_it_sends(cluster):
    cluster.run(SETUP + LOOP).raise_for_error()
    cluster.push({"SPECS": SPECS})
    cluster.run(
        "out = {}\n"
        "for spec in SPECS:\n"
        "    params, state = run(compression=spec)\n"
        "    out[spec] = (params, [(r['step'], r['bytes_before'], r['bytes_after']) for r in state.records])"
    ).raise_for_error()
    r0, r1 = cluster.pull("out")
    d = sum(p.numel() for p in r0["fp16"][0])  # one bucket holds every gradient of this small model
    for spec in SPECS:
        for a, b in zip(r0[spec][0], r1[spec][0], strict=True):
            assert torch.equal(a, b), f"{spec}: replicas diverged"
        records = r0[spec][1]
        assert records and all(before == 4 * d for _, before, _ in records)
        late = [after for step, _, after in records if step >= 2]  # after the warm-up iterations
        k = -(-d // 10)  # ceil(0.1 d)
        expected = {
            "fp16": 2 * d, "bf16": 2 * d, "topk:0.1": 8 * k, "dgc:0.1": 8 * k, "randomk:0.1": 4 * k,
            "qsgd:127": d + 4 * -(-d // 512), "signsgd": (d + 7) // 8 + 4,
        }
        if spec in expected:
            assert late and all(a == expected[spec] for a in late), (spec, late[:2], expected[spec])
        else:
            assert late and all(a < 4 * d for a in late)


def test_hook_result_is_the_mean_of_the_decompressed_payloads(cluster):
    cluster.run(
        textwrap.dedent(
            """
            from nbdist.compression import make_hook
            class FakeBucket:
                def __init__(self, t): self.t = t
                def buffer(self): return self.t
                def index(self): return 0
                def is_last(self): return True
            g = torch.Generator().manual_seed(dist.get_rank())
            grad = torch.randn(100, generator=g)
            res = {}
            for spec in ("topk:0.05", "randomk:0.05", "signsgd", "qsgd:16"):
                hook, state = make_hook(spec, start_iter=0)
                out = hook(state, FakeBucket(grad.clone())).wait().clone()
                sent = grad - state.residuals[0] if state.compressor.error_feedback else None
                res[spec] = (out, sent)
            """
        )
    ).raise_for_error()
    r0, r1 = cluster.pull("res")
    for spec in ("topk:0.05", "randomk:0.05", "signsgd"):
        expected = (r0[spec][1] + r1[spec][1]) / 2
        torch.testing.assert_close(r0[spec][0], expected, rtol=0, atol=1e-6)
        torch.testing.assert_close(r1[spec][0], expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(r0["qsgd:16"][0], r1["qsgd:16"][0], rtol=0, atol=0)


def test_dgc_hook_follows_the_momentum_correction_recurrence(cluster):
    """Six steps of known per-rank gradients through the real hook on both ranks, against
    DGC's recurrence computed here in float64: u = m u + g; v += u; send top-k of v;
    clear the sent entries of v and u; the result is the mean of what the ranks sent."""
    d, k, m, steps = 200, 10, 0.9, 6
    code = textwrap.dedent(
        f"""
        from nbdist.compression import make_hook
        class FakeBucket:
            def __init__(self, t): self.t = t
            def buffer(self): return self.t
            def index(self): return 0
            def is_last(self): return True
        hook, state = make_hook("dgc:{k / d}:{m}", start_iter=0)
        g = torch.Generator().manual_seed(100 + dist.get_rank())
        outs = [hook(state, FakeBucket(torch.randn({d}, generator=g))).wait().clone() for _ in range({steps})]
        """
    )
    cluster.run(code).raise_for_error()
    got = cluster.pull("outs")
    grads = []
    for rank in range(2):
        g = torch.Generator().manual_seed(100 + rank)
        grads.append([torch.randn(d, generator=g).double() for _ in range(steps)])
    u = [torch.zeros(d, dtype=torch.float64) for _ in range(2)]
    v = [torch.zeros(d, dtype=torch.float64) for _ in range(2)]
    for step in range(steps):
        mean = torch.zeros(d, dtype=torch.float64)
        for r in range(2):
            u[r] = m * u[r] + grads[r][step]
            v[r] += u[r]
            idx = torch.topk(v[r].abs(), k).indices
            mean[idx] += v[r][idx] / 2
            v[r][idx] = 0.0
            u[r][idx] = 0.0
        for r in range(2):
            torch.testing.assert_close(got[r][step].double(), mean, rtol=1e-5, atol=1e-5)
        assert int((mean != 0).sum()) <= 2 * k


def test_the_one_pass_top_k_trains_exactly_as_the_torch_ops_it_replaces(cluster):
    """topk and dgc on the CPU run error feedback, selection and the zeroing of the bucket in
    one Numba pass (kernels.topk_feedback_into); in real DDP the parameters after 8 steps
    equal, bit for bit, those of the same hook running the torch ops it replaces."""
    cluster.run(
        textwrap.dedent(
            """
            from nbdist.compression.base import Compressor
            from nbdist.compression.compressors import TopK
            from nbdist.parallel import apply_ddp

            def train(spec):  # 8449 parameters: the selection's threshold comes from a sample
                torch.manual_seed(0)
                model = apply_ddp(torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(),
                                                      torch.nn.Linear(128, 1)), compression=spec, metrics=False)
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                g = torch.Generator().manual_seed(dist.get_rank())
                for _ in range(8):
                    opt.zero_grad()
                    model(torch.randn(32, 64, generator=g)).square().mean().backward()
                    opt.step()
                return [p.detach().clone() for p in model.parameters()]

            from nbdist.compression import compressors
            kernel, calls = compressors.kernels.topk_feedback_into, []
            compressors.kernels.topk_feedback_into = lambda *a: calls.append(1) or kernel(*a)
            try:
                fused = {s: train(s) for s in ("topk:0.01", "dgc:0.01")}
            finally:
                compressors.kernels.topk_feedback_into = kernel
            n_calls = len(calls)
            one_pass = TopK.compress_feedback
            TopK.compress_feedback = Compressor.compress_feedback
            try:
                torch_ops = {s: train(s) for s in ("topk:0.01", "dgc:0.01")}
            finally:
                TopK.compress_feedback = one_pass
            """
        )
    ).raise_for_error()
    assert cluster.pull("n_calls") == [2 * 6, 2 * 6]  # each spec's 6 steps after its 2 warm-up steps
    for fused, torch_ops in zip(cluster.pull("fused"), cluster.pull("torch_ops"), strict=True):
        for spec in ("topk:0.01", "dgc:0.01"):
            for a, b in zip(fused[spec], torch_ops[spec], strict=True):
                assert torch.equal(a, b), spec


def test_dgc_closes_the_gap_top_k_leaves_under_momentum(cluster):
    """Notebook 05's task and settings (150 steps, lr 0.1, momentum 0.9, 1% of entries):
    top-k with error feedback under the optimizer's momentum ends far behind; DGC (the
    momentum moved into the hook, the optimizer without it) ends within 2% of, or below,
    uncompressed training. Losses: all data, mean of the last 10 steps. Measured here:
    none 0.138, topk +720%, dgc -11%."""
    cluster.run(
        textwrap.dedent(
            """
            import torch
            from nbdist.parallel import apply_ddp
            def make_model():
                torch.manual_seed(0)
                return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                           torch.nn.ReLU(), torch.nn.Linear(512, 10))
            g = torch.Generator().manual_seed(0)
            W = torch.randn(256, 10, generator=g)
            X = torch.randn(4096, 256, generator=g)
            Y = (X @ W).argmax(1)
            Xr, Yr = X[dist.get_rank()::2], Y[dist.get_rank()::2]
            final = {}
            for spec, momentum in (("none", 0.9), ("topk:0.01", 0.9), ("dgc:0.01", 0.0)):
                model = apply_ddp(make_model(), compression=spec, metrics=False)
                opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
                losses = []
                for step in range(150):
                    i = (step * 64) % (Xr.shape[0] - 64)
                    opt.zero_grad()
                    torch.nn.functional.cross_entropy(model(Xr[i:i + 64]), Yr[i:i + 64]).backward()
                    opt.step()
                    if step >= 140:
                        with torch.no_grad():
                            losses.append(torch.nn.functional.cross_entropy(model.module(X), Y).item())
                final[spec] = sum(losses) / len(losses)
            """
        )
    ).raise_for_error()
    final = cluster.pull("final", ranks=0)[0]
    base = final["none"]
    assert final["dgc:0.01"] <= 1.02 * base, final
    assert final["topk:0.01"] > 2 * base, final  # the gap DGC exists to close


def test_every_compressor_reaches_the_uncompressed_loss(cluster):
    """400 steps of the same task; final full-data loss within 2% of no compression.

    2% is the issue's bar; measured gaps are under 1%. (At lr 0.2 random-k with error
    feedback diverges here: its residual releases ~10 steps of gradient at once.)"""
    cluster.run(SETUP).raise_for_error()
    cluster.run(
        textwrap.dedent(
            """
            from nbdist.parallel import apply_ddp, shard
            data = make_data(512)
            batches = list(shard(data, 16, shuffle=False))
            final = {}
            for spec in ("none", "fp16", "bf16", "topk:0.1", "randomk:0.1", "qsgd:127", "signsgd", "powersgd:2"):
                model = apply_ddp(make_model(), compression=spec)
                opt = torch.optim.SGD(model.parameters(), lr=0.05)
                for step in range(400):
                    x, y = batches[step % len(batches)]
                    opt.zero_grad()
                    torch.nn.functional.mse_loss(model(x), y).backward()
                    opt.step()
                X, Y = data[:]
                final[spec] = torch.nn.functional.mse_loss(model(X), Y).item()
            """
        )
    ).raise_for_error()
    final = cluster.pull("final", ranks=0)[0]
    base = final.pop("none")
    for spec, loss in final.items():
        assert abs(loss - base) <= 0.02 * base, f"{spec}: final loss {loss:.5f} vs uncompressed {base:.5f}"


def test_the_gpu_path_trains_like_the_cpu_path_in_real_ddp(cluster):
    """The torch-op kernels (what CUDA buckets use) forced on the CPU: replicas stay identical
    and the deterministic compressors give the Numba path's parameters."""
    cluster.run(SETUP + LOOP).raise_for_error()
    cluster.run(
        textwrap.dedent(
            """
            import nbdist.compression.base as B
            out = {}
            numba_on_cpu = B.uses_torch_ops
            try:
                for backend in ("torch", "auto"):
                    B.uses_torch_ops = (lambda t: True) if backend == "torch" else numba_on_cpu
                    for spec in ("topk:0.1", "dgc:0.1", "signsgd", "qsgd:127"):
                        out[backend, spec] = run(compression=spec)[0]
            finally:
                B.uses_torch_ops = numba_on_cpu
            """
        )
    ).raise_for_error()
    r0, r1 = cluster.pull("out")
    for key in r0:
        for a, b in zip(r0[key], r1[key], strict=True):
            assert torch.equal(a, b), f"{key}: replicas diverged"
    for spec in ("topk:0.1", "dgc:0.1", "signsgd"):  # deterministic: both paths send the same payloads
        for a, b in zip(r0["torch", spec], r0["auto", spec], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_corrupt_payload_raises_on_the_rank_that_reads_it_and_crashes_no_rank(cluster):
    """An index past the end of the bucket in what rank 1 sent (a damaged payload) would make the
    Numba scatter write out of bounds; the rank that decodes it raises, naming both ranks and the
    compressor, and stays alive for the next cell (issue 31)."""
    cluster.run(SETUP + LOOP).raise_for_error()
    damage = textwrap.dedent(
        """
        from nbdist.compression.compressors import TopK
        original = TopK.decompress

        def damaged(self, got):
            if dist.get_rank() == 0:
                got.result[1] = got.result[1].clone()
                got.result[1][self.k(got.d):].view(torch.int32)[0] = 10**9
            return original(self, got)

        TopK.decompress = damaged
        try:
            run(compression="topk:0.1")
        finally:
            TopK.decompress = original
        """
    )
    result = cluster.run(damage, quiet=True)
    assert [r.status.value for r in result.ranks] == ["error", "interrupted"], result  # rank 1 released
    said = str(result[0].error["evalue"])
    assert "rank 0 received a corrupt topk payload from rank 1: index 1000000000 (entry 0) is outside" in said
    assert cluster.dead_ranks() == []
    cluster.run("dist.all_reduce(torch.ones(1))").raise_for_error()  # the world goes on
