"""Compression hooks inside a real 2-rank gloo DDP. What the ranks run is in programs.py."""

from __future__ import annotations

import torch

from tests.dist import programs
from tests.helpers import on_ranks

SPECS = ("fp16", "bf16", "topk:0.1", "dgc:0.1", "randomk:0.1", "qsgd:127", "signsgd", "powersgd:1")


def test_identity_compressor_matches_allreduce_hook_bit_for_bit(cluster):
    _, per_rank = on_ranks(cluster, programs.identity_and_allreduce)
    for ref, mine in per_rank:
        for a, b in zip(ref, mine, strict=True):
            assert torch.equal(a, b)


def test_fp16_and_bf16_match_torchs_own_hooks_bit_for_bit_from_the_first_step(cluster):
    # Stateless casts need no warm-up: from step 0 they are torch's fp16/bf16_compress_hook.
    # torch's bf16_compress_hook refuses gloo, so bf16's reference is its body written out (programs.bf16_reference)
    _, per_rank = on_ranks(cluster, programs.casts_and_torch_hooks)
    for ref, mine, plain in per_rank:
        for name in ("fp16", "bf16"):
            for a, b in zip(ref[name], mine[name], strict=True):
                assert torch.equal(a, b), name
        # and the casts are really on the wire: fp32 all-reduces end elsewhere
        for name in ("fp16", "bf16"):
            assert not all(torch.equal(a, b) for a, b in zip(ref[name], plain, strict=True)), name


def test_every_hook_state_sums_its_records_per_step(cluster):
    # One record interface for every compressor, PowerSGD (torch's own hook) included.
    _, per_rank = on_ranks(cluster, programs.step_totals, SPECS)
    for totals in per_rank:
        for spec, per_step in totals.items():
            assert [t["step"] for t in per_step] == list(range(6)), spec
            assert all(t["bytes_after"] <= t["bytes_before"] for t in per_step), spec
            if spec.startswith("powersgd"):
                assert all(t["hook_s"] > 0 for t in per_step)
                assert per_step[-1]["bytes_after"] < per_step[-1]["bytes_before"]  # after its 2 warm-up steps
            else:
                assert all(t["collective_s"] > 0 and "compress_s" in t for t in per_step), spec


def test_every_compressor_keeps_replicas_identical_and_reports_the_bytes_it_sends(cluster):
    _, (r0, r1) = on_ranks(cluster, programs.records_per_spec, SPECS)
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
    _, (r0, r1) = on_ranks(cluster, programs.hook_means)
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
    _, got = on_ranks(cluster, programs.dgc_outputs, d, k, m, steps)
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
    _, per_rank = on_ranks(cluster, programs.one_pass_and_torch_ops)
    assert [calls for calls, _, _ in per_rank] == [2 * 6, 2 * 6]  # each spec's 6 steps after its 2 warm-up steps
    for _, fused, torch_ops in per_rank:
        for spec in ("topk:0.01", "dgc:0.01"):
            for a, b in zip(fused[spec], torch_ops[spec], strict=True):
                assert torch.equal(a, b), spec


def test_dgc_closes_the_gap_top_k_leaves_under_momentum(cluster):
    """Notebook 05's task and settings (150 steps, lr 0.1, momentum 0.9, 1% of entries):
    top-k with error feedback under the optimizer's momentum ends far behind; DGC (the
    momentum moved into the hook, the optimizer without it) ends within 2% of, or below,
    uncompressed training. Losses: all data, mean of the last 10 steps. Measured here:
    none 0.138, topk +720%, dgc -11%."""
    _, (final, _) = on_ranks(cluster, programs.momentum_task_losses)
    base = final["none"]
    assert final["dgc:0.01"] <= 1.02 * base, final
    assert final["topk:0.01"] > 2 * base, final  # the gap DGC exists to close


def test_every_compressor_reaches_the_uncompressed_loss(cluster):
    """400 steps of the same task; final full-data loss within 2% of no compression.

    2% is the issue's bar; measured gaps are under 1%. (At lr 0.2 random-k with error
    feedback diverges here: its residual releases ~10 steps of gradient at once.)"""
    _, (final, _) = on_ranks(cluster, programs.final_losses)
    base = final.pop("none")
    for spec, loss in final.items():
        assert abs(loss - base) <= 0.02 * base, f"{spec}: final loss {loss:.5f} vs uncompressed {base:.5f}"


def test_the_gpu_path_trains_like_the_cpu_path_in_real_ddp(cluster):
    """The torch-op kernels (what CUDA buckets use) forced on the CPU: replicas stay identical
    and the deterministic compressors give the Numba path's parameters."""
    _, (r0, r1) = on_ranks(cluster, programs.torch_ops_and_numba)
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
    result, _ = on_ranks(cluster, programs.corrupt_topk, check=False, quiet=True)
    assert [r.status.value for r in result.ranks] == ["error", "interrupted"], result  # rank 1 released
    said = str(result[0].error["evalue"])
    assert "rank 0 received a corrupt topk payload from rank 1: index 1000000000 (entry 0) is outside" in said
    assert cluster.dead_ranks() == []
    cluster.run("dist.all_reduce(torch.ones(1))").raise_for_error()  # the world goes on
