"""Recovery, timed: from a kill -9 of rank 1 mid-training until training progresses again.

- nbdist ``--max-restarts``: 2 ranks, the small DDP model of the tests, a checkpoint every 5
  steps; a rank is killed from outside at step ~22 (the matrix: rank 1, rank 0, which hosts the
  store, and rank 1 with asynchronous saves), each ``--recover-from peer`` (the living rank's
  memory: the interrupted step goes on) and ``--recover-from checkpoint`` (load step 20); the cell
  recovers by itself (restart the rank, rebuild the group, replay the setup cell, restore, run
  the cell again). Timed: kill -> first step completed after the kill; and its parts (kill ->
  recovery begins, the recovery itself, recovery -> first step); counted: steps computed twice;
- what keeping the parts for a peer costs a step (``peer_overhead``);
- torchrun ``--max-restarts 1`` (torchelastic), the same model and checkpoints in plain torch,
  killed the same way: it restarts every worker process;
- torchft (benchmarks/_torchft_run.py), where its wheel is installed (the dev extras): 2 replica groups of one
  worker, each under ``torchrun --max-restarts 1``, a lighthouse; the replica left goes on, the killed one is
  restarted by its torchrun and healed from the other's memory;
- the plain ``%dist_restart`` (both ranks) and ``%dist_restart --ranks 1``.
Medians of --reps; JSON under results/recovery.json. Target: kill -> progress <= 10 s.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import psutil
from _common import save, stats

import nbdist
from nbdist.cells.output import Sink

try:
    import torchft  # noqa: F401
    from _torchft_run import torchft_once

    TORCHFT = True
except ImportError:
    TORCHFT = False

STEPS, KILL_AT, EVERY, SLEEP = 60, 22, 5, 0.02
MODEL = """
import os, time, torch
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
_g = torch.Generator().manual_seed(1)
X = torch.randn(256, 8, generator=_g)
data = torch.utils.data.TensorDataset(X, X.sum(1, keepdim=True))
"""
NBDIST_SETUP = (
    MODEL
    + """
from nbdist.parallel import apply_ddp, shard, save_checkpoint
model = apply_ddp(net)
opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.5)
loader = shard(data, batch_size=8, seed=2)
"""
)
NBDIST_TRAIN = f"""
for step, (x, y) in loader.steps({STEPS}):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    if (step + 1) % {EVERY} == 0:
        save_checkpoint(CKPT, model, opt, step + 1, loader=loader, **SAVE_ARGS)
    if dist.get_rank() == 0:
        with open(PROGRESS, "a") as fh:
            fh.write(f"{{time.time()}} {{step}}\\n")
    time.sleep({SLEEP})
"""
TORCHRUN_SCRIPT = (
    MODEL
    + f"""
import sys
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
ckpt, progress = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
model = DDP(net)
opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.5)
start = 0
if os.path.exists(ckpt):
    state = torch.load(ckpt)
    model.load_state_dict(state["model"]); opt.load_state_dict(state["opt"]); start = state["step"]
sampler = DistributedSampler(data, seed=2)
loader = DataLoader(data, batch_size=8, sampler=sampler, drop_last=True)
step = 0
while step < {STEPS}:
    sampler.set_epoch(step // len(loader))
    for x, y in loader:
        if step < start:
            step += 1
            continue
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
        step += 1
        if step % {EVERY} == 0 and dist.get_rank() == 0:
            torch.save({{"model": model.state_dict(), "opt": opt.state_dict(), "step": step}}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
        if dist.get_rank() == 0:
            with open(progress, "a") as fh:
                fh.write(f"{{time.time()}} {{step - 1}} {{os.getpid()}}\\n")
        else:
            with open(progress + ".pid1", "w") as fh:
                fh.write(str(os.getpid()))
        time.sleep({SLEEP})
        if step >= {STEPS}:
            break
dist.destroy_process_group()
"""
)


def _lines(path: str) -> list[list[str]]:
    try:
        with open(path) as fh:
            return [ln.split() for ln in fh if ln.strip()]
    except FileNotFoundError:
        return []


def _kill_at(progress: str, pid_of_rank1, out: dict) -> threading.Thread:
    """Kill a rank (SIGKILL; ``pid_of_rank1`` gives its pid) once rank 0 has logged step KILL_AT; note the time."""

    def watch() -> None:
        end = time.monotonic() + 120
        while time.monotonic() < end:
            rows = _lines(progress)
            if rows and int(rows[-1][1]) >= KILL_AT:
                pid = pid_of_rank1()
                if pid:
                    os.kill(pid, signal.SIGKILL)
                    out["kill"] = time.time()
                    return
            time.sleep(0.005)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _progress_after(progress: str, t_kill: float) -> float:
    return min(float(r[0]) for r in _lines(progress) if float(r[0]) > t_kill) - t_kill


def _seconds(line: str) -> float:
    """The duration in a recovery line: '... in 3.8 s, and ran the cell again ...'."""
    return float(line.split(" in ")[-1].split(" s,")[0])


def nbdist_once(cluster, workdir: str, i: int, kill_rank: int, asynchronous: bool, mode: str) -> dict:
    progress, said = os.path.join(workdir, f"nb-progress-{i}-{kill_rank}-{asynchronous}-{mode}"), {}
    ckpt = os.path.join(workdir, f"nb-ckpt-{i}-{kill_rank}-{asynchronous}-{mode}")
    cluster.run(
        f"CKPT, PROGRESS, SAVE_ARGS = {ckpt!r}, {progress!r}, {{'asynchronous': {asynchronous}}}\n" + NBDIST_SETUP,
        setup=True,
    ).raise_for_error()
    cluster.progress = lambda line: said.setdefault("recovery_began", time.time() - _seconds(line))
    out: dict = {}
    watcher = _kill_at(progress, lambda: cluster.ranks[kill_rank].pid, out)
    result = cluster.run(NBDIST_TRAIN, sink=Sink())
    watcher.join()
    result.raise_for_error()
    assert result.recovered, "the kill did not land during the cell"
    recovery_s = _seconds(result.recovered[0])
    total = _progress_after(progress, out["kill"])
    steps = [int(r[1]) for r in _lines(progress)]
    return {
        "steps_computed_twice": len(steps) - len(set(steps)),  # rank 0's progress lines: a step logged again
        "from_peer": "nothing recomputed" in result.recovered[0],
        "line": result.recovered[0],
        "kill_to_progress_s": total,
        "detect_s": said["recovery_began"] - out["kill"],
        "recovery_s": recovery_s,
        "rerun_to_first_step_s": total - (said["recovery_began"] - out["kill"]) - recovery_s,
    }


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_once(workdir: str, i: int) -> dict:
    script = os.path.join(workdir, "train_torchrun.py")
    with open(script, "w") as fh:
        fh.write(TORCHRUN_SCRIPT)
    progress = os.path.join(workdir, f"tr-progress-{i}")
    ckpt = os.path.join(workdir, f"tr-ckpt-{i}.pt")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--monitor-interval",
        "0.1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_free_port()),
        script,
        ckpt,
        progress,
    ]
    out: dict = {}

    def rank1_pid() -> int | None:
        try:
            with open(progress + ".pid1") as fh:
                return int(fh.read())
        except (FileNotFoundError, ValueError):
            return None

    with open(progress + ".log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            watcher = _kill_at(progress, rank1_pid, out)
            proc.wait(timeout=120)
            watcher.join()
        except subprocess.TimeoutExpired:
            pass
        finally:
            if proc.poll() is None:
                # torchelastic starts each worker in a session of its own: end them by pid, then the agent
                for child in psutil.Process(proc.pid).children(recursive=True):
                    child.kill()
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    try:
        return {"ok": True, "kill_to_progress_s": _progress_after(progress, out["kill"])}
    except (KeyError, ValueError):  # never progressed again after the kill
        with open(progress + ".log") as fh:
            errors = [ln.strip() for ln in fh if "Error:" in ln and "Traceback" not in ln]
        return {"ok": False, "exit": proc.returncode, "error": (errors or ["no progress after the kill"])[0][:300]}


def _torchft_stats(rows: list[dict]) -> dict:
    ok = [r for r in rows if r["ok"]]
    back = [r["kill_to_rejoined_s"] for r in ok if r["kill_to_rejoined_s"] is not None]
    return {
        "recovered": f"{len(ok)} of {len(rows)}",
        "kill_to_progress_s": stats([r["kill_to_progress_s"] for r in ok]) if ok else None,
        "kill_to_rejoined_s": stats(back) if back else None,
        "steps_computed_twice": stats([r["steps_computed_twice"] for r in ok]) if ok else None,
        "failures": [r for r in rows if not r["ok"]],
    }


CASES = {"rank1": (1, False), "rank0": (0, False), "rank1-async-saves": (1, True)}
MODES = ("peer", "checkpoint")  # --recover-from
OVERHEAD_STEPS = 300
OVERHEAD_TRAIN = f"""
import time
tic = time.perf_counter()
for step, (x, y) in loader.steps(loader.step + {OVERHEAD_STEPS}):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
per_step = (time.perf_counter() - tic) / {OVERHEAD_STEPS}
"""


def peer_overhead(reps: int) -> dict:
    """What keeping each rank's part (and mirroring it to the buddy) costs a step: the same loop, no sleep,
    no save, under --max-restarts 1 with --recover-from peer and checkpoint, and without --max-restarts;
    a fresh world each, taken in turn round by round, so the machine's drift falls on all three alike."""
    settings = {
        "peer": dict(max_restarts=1),
        "checkpoint": dict(max_restarts=1, recover_from="checkpoint"),
        "no restarts": dict(max_restarts=0),
    }
    per_step: dict[str, list[float]] = {k: [] for k in settings}
    for _ in range(reps):
        for name, kw in settings.items():
            with nbdist.start(2, timeout=60, **kw) as cluster:
                cluster.run("CKPT, PROGRESS, SAVE_ARGS = '', '', {}\n" + NBDIST_SETUP, setup=True).raise_for_error()
                cluster.run(OVERHEAD_TRAIN).raise_for_error()  # warm
                cluster.run(OVERHEAD_TRAIN).raise_for_error()
                per_step[name].append(max(cluster.pull("per_step")) * 1e3)
        print("ms per step: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in per_step.items()))
    out = {k: stats(v) for k, v in per_step.items()}
    base = out["checkpoint"]["median"]
    out["peer_cost_pct"] = 100 * (out["peer"]["median"] - base) / base
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--cases", default=",".join(CASES), help=f"which kills to time: {', '.join(CASES)}")
    args = parser.parse_args()
    cases = args.cases.split(",")
    matrix: dict[str, list[dict]] = {f"{c} from {m}": [] for m in MODES for c in cases}
    tr, restart_all, restart_one, ft = [], [], [], []
    with tempfile.TemporaryDirectory() as workdir:
        overhead = peer_overhead(args.reps)
        for mode in MODES:
            with nbdist.start(2, max_restarts=args.reps * len(cases), recover_from=mode, timeout=60) as cluster:
                for i in range(args.reps):
                    for case in cases:
                        kill_rank, asynchronous = CASES[case]
                        row = nbdist_once(cluster, workdir, i, kill_rank, asynchronous, mode)
                        matrix[f"{case} from {mode}"].append(row)
                        print(f"nbdist --max-restarts, {case}, from {mode}: {row}")
                if mode == MODES[0]:
                    for _ in range(args.reps):
                        restart_all.append(cluster.restart())
                        restart_one.append(cluster.restart([1]))
                    print(f"%dist_restart: {restart_all}; --ranks 1: {restart_one}")
        for i in range(args.reps):
            tr.append(torchrun_once(workdir, i))
            print(f"torchrun --max-restarts 1: {tr[-1]}")
            if TORCHFT:
                ft.append(torchft_once(workdir, i, STEPS, KILL_AT, SLEEP))
                print(f"torchft: {ft[-1]}")
    nb = matrix[f"{cases[0]} from peer"]
    keys = ("kill_to_progress_s", "detect_s", "recovery_s", "rerun_to_first_step_s", "steps_computed_twice")
    data = {
        "target_kill_to_progress_s": 10.0,
        "nbdist_max_restarts": {k: stats([r[k] for r in nb]) for k in keys},
        "nbdist_matrix": {
            case: {**{k: stats([r[k] for r in rows]) for k in keys}, "from_peer": [r["from_peer"] for r in rows]}
            for case, rows in matrix.items()
        },
        "peer_overhead_ms_per_step": overhead,
        "torchrun_max_restarts": {
            "recovered": f"{sum(r['ok'] for r in tr)} of {len(tr)}",
            "kill_to_progress_s": stats([r["kill_to_progress_s"] for r in tr if r["ok"]])
            if any(r["ok"] for r in tr)
            else None,
            "failures": [r for r in tr if not r["ok"]],
        },
        "torchft": _torchft_stats(ft) if TORCHFT else "not installed (pip install torchft, or the dev extras)",
        "dist_restart_all_s": stats(restart_all),
        "dist_restart_rank1_s": stats(restart_one),
    }
    trs = data["torchrun_max_restarts"]
    tr_text = f"{trs['kill_to_progress_s']['median']:.2f} s" if trs["kill_to_progress_s"] else "never"
    print(
        f"median kill -> progress: nbdist {data['nbdist_max_restarts']['kill_to_progress_s']['median']:.2f} s, "
        f"torchrun {tr_text} (recovered {trs['recovered']}) (target <= 10 s); "
        f"%dist_restart {data['dist_restart_all_s']['median']:.2f} s, --ranks 1 {data['dist_restart_rank1_s']['median']:.2f} s"
    )
    for case, row in data["nbdist_matrix"].items():
        print(
            f"  {case}: kill -> progress {row['kill_to_progress_s']['median']:.2f} s (detection "
            f"{row['detect_s']['median']:.2f} s, recovery {row['recovery_s']['median']:.2f} s, "
            f"cell again -> first step {row['rerun_to_first_step_s']['median']:.2f} s), steps computed twice "
            f"{row['steps_computed_twice']['samples']}, from a peer {row['from_peer']}"
        )
    f = data["torchft"]
    if isinstance(f, dict) and f["kill_to_progress_s"]:
        back = f["kill_to_rejoined_s"]
        print(
            f"  torchft (recovered {f['recovered']}): kill -> the replica left training again "
            f"{f['kill_to_progress_s']['median']:.2f} s, steps it threw away {f['steps_computed_twice']['samples']}; "
            f"kill -> the killed replica back and healed from the other "
            + (f"{back['median']:.2f} s" if back else "never")
        )
    o = data["peer_overhead_ms_per_step"]
    print(
        f"  a step: {o['peer']['median']:.3f} ms keeping parts for a peer, {o['checkpoint']['median']:.3f} ms with "
        f"--recover-from checkpoint, {o['no restarts']['median']:.3f} ms without --max-restarts "
        f"({o['peer_cost_pct']:+.1f}%)"
    )
    save("recovery", data)


if __name__ == "__main__":
    main()
