"""Compression kernels against numpy references and the properties the hooks rely on."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from nbdist.compression import kernels as K

finite = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False, width=32)


def sign_pack(x):
    packed = np.empty((x.size + 7) // 8, np.uint8)
    return packed, K.sign_pack(x, packed)


def sign_unpack(packed, d, scale):
    return K.sign_unpack(packed, scale, np.empty(d, np.float32))


def qsgd(x, s, seed):
    q = np.empty(x.size, np.int8)
    return q, K.qsgd_quantize(x, s, seed, q, np.empty(K.qsgd_chunks(x.size), np.float32))


def dequantize(q, norms, s):
    return K.qsgd_dequantize(q, norms, s, np.empty(q.size, np.float32))


@settings(max_examples=60, deadline=None)
@given(
    x=arrays(np.float32, st.integers(1, 3000), elements=finite), frac=st.floats(0.0, 1.0), seed=st.integers(0, 2**31)
)
def test_topk_keeps_exactly_the_k_largest_and_contracts(x, frac, seed):
    d = x.size
    k = int(frac * d)
    vals, idx = K.topk(x, k, seed)
    assert idx.size == k and vals.size == k
    assert np.all(np.diff(idx) > 0)  # distinct, increasing
    np.testing.assert_array_equal(vals, x[idx])
    rest = np.delete(np.abs(x), idx)
    if k and rest.size:
        assert np.abs(vals).min() >= rest.max()  # nothing left out is larger (ties allowed)
    # contraction: ||x - C(x)||^2 <= (1 - k/d) ||x||^2
    x64 = x.astype(np.float64)
    err = x64.copy()
    err[idx] = 0.0
    assert (err**2).sum() <= (1 - k / d) * (x64**2).sum() * (1 + 1e-9) + 1e-12


def test_topk_matches_numpy_on_distinct_values():
    x = np.random.default_rng(1).standard_normal(100_000).astype(np.float32)
    for k in (1, 10, 1000, 99_999):
        _, idx = K.topk(x, k, 7)
        np.testing.assert_array_equal(idx, np.sort(np.argpartition(-np.abs(x), k - 1)[:k]))


def _layered(rng, d):
    """A bucket of several layers whose gradients differ in scale by up to 1e6."""
    x = rng.standard_normal(d).astype(np.float32)
    for part, scale in zip(np.array_split(np.arange(d), 4), (1e3, 1e-3, 1.0, 3.0), strict=True):
        x[part] *= scale
    return x


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda rng, d: rng.standard_normal(d).astype(np.float32), id="normal"),
        pytest.param(_layered, id="layered-scales"),
        pytest.param(lambda rng, d: rng.standard_cauchy(d).astype(np.float32), id="heavy-tailed"),
        pytest.param(lambda rng, d: (rng.random(d) < 0.003).astype(np.float32) * 5, id="mostly-zero"),
        pytest.param(lambda rng, d: np.full(d, 0.5, np.float32), id="all-ties"),
        pytest.param(lambda rng, d: np.where(rng.random(d) < 0.5, -0.0, 0.0).astype(np.float32), id="all-zero"),
        pytest.param(lambda rng, d: np.sign(rng.standard_normal(d)).astype(np.float32), id="two-values"),
        pytest.param(lambda rng, d: np.sort(np.abs(rng.standard_normal(d))).astype(np.float32), id="sorted"),
    ],
)
@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.2])
def test_topk_is_exact_on_inputs_that_mislead_the_sampled_threshold(make, ratio):
    # Large enough that the threshold is estimated from sampled blocks; the estimate may be
    # off (layers, ties, sorted data), and the kernel must still return exactly the top k.
    rng = np.random.default_rng(5)
    d = 200_003
    x = make(rng, d)
    k = int(ratio * d)
    vals, idx = K.topk(x, k, 11)
    assert idx.size == k and np.all(np.diff(idx) > 0)
    np.testing.assert_array_equal(vals, x[idx])
    expect = np.sort(np.abs(x))[::-1][:k]  # the k largest magnitudes, ties included
    np.testing.assert_array_equal(np.sort(np.abs(vals))[::-1], expect)
    kth = expect[-1]
    ties = np.flatnonzero(np.abs(x) == kth)
    taken = np.intersect1d(idx, ties)
    np.testing.assert_array_equal(taken, ties[: taken.size])  # ties: the lowest indices


@pytest.mark.parametrize("workspace", ["planned", "one-entry"])
def test_topk_into_reuses_caller_buffers_and_grows_a_short_workspace(workspace):
    # The hooks call topk_into with one set of buffers per bucket, step after step: the
    # result must not depend on what the buffers held, and a workspace too small for the
    # candidates (here a single entry) must not truncate the answer.
    rng = np.random.default_rng(9)
    d, k = 300_001, 3000
    w = K.topk_workspace(d, k) if workspace == "planned" else 1
    vals, idx = np.full(k, np.nan, np.float32), np.full(k, -1, np.int32)
    cand_vals, cand_idx = np.full(w, 1e30, np.float32), np.full(w, 7, np.int32)
    for step in range(3):
        x = (rng.standard_normal(d) * (step + 1)).astype(np.float32)
        K.topk_into(x, k, step, vals, idx, cand_vals, cand_idx)
        np.testing.assert_array_equal(idx, np.sort(np.argpartition(-np.abs(x), k - 1)[:k]))
        np.testing.assert_array_equal(vals, x[idx])


def test_scatter_rebuilds_the_dense_vector():
    x = np.random.default_rng(2).standard_normal(50).astype(np.float32)
    vals, idx = K.topk(x, 5)
    dense = K.scatter(vals, idx, np.full(50, 7.0, np.float32))  # the buffer's old contents are cleared
    assert np.count_nonzero(dense) == 5 and np.array_equal(dense[idx], vals)


def test_randomk_indices_are_distinct_sorted_and_shared_per_seed():
    a = K.randomk_indices(1000, 50, 42)
    assert a.size == 50 and np.all(np.diff(a) > 0) and a.min() >= 0 and a.max() < 1000
    assert np.array_equal(a, K.randomk_indices(1000, 50, 42))
    assert not np.array_equal(a, K.randomk_indices(1000, 50, 43))
    assert np.array_equal(K.randomk_indices(10, 20, 1), np.arange(10))


def test_scaled_randomk_is_unbiased():
    rng = np.random.default_rng(3)
    d, k, n = 64, 8, 4000
    x = rng.standard_normal(d)
    total = np.zeros(d)
    for seed in range(n):
        idx = K.randomk_indices(d, k, seed)
        total[idx] += x[idx] * d / k
    mean = total / n
    # each coordinate: (d/k) x_i with prob k/d, else 0 -> std x_i sqrt(d/k - 1); 5 sigma over n draws
    bound = 5 * np.abs(x) * np.sqrt(d / k - 1) / np.sqrt(n)
    assert np.all(np.abs(mean - x) <= bound + 1e-12)


@pytest.mark.parametrize("d", [1, 7, 8, 9, 1001])
def test_sign_pack_is_one_bit_per_element(d):
    x = np.random.default_rng(d).standard_normal(d).astype(np.float32)
    packed, scale = sign_pack(x)
    assert packed.dtype == np.uint8 and packed.size == (d + 7) // 8
    np.testing.assert_array_equal(packed, np.packbits(x >= 0))
    assert scale == pytest.approx(np.abs(x).mean(), rel=1e-6)
    out = sign_unpack(packed, d, scale)
    np.testing.assert_array_equal(np.sign(out), np.where(x >= 0, 1.0, -1.0))
    assert np.allclose(np.abs(out), scale)


def test_qsgd_is_unbiased_and_deterministic_per_seed():
    rng = np.random.default_rng(4)
    x = rng.standard_normal(1300).astype(np.float32)  # three chunks, the last one short
    x[512:1024] *= 100  # chunks of very different scale
    s, n = 4, 3000
    q0, norms0 = qsgd(x, s, 11)
    q1, _ = qsgd(x, s, 11)
    assert q0.dtype == np.int8 and np.array_equal(q0, q1)
    assert np.abs(q0).max() <= s
    chunks = np.split(x.astype(np.float64), [512, 1024])
    np.testing.assert_allclose(norms0, [np.linalg.norm(c) for c in chunks], rtol=1e-6)
    total = np.zeros(x.size)
    for seed in range(n):
        q, norms = qsgd(x, s, seed)
        total += dequantize(q, norms, s)
    mean = total / n
    # stochastic rounding to a grid of norm/s: variance <= (norm/s)^2 / 4 per draw; 5 sigma
    step = np.repeat(norms0 / s, [512, 512, 276])
    bound = 5 * step / 2 / np.sqrt(n)
    assert np.all(np.abs(mean - x) <= bound)


def test_qsgd_variance_is_bounded_per_chunk():
    # The QSGD bound with chunks of n entries: E||Q(x) - x||^2 <= min(n / s^2, sqrt(n) / s) ||x||^2.
    # One norm for the whole vector would allow d / s^2 (here 400x more).
    rng = np.random.default_rng(8)
    x = rng.standard_normal(200_000).astype(np.float32)
    s = 127
    q, norms = qsgd(x, s, 1)
    err = ((dequantize(q, norms, s) - x).astype(np.float64) ** 2).sum()
    bound = min(K.QSGD_CHUNK / s**2, np.sqrt(K.QSGD_CHUNK) / s) * (x.astype(np.float64) ** 2).sum()
    assert err <= bound


def test_qsgd_never_rounds_past_s_levels():
    x = np.zeros(512, np.float32)
    x[0] = 1.0  # the whole norm in one entry: |x| / norm * s == s exactly
    for seed in range(50):
        q, _ = qsgd(x, 127, seed)
        assert q[0] == 127


def test_qsgd_of_zero_is_zero():
    q, norms = qsgd(np.zeros(10, np.float32), 8, 0)
    assert not norms.any() and not q.any()


def test_uniforms_look_uniform():
    u = K.uniforms(123, 100_000)
    assert u.min() >= 0 and u.max() < 1
    assert abs(u.mean() - 0.5) < 0.005 and abs(u.var() - 1 / 12) < 0.002
    assert np.array_equal(u, K.uniforms(123, 100_000))


def test_accumulating_decoders_match_decode_then_add():
    rng = np.random.default_rng(9)
    x = rng.standard_normal(1003).astype(np.float32)
    base = rng.standard_normal(1003).astype(np.float32)
    q, norm = qsgd(x, 127, 3)
    out = base.copy()
    K.qsgd_dequantize_add(q, norm, 127, 0.5, out)
    np.testing.assert_allclose(out, base + 0.5 * dequantize(q, norm, 127), rtol=1e-6, atol=1e-6)
    packed, scale = sign_pack(x)
    out = base.copy()
    K.sign_unpack_add(packed, scale, 0.25, out)
    np.testing.assert_allclose(out, base + 0.25 * sign_unpack(packed, x.size, scale), rtol=1e-6, atol=1e-6)
    vals, idx = K.topk(x, 50)
    out = base.copy()
    K.scatter_add(vals, idx, 0.5, out)
    expect = base.copy()
    expect[idx] += 0.5 * vals
    np.testing.assert_allclose(out, expect, rtol=1e-6, atol=1e-6)
    out = np.full(1003, np.nan, np.float32)  # the weighted decoder writes every entry: no zeroing first
    K.qsgd_dequantize(q, norm, 127, out, 0.5)
    np.testing.assert_allclose(out, 0.5 * dequantize(q, norm, 127), rtol=1e-6, atol=1e-6)


def _torch_feedback(x, g, v, momentum, k, seed):
    """What the hook did before topk_feedback_into, in torch ops: x += g (or v = m v + g;
    x += v), top-k of x, the sent entries cleared from x and v."""
    xt, gt, vt = torch.from_numpy(x), torch.from_numpy(g), torch.from_numpy(v)
    if momentum:
        xt += vt.mul_(momentum).add_(gt)
    else:
        xt += gt
    vals, idx = K.topk(x, k, seed)
    sent = torch.from_numpy(idx).long()
    xt.index_fill_(0, sent, 0.0)
    if momentum:
        vt.index_fill_(0, sent, 0.0)
    return vals, idx


FEEDBACK_INPUTS = [
    pytest.param(lambda rng, d: rng.standard_normal(d).astype(np.float32), id="normal"),
    pytest.param(_layered, id="layered-scales"),
    pytest.param(lambda rng, d: rng.standard_cauchy(d).astype(np.float32), id="heavy-tailed"),
    pytest.param(lambda rng, d: (rng.random(d) < 0.003).astype(np.float32) * 5, id="mostly-zero"),
    pytest.param(lambda rng, d: np.full(d, 0.5, np.float32), id="all-ties"),
    pytest.param(lambda rng, d: np.zeros(d, np.float32), id="all-zero"),
]


@pytest.mark.parametrize("make", FEEDBACK_INPUTS)
@pytest.mark.parametrize("momentum", [0.0, 0.9], ids=["topk", "dgc"])
@pytest.mark.parametrize("d", [300, 200_003], ids=["small", "sampled"])
def test_topk_feedback_into_equals_the_torch_ops_it_fuses_bit_for_bit(make, momentum, d):
    # Four steps with buffers carried over, as the hook calls it: the residual, the
    # velocity, the values and indices sent must be exactly what the torch ops give
    # (x += g rounds once; m * v + g rounds twice: no fused multiply-add), the gradient
    # is left zeroed, and the workspace may be too short for the candidates.
    rng = np.random.default_rng(4)
    k = max(1, d // 100)
    x, v = np.zeros(d, np.float32), np.zeros(d, np.float32)
    x_ref, v_ref = x.copy(), v.copy()
    w = K.topk_workspace(d, k)
    vals, idx = np.empty(k, np.float32), np.empty(k, np.int32)
    cand_vals, cand_idx = np.empty(w, np.float32), np.empty(w, np.int32)
    for step in range(4):
        g = make(rng, d) * np.float32(step + 1)
        ref_vals, ref_idx = _torch_feedback(x_ref, g.copy(), v_ref, momentum, k, step)
        grad = g.copy()
        velocity = v if momentum else np.empty(0, np.float32)
        K.topk_feedback_into(x, grad, velocity, momentum, k, step, vals, idx, cand_vals, cand_idx)
        np.testing.assert_array_equal(idx, ref_idx)
        np.testing.assert_array_equal(vals.view(np.int32), ref_vals.view(np.int32))
        np.testing.assert_array_equal(x.view(np.int32), x_ref.view(np.int32))
        np.testing.assert_array_equal(v.view(np.int32), v_ref.view(np.int32))
        assert not grad.any(), "the gradient is left zeroed for the mean to be added into"
        if step == 1:  # a workspace of one entry: the candidates overflow it and the kernel retries
            cand_vals, cand_idx = np.empty(1, np.float32), np.empty(1, np.int32)
