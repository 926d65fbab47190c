"""torchft's recovery, timed the way benchmarks/recovery.py times nbdist's and torchrun's.

torchft (meta-pytorch/torchft) keeps training on the replicas that are left and heals a replica that comes
back from a healthy peer. Here: a lighthouse (``torchft_lighthouse``), and 2 replica groups of 1 worker each,
each under its own ``torchrun --max-restarts 1`` (what restarts a killed worker: torchft relies on its launcher
for that), the same small model, gradients averaged by ``torchft.DistributedDataParallel`` over
``ProcessGroupGloo``. Replica 1's worker is killed (SIGKILL) at step ~KILL_AT. Timed: kill -> the next step
replica 0 commits (training again), and kill -> the first step the restarted replica commits (back in the
world, healed from replica 0); counted: the steps replica 0 computed and threw away (not committed).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import psutil

SCRIPT = """
import os, sys, time
from datetime import timedelta
import torch
from torchft import DistributedDataParallel, Manager, ProcessGroupGloo
progress, steps, sleep = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
replica = int(os.environ["REPLICA_GROUP_ID"])
with open(f"{progress}.pid{replica}", "w") as fh:
    fh.write(str(os.getpid()))
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
X = torch.randn(256, 8, generator=torch.Generator().manual_seed(1))
Y = X.sum(1, keepdim=True)
inner = torch.optim.SGD(net.parameters(), lr=0.02, momentum=0.5)

def load_state_dict(state):
    net.load_state_dict(state["model"]); inner.load_state_dict(state["optim"])

def state_dict():
    return {"model": net.state_dict(), "optim": inner.state_dict()}

manager = Manager(
    pg=ProcessGroupGloo(timeout=timedelta(seconds=5)), min_replica_size=1, load_state_dict=load_state_dict,
    state_dict=state_dict, replica_id=f"bench_{replica}", timeout=timedelta(seconds=5),
)
model = DistributedDataParallel(manager, net)
g = torch.Generator().manual_seed(100 + replica)
while manager.current_step() < steps:
    step = manager.current_step()
    idx = torch.randint(0, len(X), (8,), generator=g)
    inner.zero_grad(); manager.start_quorum()
    torch.nn.functional.mse_loss(model(X[idx]), Y[idx]).backward()
    committed = manager.should_commit()
    if committed:
        inner.step()
    with open(f"{progress}-{replica}", "a") as fh:
        fh.write(f"{time.time()} {step} {int(committed)}\\n")
    time.sleep(sleep)
manager.shutdown()
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rows(path: str) -> list[tuple[float, int, int]]:
    try:
        with open(path) as fh:
            return [(float(t), int(s), int(c)) for t, s, c in (ln.split() for ln in fh if ln.strip())]
    except FileNotFoundError:
        return []


def _pid(path: str) -> int | None:
    try:
        with open(path) as fh:
            return int(fh.read())
    except (FileNotFoundError, ValueError):
        return None


def _end(proc: subprocess.Popen) -> None:
    """End a launcher we started and every process under it (by pid)."""
    if proc.poll() is None:
        try:
            children = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        for child in children:
            child.kill()
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def torchft_once(workdir: str, i: int, steps: int, kill_at: int, sleep: float) -> dict:
    script = os.path.join(workdir, "train_torchft.py")
    with open(script, "w") as fh:
        fh.write(SCRIPT)
    progress = os.path.join(workdir, f"ft-progress-{i}")
    port = _free_port()
    bindir = os.path.dirname(sys.executable)
    base = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "RUST_LOG": "warn"}
    procs: list[subprocess.Popen] = []
    out: dict = {}
    log = open(progress + ".log", "w")  # noqa: SIM115 (closed below, after every process ended)
    try:
        procs.append(
            subprocess.Popen(
                [
                    os.path.join(bindir, "torchft_lighthouse"),
                    "--min_replicas",
                    "1",
                    "--bind",
                    f"127.0.0.1:{port}",
                    "--join_timeout_ms",
                    "1000",
                    "--quorum_tick_ms",
                    "50",
                    "--heartbeat_timeout_ms",
                    "1000",
                ],
                env=base,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        for replica in (0, 1):
            env = {
                **base,
                "REPLICA_GROUP_ID": str(replica),
                "NUM_REPLICA_GROUPS": "2",
                "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}",
            }
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "torch.distributed.run",
                        "--nproc-per-node",
                        "1",
                        "--max-restarts",
                        "1",
                        "--monitor-interval",
                        "0.1",
                        "--master-addr",
                        "127.0.0.1",
                        "--master-port",
                        str(_free_port()),
                        script,
                        progress,
                        str(steps),
                        str(sleep),
                    ],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )

        def kill() -> None:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if any(s >= kill_at and c for _, s, c in _rows(progress + "-0")) and _pid(progress + ".pid1"):
                    out["kill"] = time.time()
                    os.kill(_pid(progress + ".pid1"), signal.SIGKILL)  # type: ignore[arg-type]
                    return
                time.sleep(0.005)

        killer = threading.Thread(target=kill, daemon=True)
        killer.start()
        for proc in procs[1:]:
            try:
                proc.wait(timeout=180)
            except subprocess.TimeoutExpired:
                break
        killer.join(1)
    finally:
        for proc in procs:
            _end(proc)
        log.close()
    if "kill" not in out:
        return {"ok": False, "error": f"the kill never came (training did not reach step {kill_at})"}
    t = out["kill"]
    survivor = [r for r in _rows(progress + "-0") if r[0] > t]
    back = [r for r in _rows(progress + "-1") if r[0] > t and r[2]]
    again = next((r[0] for r in survivor if r[2]), None)
    if again is None:
        return {"ok": False, "error": "replica 0 committed no step after the kill"}
    return {
        "ok": True,
        "kill_to_progress_s": again - t,
        "kill_to_rejoined_s": back[0][0] - t if back else None,
        "steps_computed_twice": sum(1 for r in survivor if not r[2]),
    }
