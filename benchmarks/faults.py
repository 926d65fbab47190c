"""Fault drills, timed: how fast nbdist handles the rows of docs/faults.md the tests only prove.

- row 2: a rank raises while the other waits in all_reduce -> the cell returns (released);
- row 3: Ctrl-C while both ranks are in collectives -> the cell returns;
- row 4: an engine is killed (SIGKILL) mid-cell -> the cell returns naming it; then %dist_restart;
- row 5: the kernel is killed -> every process it started is gone; beside raw ipyparallel in
  the same situation (its engines are watched for PEER_WATCH_S, then ended by pid);
- row 7: one engine exits before registering -> start() names the missing rank;
- row 10: --timeout 2 on a rank left alone in a collective -> the cell returns with the report.
Median of --reps runs each; JSON under results/.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import threading
import time

import psutil
from _common import FAILURE_CELL, INTERRUPT_CELL, interrupted_cell, run_cell, save, shell, stats

PEER_WATCH_S = 10.0


def _gone_after(pids: list[int], limit: float) -> float | None:
    """Seconds until every pid is gone (or a zombie), None if some outlive ``limit``."""
    tic = time.perf_counter()
    while time.perf_counter() - tic < limit:
        alive = []
        for p in pids:
            try:
                if psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        if not alive:
            return time.perf_counter() - tic
        time.sleep(0.05)
    return None


def failure_release(ip) -> float:
    tic = time.perf_counter()
    ip.run_cell(FAILURE_CELL, silent=True)
    return time.perf_counter() - tic


def interrupt_release(ip) -> float:
    return interrupted_cell(ip, INTERRUPT_CELL)


def dead_rank(ip) -> tuple[float, float]:
    import nbdist

    victim = nbdist.current().ranks[1].pid
    threading.Timer(0.5, os.kill, (victim, signal.SIGKILL)).start()
    tic = time.perf_counter()
    ip.run_cell(
        "%%distributed\nimport time\nif dist.get_rank() == 0:\n    dist.all_reduce(torch.ones(1))\nelse:\n    time.sleep(60)",
        silent=True,
    )
    named = time.perf_counter() - tic - 0.5
    tic = time.perf_counter()
    run_cell(ip, "%dist_restart --ranks 1")
    return named, time.perf_counter() - tic


def timeout_report(ip) -> float:
    tic = time.perf_counter()
    ip.run_cell("%%distributed --timeout 2\nif dist.get_rank() == 0:\n    dist.all_reduce(torch.ones(1))", silent=True)
    return time.perf_counter() - tic - 2.0


def missing_rank() -> float:
    import nbdist
    from nbdist.errors import ClusterError

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["NBDIST_FAULT_EXIT_ONE"] = os.path.join(tmp, "one-engine-fails")
        tic = time.perf_counter()
        try:
            nbdist.start(n=2, timeout=120).stop()
            raise RuntimeError("the drill's engine did not exit")
        except ClusterError:
            return time.perf_counter() - tic
        finally:
            del os.environ["NBDIST_FAULT_EXIT_ONE"]


NBDIST_KERNEL = "import nbdist, json\nc = nbdist.start(n=2)\nprint(json.dumps(c.pids()))"
RAW_KERNEL = (
    "import ipyparallel as ipp, json, psutil, os\n"
    "c = ipp.Cluster(n=2, log_level=40)\nrc = c.start_and_connect_sync()\n"
    "print(json.dumps([p.pid for p in psutil.Process(os.getpid()).children(recursive=True)]))"
)


def kernel_death(code: str, limit: float) -> tuple[float | None, int]:
    """Start a kernel, run ``code`` (it prints the pids to watch), SIGKILL the kernel; time until they are gone."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3")
    outputs: list[dict] = []
    try:
        kc.execute_interactive(code, timeout=120, output_hook=outputs.append)
        text = "".join(m["content"].get("text", "") for m in outputs if m["msg_type"] == "stream")
        pids = json.loads(text.strip().splitlines()[-1])
        os.kill(km.provisioner.pid, signal.SIGKILL)
        took = _gone_after(pids, limit)
        for p in pids:  # what outlived the kernel: processes this benchmark started, ended by pid
            try:
                psutil.Process(p).kill()
            except psutil.NoSuchProcess:
                pass
        return took, len(pids)
    finally:
        kc.stop_channels()
        km.cleanup_resources()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    ip = shell()
    out: dict[str, list[float]] = {k: [] for k in ("failure", "interrupt", "dead_named", "restart", "timeout_extra")}
    run_cell(ip, "%dist_start -n 2")
    try:
        for _ in range(args.reps):
            out["failure"].append(failure_release(ip))
            out["interrupt"].append(interrupt_release(ip))
            named, restart = dead_rank(ip)
            out["dead_named"].append(named)
            out["restart"].append(restart)
            out["timeout_extra"].append(timeout_report(ip))
    finally:
        ip.run_cell("%dist_stop")
    missing = [missing_rank() for _ in range(args.reps)]
    ours = [kernel_death(NBDIST_KERNEL, 30.0) for _ in range(args.reps)]
    raw = kernel_death(RAW_KERNEL, PEER_WATCH_S)
    result = {name: stats(v) for name, v in out.items()}
    result["missing_rank_reported"] = stats(missing)
    result["kernel_death_cleanup"] = stats([t if t is not None else float("inf") for t, _ in ours])
    result["raw_ipyparallel_kernel_death"] = {
        "gone_within_s": raw[0],
        "watched_s": PEER_WATCH_S,
        "processes": raw[1],
    }
    print(f"row 2  a rank raised, the other waited in all_reduce -> cell returned: {result['failure']['median']:.2f} s")
    print(f"row 3  Ctrl-C in collectives -> cell returned: {result['interrupt']['median']:.2f} s after the signal")
    print(f"row 4  SIGKILL of a rank -> cell returned naming it: {result['dead_named']['median']:.2f} s after the kill")
    print(f"       %dist_restart --ranks 1: {result['restart']['median']:.2f} s")
    print(f"row 5  kernel killed -> nbdist's processes gone: {result['kernel_death_cleanup']['median']:.2f} s")
    peer = f"{raw[0]:.2f} s" if raw[0] is not None else f"still running after {PEER_WATCH_S:.0f} s"
    print(f"       raw ipyparallel in the same kernel death: {peer} ({raw[1]} processes)")
    print(f"row 7  one engine exits before registering -> named: {result['missing_rank_reported']['median']:.2f} s")
    print(f"row 10 --timeout 2 -> report and release: timeout + {result['timeout_extra']['median']:.2f} s")
    save("faults", result)


if __name__ == "__main__":
    main()
