"""The reference: a script under torchrun itself (2 processes on this machine, loopback rendezvous)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers import free_port

HANG_S = 300  # only to catch a hang; DeepSpeed's first run JIT-builds its CPU comm op (about 30 s)


def torchrun(script: str, *args: str, cwd: str, nproc: int = 2) -> subprocess.CompletedProcess:
    """Run ``script`` under ``torchrun --nproc-per-node nproc``; fail the test with its output if it fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1"]
    cmd += ["--master-port", str(free_port()), script, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=HANG_S)
    # torch 2.13's gloo now and then aborts a worker at interpreter exit, after the script has finished and
    # destroyed its group ("terminate called without an active exception", SIGABRT; the exit-time teardown
    # discussed in pytorch/pytorch#179291), and torchrun then sends SIGTERM to the workers still running. The
    # scripts compared here wait at a barrier after writing their results, so no worker exits (and none is
    # ended) before every rank has written; without it a rank 0 still saving was ended now and then (CI, 2 cores).
    exit_abort = "terminate called without an active exception" in done.stderr and "exitcode  : -6" in done.stderr
    assert done.returncode == 0 or exit_abort, done.stdout[-3000:] + done.stderr[-3000:]
    return done
