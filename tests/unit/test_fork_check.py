"""The check before every fork (engine/warm.unsafe): an accelerator's driver loaded by any path is seen.

pytorch/pytorch#190708: ``torch.get_device_module().device_count()`` loads and initialises CUDA's driver without
``torch.cuda.is_initialized()`` saying so, and a child forked after it dies with 'CUDA error: initialization
error'. The check reads what is mapped into the process. Here (no GPU) a library named as NVIDIA's driver is built
and loaded in a fresh Python, as the real one would be; the GPU tier does it with the real call (tests/dist)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from nbdist.engine import warm
from tests.helpers import stand_in_driver


def test_a_mapped_driver_library_is_named_and_others_are_not(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libcudart.so.12.4.127\n"
        "7f02-7f03 r-xp 00000000 08:01 2 /opt/torch/lib/libtorch_cuda.so\n"
        "7f04-7f05 rw-p 00000000 00:00 0 [heap]\n"
    )
    assert warm.accelerator_driver(str(maps)) == "", "the CUDA runtime and torch's libraries load on import"
    maps.write_text(maps.read_text() + "7f06-7f07 r-xp 00000000 08:01 3 /usr/lib/x86_64-linux-gnu/libcuda.so.1\n")
    assert warm.accelerator_driver(str(maps)) == "libcuda.so.1"
    assert warm.accelerator_driver(str(tmp_path / "absent")) == ""


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to build a stand-in driver library")
def test_a_process_that_loaded_a_driver_refuses_to_fork_and_says_which(tmp_path):
    lib = stand_in_driver(tmp_path)
    code = (
        "import ctypes, sys\n"
        "from nbdist.engine import warm\n"
        "before = warm.unsafe()\n"
        f"ctypes.CDLL({str(lib)!r}).cuInit(0)\n"
        "print(repr(before)); print(warm.unsafe())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    before, after = done.stdout.splitlines()
    assert before == "''", "a fresh Python with nbdist's engine imported is safe to fork"
    assert after.startswith("an accelerator's driver is loaded in it (libcuda.so.1: something asked the device"), after
    assert "torch.get_device_module().device_count()" in after


def test_the_warm_process_imports_what_a_replayed_setup_cell_builds_and_stays_safe_to_fork():
    """Its first idle steps import nbdist.parallel and torch._dynamo, which DDP's constructor imports (0.44 s a
    restarted rank paid in its replayed apply_ddp while the world waited: benchmarks/recovery_scale.py), and start
    no thread, so a fork after them is still safe. A rank may be forked between any two steps: each such fork builds
    DDP (a submodule imported out of order once left torch._dynamo without ``utils`` in the forks, and a 64-rank
    recovery failed)."""
    code = (
        "import os, sys\n"
        "from nbdist.engine import warm\n"
        "steps = warm._idle_work()\n"
        "built = []\n"
        "for _ in warm._PIECES:\n"
        "    next(steps)\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        import torch, torch.distributed as dist\n"
        "        dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
        "        torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))\n"
        "        os._exit(0)\n"
        "    built.append(os.waitpid(pid, 0)[1] == 0)\n"
        "print(sorted(m for m in ('nbdist.parallel', 'torch._dynamo') if m in sys.modules), repr(warm.unsafe()))\n"
        "print(len(warm._PIECES), built)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    imported, forks = out.split("\n")[-3:-1]
    assert imported == "['nbdist.parallel', 'torch._dynamo'] ''", out
    count, built = forks.split(" ", 1)
    assert built == repr([True] * int(count)), f"a rank forked after step k of {count} could not build DDP: {built}"
