"""A corrupt or truncated payload from another rank raises, naming the ranks and the compressor; it
never crashes the process (issue 31). The kernels run in a child process, so a kernel that writes
out of bounds fails this test with its signal instead of taking pytest down with it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent(
    """
    import json
    import numpy as np
    import torch
    from nbdist.compression import kernels
    from nbdist.compression.base import CorruptPayload, Received
    from nbdist.compression.compressors import DGC, TopK
    from nbdist.compression.quantizers import QSGD, Sign

    said = {}

    def attempt(name, fn, *args):
        try:
            fn(*args)
            said[name] = "no error"
        except (IndexError, ValueError) as exc:
            said[name] = type(exc).__name__ + ": " + (exc.args[0] % exc.args[1:] if len(exc.args) > 1 else str(exc))

    out = np.zeros(1000, np.float32)
    vals = np.ones(4, np.float32)
    for bad in (1000, -1, 2**31 - 1):
        attempt(f"scatter_add {bad}", kernels.scatter_add, vals, np.array([1, 2, bad, 3], np.int32), 1.0, out)
        attempt(f"scatter {bad}", kernels.scatter, vals, np.array([bad, 2, 3, 4], np.int32), out)
    attempt("scatter_add few values", kernels.scatter_add, vals[:2], np.array([1, 2, 3], np.int32), 1.0, out)
    attempt("sign_unpack short", kernels.sign_unpack, np.zeros(100, np.uint8), 1.0, out)
    attempt("sign_unpack_add short", kernels.sign_unpack_add, np.zeros(100, np.uint8), 1.0, 0.5, out)
    norms = np.ones(2, np.float32)
    attempt("qsgd short", kernels.qsgd_dequantize, np.zeros(900, np.int8), norms, 127, out, 1.0)
    attempt("qsgd_add norms", kernels.qsgd_dequantize_add, np.zeros(1000, np.int8), norms[:1], 127, 0.5, out)
    attempt("scatter_add fine", kernels.scatter_add, vals, np.array([0, 1, 2, 999], np.int32), 1.0, out)

    x = torch.randn(1000)
    for comp in (TopK(0.01), DGC(0.01), QSGD(127), Sign()):
        wire = comp.compress(x, seed=0, world=2).tensor
        if isinstance(comp, TopK):
            bad = wire.clone()
            bad[comp.k(1000):].view(torch.int32)[-1] = 123456789
        else:
            bad = wire[: wire.numel() // 2].clone()  # truncated
        try:
            comp.decompress(Received([wire, bad], 1000, 2))
            said[comp.name] = "no error"
        except CorruptPayload as exc:
            said[comp.name] = str(exc)
    print(json.dumps(said))
    """
)


@pytest.fixture(scope="module")
def said():
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"the child ended with {done.returncode} (-11: a segfault): {done.stderr[-2000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("bad", [1000, -1, 2**31 - 1])
def test_an_index_outside_the_bucket_is_refused(said, bad):
    assert said[f"scatter_add {bad}"] == f"IndexError: index {bad} (entry 2) is outside the bucket's 1000 entries"
    assert said[f"scatter {bad}"] == f"IndexError: index {bad} (entry 0) is outside the bucket's 1000 entries"


def test_short_bodies_are_refused(said):
    assert said["scatter_add few values"] == "ValueError: 3 indices came with 2 values"
    assert said["sign_unpack short"] == "ValueError: 100 bytes of signs hold fewer than the bucket's 1000 entries"
    assert said["sign_unpack_add short"] == said["sign_unpack short"]
    assert said["qsgd short"] == "ValueError: 900 levels and 2 norms do not describe the bucket's 1000 entries"
    assert said["qsgd_add norms"] == "ValueError: 1000 levels and 1 norms do not describe the bucket's 1000 entries"
    assert said["scatter_add fine"] == "no error"


@pytest.mark.parametrize("name", ["topk", "dgc", "qsgd", "signsgd"])
def test_every_compressor_names_the_sender_and_itself(said, name):
    assert said[name].startswith(f"rank 0 received a corrupt {name} payload from rank 1: ")
    assert "Every rank must run the same model and compressor settings" in said[name]
