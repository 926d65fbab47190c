"""Compressors without communication: error feedback, byte accounting, specs, and the
sign-compression counter-example."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nbdist.compression import make_hook
from nbdist.compression.base import Received
from nbdist.compression.compressors import DGC, Identity, RandomK, TopK
from nbdist.compression.hooks import powersgd_bytes
from nbdist.compression.quantizers import QSGD, Sign
from nbdist.errors import ConfigError


@pytest.mark.parametrize("comp", [TopK(0.05), RandomK(0.05), Sign(True)], ids=lambda c: c.describe())
def test_error_feedback_telescopes(comp):
    """sum of what was sent + the final residual == sum of the raw gradients (per rank)."""
    rng = np.random.default_rng(0)
    residual = torch.zeros(500, dtype=torch.float64)
    sent_total = torch.zeros(500, dtype=torch.float64)
    raw_total = torch.zeros(500, dtype=torch.float64)
    for step in range(50):
        g = torch.from_numpy(rng.standard_normal(500).astype(np.float32))
        raw_total += g.double()
        corrected = g + residual.float()
        payload = comp.compress(corrected.clone(), seed=step, world=1)
        residual = corrected.double() - payload.sent.double()
        sent_total += payload.sent.double()
    # float32 per step, summed over 50 steps: 1e-4 absolute is far above the rounding and far below a bug
    torch.testing.assert_close(sent_total + residual, raw_total, rtol=0, atol=1e-4)


def test_bytes_on_the_wire_match_the_payload_layout():
    x = torch.randn(1000)
    assert TopK(0.01).compress(x.clone(), seed=0, world=2).tensor.nbytes == 10 * 4 + 10 * 4
    assert RandomK(0.01).compress(x.clone(), seed=0, world=2).tensor.nbytes == 10 * 4
    assert QSGD(127).compress(x.clone(), seed=0, world=2).tensor.nbytes == 1000 + 4 * 2  # a norm per 512
    assert Sign().compress(x.clone(), seed=0, world=2).tensor.nbytes == 125 + 4
    assert Identity().compress(x.clone(), seed=0, world=2).tensor.nbytes == 4000


def resnet18_shapes(num_classes: int = 10) -> list[tuple[int, ...]]:
    """Parameter shapes of the CIFAR ResNet-18 (3x3 stem, no max-pool), built by hand."""
    shapes: list[tuple[int, ...]] = [(64, 3, 3, 3), (64,), (64,)]
    inp = 64
    for out, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        for block in range(2):
            cin = inp if block == 0 else out
            shapes += [(out, cin, 3, 3), (out,), (out,), (out, out, 3, 3), (out,), (out,)]
            if block == 0 and (stride != 1 or cin != out):
                shapes += [(out, cin, 1, 1), (out,), (out,)]
        inp = out
    return shapes + [(num_classes, 512), (num_classes,)]


def test_powersgd_rank2_on_resnet18_compresses_136x():
    """Vogels et al. (2019) report 136x for rank-2 PowerSGD on ResNet-18 (CIFAR-10)."""
    shapes = resnet18_shapes(10)
    assert sum(int(np.prod(s)) for s in shapes) == 11_173_962  # the model's parameter count
    before, after = powersgd_bytes(shapes, rank=2)
    assert round(before / after) == 136


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("topkk:0.01", "did you mean 'topk'?"),
        ("powersdg", "did you mean 'powersgd'?"),
        ("topk:abc", "not a number"),
        ("topk:2", "must be in (0, 1]"),
        ("qsgd:300", "must be 1..127"),
        ("signsgd:maybe", "takes 'ef' or 'noef'"),
        ("dgc:0.01:1.5", "dgc:0.01:1.5 needs a ratio in (0, 1] and a momentum in [0, 1)"),
        ("dgc:0:0.9", "e.g. dgc:0.01"),
        ("dgc:0.01:fast", "not a number"),
        ("dcg:0.01", "did you mean 'dgc'?"),
    ],
)
def test_bad_specs_say_what_to_write(spec, fragment):
    with pytest.raises(ConfigError) as info:
        make_hook(spec)
    assert fragment in str(info.value)


def test_hook_state_pickles_without_its_group():
    import pickle

    _, state = make_hook("topk:0.1")
    state.process_group = object()  # stands in for a live group, which cannot pickle
    state.residuals[0] = torch.ones(3)
    back = pickle.loads(pickle.dumps(state))
    assert back.process_group is None and torch.equal(back.residuals[0], torch.ones(3))
    assert back.compressor.describe() == "topk:0.1"


def _counter_example(error_feedback: bool, steps: int = 2000, lr: float = 0.1, seed: int = 0) -> float:
    """Karimireddy et al. (2019), counter-example 1: f(x) = <a1,x>^2 + <a2,x>^2 with
    a1 = [1, -1+e], a2 = [-1+e, 1], stochastic gradients from one term, start [1, 1].
    Every stochastic gradient there has sign +-[1, -1], orthogonal to the way down."""
    eps = 0.1
    a = [torch.tensor([1.0, -1 + eps]), torch.tensor([-1 + eps, 1.0])]
    rng = np.random.default_rng(seed)
    comp = Sign(error_feedback)
    x, e = torch.tensor([1.0, 1.0]), torch.zeros(2)
    for t in range(steps):
        ai = a[rng.integers(2)]
        g = 2 * (ai @ x) * ai
        c = g + e if error_feedback else g
        sent = comp.compress(c.clone(), seed=t, world=1).sent
        if error_feedback:
            e = c - sent
        x = x - lr * sent
    return sum(float(ai @ x) ** 2 for ai in a)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sign_without_error_feedback_fails_where_ef_sign_converges(seed):
    start = 2 * 0.1**2  # f([1, 1])
    plain, ef = _counter_example(False, seed=seed), _counter_example(True, seed=seed)
    assert plain > 0.9 * start, "plain signSGD should make no progress on this problem"
    assert ef < 0.1 * start, "EF-signSGD should converge"


def test_dgc_spec_sets_ratio_and_momentum():
    _, state = make_hook("dgc:0.05:0.95")
    assert (state.compressor.ratio, state.compressor.momentum) == (0.05, 0.95)
    assert make_hook("dgc")[1].compressor.describe() == "dgc:0.01:0.9"
    assert make_hook("topk:0.01")[1].compressor.momentum == 0.0  # plain top-k leaves momentum to the optimizer


@pytest.mark.parametrize("comp", [TopK(0.01), DGC(0.01, 0.9)], ids=lambda c: c.describe())
def test_the_one_pass_feedback_equals_the_torch_ops_and_decompresses_into_the_zeroed_gradient(comp):
    # TopK.compress_feedback (one Numba pass on the CPU) against Compressor.compress_feedback
    # (torch ops), step after step on carried state, large enough for the sampled threshold.
    from nbdist.compression.base import Compressor

    rng = np.random.default_rng(3)
    d = 60_000
    fused = [torch.zeros(d), torch.zeros(d)]  # residual, velocity
    ref = [torch.zeros(d), torch.zeros(d)]
    scratch: dict = {}
    for step in range(5):
        grad = torch.from_numpy(rng.standard_normal(d).astype(np.float32))
        mine, theirs = grad.clone(), grad.clone()
        vel, vel_ref = (fused[1], ref[1]) if comp.momentum else (None, None)
        payload = comp.compress_feedback(mine, fused[0], vel, seed=step, world=2, scratch=scratch)
        expect = Compressor.compress_feedback(comp, theirs, ref[0], vel_ref, seed=step, world=2)
        assert torch.equal(payload.tensor, expect.tensor)
        assert torch.equal(fused[0], ref[0]) and torch.equal(fused[1], ref[1])
        assert payload.grad_zeroed and not mine.any()
        other = TopK(comp.ratio).compress(torch.randn(d), seed=0, world=2).tensor  # a second rank's payload
        into = comp.decompress(Received([payload.tensor, other], d, 2, out=mine, out_zeroed=True))
        assert into is mine
        assert torch.equal(mine, comp.decompress(Received([payload.tensor, other], d, 2)))


def test_every_spec_name_is_a_class_that_parses_its_own_parameter():
    """One registry, taken from the classes (``spec_names``): make_hook, NAMES and the error all read it."""
    from nbdist.compression import NAMES, make_hook
    from nbdist.compression.base import REGISTRY, Compressor
    from nbdist.errors import ConfigError

    assert set(NAMES) == {*REGISTRY, "powersgd"}
    for name, cls in REGISTRY.items():
        assert issubclass(cls, Compressor) and name in cls.spec_names
        _, state = make_hook(name)
        assert type(state.compressor) is cls and state.compressor.describe().split(":")[0] == name
    assert make_hook("dgc:0.02:0.5")[1].compressor.describe() == "dgc:0.02:0.5"
    assert make_hook("randomk:0.1")[1].compressor.describe() == "randomk:0.1"
    with pytest.raises(ConfigError, match="did you mean 'topk'"):
        make_hook("topkk:0.01")
