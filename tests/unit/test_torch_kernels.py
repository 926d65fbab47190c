"""The torch-op kernels (the GPU path) against the Numba kernels, run on the CPU here and
on a GPU when there is one. Same bit layouts, so payloads decode alike on either path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nbdist.compression import base
from nbdist.compression import compressors as C
from nbdist.compression import kernels as K
from nbdist.compression import quantizers as Q
from nbdist.compression import torch_kernels as T

# On a GPU (``pytest -m gpu tests``) the CUDA case runs the fused Triton kernels and the sampled top-k.
CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
)
DEVICES = ["cpu", CUDA]


@pytest.fixture
def x():
    return np.random.default_rng(3).standard_normal(10_007).astype(np.float32)  # not a multiple of 8 or 512


@pytest.mark.parametrize("device", DEVICES)
def test_sign_pack_matches_numpy_packbits_and_the_numba_kernel(x, device):
    packed, scale = T.sign_pack(torch.from_numpy(x).to(device))
    np.testing.assert_array_equal(packed.cpu().numpy(), np.packbits(x >= 0))
    ref = np.empty(packed.numel(), np.uint8)
    assert scale == pytest.approx(K.sign_pack(x, ref), rel=1e-5)
    base = np.random.default_rng(1).standard_normal(x.size).astype(np.float32)
    mine = torch.from_numpy(base.copy()).to(device)
    T.sign_unpack_add(packed, scale, 0.5, mine)
    K.sign_unpack_add(ref, scale, 0.5, base)
    np.testing.assert_allclose(mine.cpu().numpy(), base, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_qsgd_norms_levels_and_dequantize_match_the_numba_layout(x, device):
    xt = torch.from_numpy(x).to(device)
    levels, norms = T.qsgd_quantize(xt, 16, 5)
    ref_levels = np.empty(x.size, np.int8)
    ref_norms = K.qsgd_quantize(x, 16, 5, ref_levels, np.empty(K.qsgd_chunks(x.size), np.float32))
    np.testing.assert_allclose(norms.cpu().numpy(), ref_norms, rtol=1e-6)
    assert levels.dtype == torch.int8 and levels.abs().max() <= 16
    # same levels decode the same way on both paths
    out = torch.zeros(x.size, device=device)
    T.qsgd_dequantize_add(torch.from_numpy(ref_levels).to(device), torch.from_numpy(ref_norms).to(device), 16, 0.5, out)
    ref = K.qsgd_dequantize_add(ref_levels, ref_norms, 16, 0.5, np.zeros(x.size, np.float32))
    np.testing.assert_allclose(out.cpu().numpy(), ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_qsgd_is_unbiased(device):
    x = torch.from_numpy(np.random.default_rng(4).standard_normal(1300).astype(np.float32)).to(device)
    s, n = 4, 2000
    total = torch.zeros(1300, dtype=torch.float64, device=device)
    for seed in range(n):
        levels, norms = T.qsgd_quantize(x, s, seed)
        out = torch.zeros(1300, device=device)
        total += T.qsgd_dequantize_add(levels, norms, s, 1.0, out).double()
    step = torch.repeat_interleave(norms.double() / s, torch.tensor([512, 512, 276], device=device))
    assert torch.all((total / n - x.double()).abs() <= 5 * step / 2 / np.sqrt(n))  # 5 sigma
    a, _ = T.qsgd_quantize(x, s, 7)
    b, _ = T.qsgd_quantize(x, s, 7)
    assert torch.equal(a, b)  # the same seed draws the same levels


@pytest.mark.parametrize("device", DEVICES)
def test_torch_topk_keeps_the_k_largest(x, device):
    vals, idx = T.topk(torch.from_numpy(x).to(device), 100)
    ref_vals, _ = K.topk(x, 100)
    assert idx.dtype == torch.int32 and torch.all(idx[1:] > idx[:-1])
    np.testing.assert_array_equal(np.sort(np.abs(vals.cpu().numpy())), np.sort(np.abs(ref_vals)))
    np.testing.assert_array_equal(vals.cpu().numpy(), x[idx.cpu().numpy()])


@pytest.mark.parametrize("device", DEVICES)
def test_topk_from_a_sampled_threshold_is_exact(device):
    """Above 2**20 entries the top-k is chosen among the entries over a threshold estimated from a
    sample: the same entries as a top-k over all of them, gradients with layers of different scales
    included."""
    rng = np.random.default_rng(8)
    d = 2**21 + 5
    x = rng.standard_normal(d).astype(np.float32)
    x[: d // 3] *= 1e-3  # a layer whose gradients are much smaller
    xt = torch.from_numpy(x).to(device)
    for k in (1, d // 1000, d // 100, d // 10):
        assert k == 1 or T.above_estimate(xt, k) is not None  # the sampled threshold served
        vals, idx = T.topk(xt, k)
        ref = np.sort(np.argpartition(-np.abs(x), k - 1)[:k])
        np.testing.assert_array_equal(idx.cpu().numpy(), ref)
        np.testing.assert_array_equal(vals.cpu().numpy(), x[ref])


@pytest.mark.parametrize("device", DEVICES)
def test_topk_when_the_sample_misleads_falls_back_to_all_entries(device):
    """The sample is every (d // SAMPLE)-th entry: large values only there make the estimated
    threshold select fewer than k; the answer must still be the exact top-k. Zeros everywhere
    else (a threshold of 0 that would select everything) likewise."""
    d = 2**21
    stride = d // T.SAMPLE
    x = np.random.default_rng(9).standard_normal(d).astype(np.float32) * 1e-3
    x[::stride] = 100 + np.arange(d // stride, dtype=np.float32)
    k = d // 100
    assert T.above_estimate(torch.from_numpy(x), k) is None  # the estimate is refused ...
    _, idx = T.topk(torch.from_numpy(x).to(device), k)
    np.testing.assert_array_equal(idx.cpu().numpy(), np.sort(np.argpartition(-np.abs(x), k - 1)[:k]))  # ... exact
    sparse = np.zeros(d, np.float32)
    sparse[12345::7919] = 1.0
    _, idx = T.topk(torch.from_numpy(sparse).to(device), 10)
    assert torch.all(torch.from_numpy(sparse)[idx.cpu().long()] == 1.0) and idx.numel() == 10


NUMBA_ON_CPU = base.uses_torch_ops  # the library's choice: torch ops off the CPU only


@pytest.fixture
def torch_backend(monkeypatch):
    monkeypatch.setattr(base, "uses_torch_ops", lambda t: True)


@pytest.mark.parametrize(
    "make", [lambda: C.TopK(0.05), lambda: Q.Sign(), lambda: Q.QSGD(127)], ids=["topk", "sign", "qsgd"]
)
def test_compressors_on_the_torch_path_decode_like_the_numba_path(make, torch_backend, monkeypatch):
    g = torch.from_numpy(np.random.default_rng(6).standard_normal(3000).astype(np.float32))
    comp = make()
    payload_t = comp.compress(g.clone(), seed=1, world=2)
    mean_t = comp.decompress(base.Received([payload_t.tensor, payload_t.tensor], 3000, 2))
    monkeypatch.setattr(base, "uses_torch_ops", NUMBA_ON_CPU)
    mean_n = comp.decompress(base.Received([payload_t.tensor, payload_t.tensor], 3000, 2))  # the other path decodes it
    torch.testing.assert_close(mean_t, mean_n, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(mean_t, payload_t.sent, rtol=1e-6, atol=1e-6)  # the mean of two equal parts
    if not isinstance(comp, Q.QSGD):  # deterministic compressors: the same payload on both paths
        payload_n = comp.compress(g.clone(), seed=1, world=2)
        torch.testing.assert_close(payload_t.sent, payload_n.sent, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("comp", [C.TopK(0.05), Q.Sign(True)], ids=lambda c: c.describe())
def test_error_feedback_telescopes_on_the_torch_path(comp, torch_backend):
    rng = np.random.default_rng(0)
    residual = torch.zeros(500)
    sent_total = torch.zeros(500, dtype=torch.float64)
    raw_total = torch.zeros(500, dtype=torch.float64)
    for step in range(50):
        g = torch.from_numpy(rng.standard_normal(500).astype(np.float32))
        raw_total += g.double()
        residual += g  # as the hook does: the residual becomes the corrected gradient
        payload = comp.compress(residual, seed=step, world=1)
        sent_total += payload.sent.double()
        comp.keep_residual(residual, payload)
    torch.testing.assert_close(sent_total + residual.double(), raw_total, rtol=0, atol=1e-4)
