"""Many ranks: what a world costs and shows at 2 to 64 ranks on one host (oversubscribed on this machine), each
cost split into a part per rank and a fixed part (a least-squares line through the sizes measured).

For each world size, in the same run:
- the start (``nbdist.start``: engines up, ranks configured, process group formed, first collective);
- nbdist's trivial cell (``cluster.run``, default output) against ipyparallel's ``view.execute`` on the same
  engines, alternated; nbdist's own cost per cell is the difference. ``block=True`` returns on the engines' replies,
  before their output (the idle status on iopub) is in, which a cell that shows everything a rank printed waits for:
  ``view.execute`` until ``wait_for_output()`` too is measured beside it;
- the lines that reach the notebook when every rank prints the same line, and a loss that differs by rank:
  folded (the default) and unfolded (``each=True``);
- ``%dist_status`` (``cluster.status()``), ``%dist_where`` (``cluster.where()``), a dashboard refresh with 1,000
  logged steps per rank, and the recovery of one rank (kill its engine, ``cluster.restart([rank])``);
- up to 16 ranks, a ``tqdm`` loop of 2,000 steps on every rank: the lines it leaves and their bytes.
Then raw ipyparallel starting the largest number of plain engines (no torch) and running ``execute`` on them:
the goal is nbdist's start within 2x of it, a trivial cell within 1.1x ``view.execute`` (issue 52), one print one
line.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import signal
import statistics
import time

import numpy as np
import psutil
from _common import alternated, save

import nbdist

PRINT = "print('epoch 1 done')"
LOSS = "print(f'epoch 1 loss {0.5 + dist.get_rank() / 100:.3f}')"
TQDM = "from tqdm import tqdm\nfor _ in tqdm(range(2000), desc='train', mininterval=0.05):\n    pass\nprint('after')"


def shown(cluster: nbdist.Cluster, code: str, each: bool = False) -> str:
    """What the notebook shows of a cell: its stdout and stderr, in the order written."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        cluster.run(code, each=each).raise_for_error()
    return out.getvalue()


def timed(fn, reps: int) -> float:
    """The median seconds of ``fn()`` over ``reps`` calls."""
    samples = []
    for _ in range(reps):
        tic = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - tic)
    return statistics.median(samples)


def controller_of(cluster: nbdist.Cluster) -> psutil.Process:
    for pid in cluster.pids():
        proc = psutil.Process(pid)
        if "nbdist.engine.controller" in " ".join(proc.cmdline()):
            return proc
    raise RuntimeError("no controller among the cluster's processes")


def all_output(view) -> None:
    """``view.execute`` until every engine's output is in too (its idle status on iopub), as a cell that shows what
    it printed must wait: ``block=True`` returns on the replies alone, and output may come after them."""
    ar = view.execute("x = 1", block=False)
    ar.wait()
    ar.wait_for_output()


def cell_cost(cluster: nbdist.Cluster, reps: int) -> dict[str, float]:
    """Wall time of a trivial cell (nbdist's, view.execute's, and view.execute's with its output all in), and the
    CPU one takes in the notebook's process (ipyparallel's client and its IO thread, nbdist's watch and folding)
    and in the controller."""
    view = cluster.view(list(range(cluster.world_size)))
    controller = controller_of(cluster)
    walls: dict[str, list[float]] = {"nbdist": [], "raw": [], "raw_output": []}
    cpu = {k: {"notebook": 0.0, "controller": 0.0} for k in walls}
    kinds = (
        ("nbdist", lambda: shown(cluster, "x = 1")),
        ("raw", lambda: view.execute("x = 1", block=True)),
        ("raw_output", lambda: all_output(view)),
    )
    for _ in range(reps):
        for kind, run in kinds:
            mine, theirs = time.process_time(), sum(controller.cpu_times()[:2])
            tic = time.perf_counter()
            run()
            walls[kind].append(time.perf_counter() - tic)
            cpu[kind]["notebook"] += (time.process_time() - mine) / reps
            cpu[kind]["controller"] += (sum(controller.cpu_times()[:2]) - theirs) / reps
    nb, ipp = statistics.median(walls["nbdist"]) * 1e3, statistics.median(walls["raw"]) * 1e3
    with_output = statistics.median(walls["raw_output"]) * 1e3
    return {
        "nbdist_cell_ms": nb,
        "view_execute_ms": ipp,
        "ratio": nb / ipp,
        "view_execute_all_output_ms": with_output,
        "ratio_all_output": nb / with_output,
        "own_cost_ms": nb - ipp,
        "notebook_cpu_ms": cpu["nbdist"]["notebook"] * 1e3,
        "notebook_cpu_view_execute_ms": cpu["raw"]["notebook"] * 1e3,
        "controller_cpu_ms": cpu["nbdist"]["controller"] * 1e3,
    }


@contextlib.contextmanager
def world(n: int):
    """A world of ``n`` ranks (oversubscribed past this machine's cores), stopped however the block ends."""
    cluster = nbdist.start(n=n, oversubscribe=n > (os.cpu_count() or 1), timeout=300)
    try:
        yield cluster
    finally:
        cluster.stop()


def cells_alternated(cluster: nbdist.Cluster, ways: dict, rounds: int, reps: int) -> dict[str, list[dict[str, float]]]:
    """``cell_cost`` in rounds alternated between ``ways`` (name -> what puts that way in place, called before each of
    its rounds; the first, as shipped, is put back at the end): each way's samples."""

    def measure(name: str) -> dict[str, float]:
        ways[name]()
        return cell_cost(cluster, reps)

    try:
        return alternated(list(ways), rounds, measure)
    finally:
        next(iter(ways.values()))()


def dashboard_refresh_ms(n: int, reps: int) -> float:
    from nbdist.widgets.dashboard import Dashboard

    rng = np.random.default_rng(0)
    board = Dashboard(ranks=n)
    rows = {r: [{"step": s, "loss": float(v)} for s, v in enumerate(rng.random(1000))] for r in range(n)}
    board.store.add_runs(rows)
    board.refresh()
    return timed(board.refresh, reps) * 1e3


def recovery_s(cluster: nbdist.Cluster) -> float:
    """Kill the last rank's engine and bring it back (%dist_restart --ranks): seconds to a usable world."""
    rank = cluster.world_size - 1
    os.kill(cluster.ranks[rank].pid, signal.SIGKILL)
    tic = time.perf_counter()
    cluster.restart([rank])
    cluster.run("t = torch.ones(1); dist.all_reduce(t)").raise_for_error()
    return time.perf_counter() - tic


def raw_ipyparallel(n: int) -> dict[str, float]:
    """ipyparallel's own n plain engines (no torch) on this host: start to all registered, then one execute."""
    import ipyparallel as ipp

    tic = time.perf_counter()
    cluster = ipp.Cluster(n=n, controller_ip="127.0.0.1", log_level=40)
    try:
        client = cluster.start_and_connect_sync()
        client.wait_for_engines(n, timeout=300)
        started = time.perf_counter() - tic
        view = client[:]
        view.execute("x = 1", block=True)
        execute = timed(lambda: view.execute("x = 1", block=True), 5)
        client.close()
    finally:
        cluster.stop_cluster_sync()
    return {"start_s": started, "view_execute_ms": execute * 1e3}


def fit(sizes: list[int], values: list[float]) -> dict[str, float]:
    """value ~ fixed + per_rank * n, by least squares."""
    per_rank, fixed = np.polyfit(np.array(sizes, float), np.array(values, float), 1)
    return {"fixed": float(fixed), "per_rank": float(per_rank)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", default="2,8,16,32,64")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    sizes = list(map(int, args.ranks.split(",")))
    out: dict[str, dict[str, object]] = {}
    for n in sizes:
        tic = time.perf_counter()
        with nbdist.start(n, oversubscribe=True, pin=False, timeout=240) as cluster:
            row: dict[str, object] = {"start_s": time.perf_counter() - tic}
            shown(cluster, "x = 1")  # warm
            row.update(cell_cost(cluster, args.reps))
            for name, code in (("same_line", PRINT), ("loss_line", LOSS)):
                row[f"{name}_lines_folded"] = len(shown(cluster, code).splitlines())
                row[f"{name}_lines_each"] = len(shown(cluster, code, each=True).splitlines())
            row["status_ms"] = timed(cluster.status, args.reps) * 1e3
            row["where_ms"] = timed(cluster.where, args.reps) * 1e3
            row["dashboard_refresh_ms"] = dashboard_refresh_ms(n, args.reps)
            row["recover_one_rank_s"] = recovery_s(cluster)
            if n <= 16:
                text = shown(cluster, TQDM)
                lines = [ln for ln in text.splitlines() if "train" in ln]
                row["tqdm_lines"] = len(lines)
                row["tqdm_bytes"] = len(text.encode())
        out[str(n)] = row
        print(
            f"{n:>2} ranks: start {row['start_s']:.1f} s; cell {row['nbdist_cell_ms']:.1f} ms vs view.execute "
            f"{row['view_execute_ms']:.1f} ms ({row['ratio']:.2f}x), {row['view_execute_all_output_ms']:.1f} ms with its "
            f"output all in ({row['ratio_all_output']:.2f}x; CPU in the notebook {row['notebook_cpu_ms']:.1f} ms, "
            f"controller {row['controller_cpu_ms']:.1f} ms); one print -> {row['same_line_lines_folded']} "
            f"line(s) ({row['same_line_lines_each']} unfolded), loss -> {row['loss_line_lines_folded']}; status "
            f"{row['status_ms']:.0f} ms, where {row['where_ms']:.0f} ms, dashboard refresh "
            f"{row['dashboard_refresh_ms']:.1f} ms, one rank recovered in {row['recover_one_rank_s']:.2f} s",
            flush=True,
        )
    keys = ["start_s", "nbdist_cell_ms", "view_execute_ms", "view_execute_all_output_ms", "own_cost_ms", "notebook_cpu_ms",
            "notebook_cpu_view_execute_ms", "controller_cpu_ms", "status_ms", "where_ms", "dashboard_refresh_ms",
            "recover_one_rank_s"]
    model = {k: fit(sizes, [float(out[str(n)][k]) for n in sizes]) for k in keys}  # type: ignore[arg-type]
    for k, m in model.items():
        print(f"  {k:>22}: {m['fixed']:8.2f} + {m['per_rank']:7.3f} per rank", flush=True)
    raw = raw_ipyparallel(max(sizes))
    ours = out[str(max(sizes))]
    print(
        f"raw ipyparallel, {max(sizes)} plain engines: start {raw['start_s']:.1f} s (nbdist "
        f"{float(ours['start_s']):.1f} s, {float(ours['start_s']) / raw['start_s']:.2f}x; goal <= 2x); "
        f"view.execute {raw['view_execute_ms']:.1f} ms",
        flush=True,
    )
    save("many_ranks", {"sizes": out, "model": model, "raw_ipyparallel": raw})


if __name__ == "__main__":
    main()
