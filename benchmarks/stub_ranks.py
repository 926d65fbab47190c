"""Stub ranks: what a cell costs the notebook at 64 to 256 ranks and beyond, on engines that do not import torch.

A world of real ranks past 64 does not fit this 2-core, 24 GiB machine (torch and a gloo group per rank). The cell's
control path does not need them: it is the notebook sending the cell to every engine, hearing each rank's reply and
output, and folding the lines. So this runs nbdist's own cell path (``cells.run.execute`` on an ``EngineSet``: the
same watch, release policy, transcript and folding a ``%%distributed`` cell takes) on plain ipyparallel engines behind
nbdist's controller, made to publish on iopub as nbdist's ranks do (``compat.lean_iopub``: no busy status, no echo of
a cell's code), and in the same run, alternated on the same engines:

- ipyparallel's ``DirectView.execute`` (what nbdist's cell is measured against at 2 to 64 ranks, many_ranks.py);
- nbdist's cell sent as one request that the controller's broadcast schedulers hand to each engine
  (``cells.run.BROADCAST_FROM``), each rank's reply and output still heard on their own;
- ipyparallel's ``BroadcastView.execute`` (the same one request; ipyparallel never coalesces an execute's replies);
- on ipyparallel's own cluster of as many plain engines, started after: ``DirectView.execute`` and the coalescing
  ``BroadcastView.apply`` of a no-op (one request down the tree, one reply up it: the anchor the issue names, 176 ms
  at 1,024 engines in ipyparallel's own benchmarks; it carries no output);
- a cell in which every rank prints the same line: nbdist folded (one line reaches the notebook) and
  ``DirectView.execute`` (each engine's line is heard, none shown).

Then a line through the sizes measured (fixed + per rank, least squares) gives the cost at 1,024 ranks, and each
engine's own memory (USS) says how many this machine could hold. Prints and saves results/stub_ranks.json.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import statistics
import sys
import tempfile
import time
from typing import Any

import psutil
from _common import save
from many_ranks import controller_of, fit  # controller_of reads any holder of pids(): an EngineSet here

from nbdist import compat
from nbdist.cells import run as cellrun
from nbdist.cells.run import execute
from nbdist.config import RunConfig, StartConfig
from nbdist.launch.launchers import LocalLauncher, build_cluster
from nbdist.launch.net import LOOPBACK
from nbdist.world import nodes
from nbdist.world.engineset import EngineSet

TRIVIAL = "x = 1"
LEAN = "from nbdist import compat\ncompat.lean_iopub(get_ipython().kernel)"  # no busy status, no echo of the code
PRINT = "print('epoch 1 done')"


class StubLauncher(LocalLauncher):
    """nbdist's controller (its heartbeat, keys and CurveZMQ), with ipyparallel's plain engines: no torch, no warm
    process, no process group."""

    def cluster(self, config: StartConfig, profile_dir: str, fresh: bool = True) -> Any:
        from ipyparallel.cluster.launcher import LocalEngineSetLauncher

        cluster, section = build_cluster(
            config,
            profile_dir,
            fresh=fresh,
            ip=LOOPBACK,
            engines=LocalEngineSetLauncher,
            engine_args=["--IPEngine.enable_nanny=False", "--IPEngine.timeout=600"],  # 256 register at once on 2 cores
        )
        section.engine_cmd = [sys.executable, "-m", "ipyparallel.engine"]
        cluster.config.LocalEngineSetLauncher.delay = 0.0
        cluster.config.LocalProcessLauncher.stop_seconds_until_kill = 2
        # the hub answers a new client slowly while 128 or more engines register on 2 cores (10 s: timed out at 128)
        cluster.connect_client_sync = functools.partial(cluster.connect_client_sync, timeout=600)
        return cluster

    def stopped(self) -> None:
        pass


def nbdist_cell(engines: EngineSet, code: str, broadcast: bool = False, counted: bool = True, tree: int = 0) -> str:
    """nbdist's cell on every rank, as ``cluster.run`` sends it (default output: folded, kept for a later page);
    ``broadcast``: as one request through the controller's broadcast schedulers; ``counted=False``: each rank ends its
    output with an idle status, as before the count in its reply (``compat.execute_heard``); ``tree``: through the
    nodes' leaders, in nodes of that many ranks (``cells.run.TREE_FROM``, ``world.nodes``)."""
    out = io.StringIO()
    ranks = [r.rank for r in engines.ranks]
    saved, cellrun.BROADCAST_FROM = cellrun.BROADCAST_FROM, (1 if broadcast else 10**9)
    saved_tree, cellrun.TREE_FROM = cellrun.TREE_FROM, (1 if tree else 10**9)
    saved_size, nodes.NODE_SIZE = nodes.NODE_SIZE, (tree or nodes.NODE_SIZE)
    heard = compat.execute_heard
    if not counted:
        compat.execute_heard = functools.partial(heard, counted=False)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            result = execute(engines, code, RunConfig(ranks=ranks), grace=5.0, watchdog=None, on_done=lambda r, k: [])
    finally:
        cellrun.BROADCAST_FROM, cellrun.TREE_FROM, nodes.NODE_SIZE = saved, saved_tree, saved_size
        compat.execute_heard = heard
    result.raise_for_error()  # type: ignore[union-attr]  # blocking: a RunResult
    return out.getvalue()


def noop() -> None:
    return None


def engines_uss_mib(engines: EngineSet) -> list[float]:
    """Each engine's own memory (USS, MiB): the controller's children that are engines."""
    controller_pid = None
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "nbdist.engine.controller" in " ".join(proc.cmdline()):
                controller_pid = proc.pid
    out = []
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "ipyparallel.engine" in " ".join(proc.cmdline()) and proc.pid != controller_pid:
                out.append(proc.memory_full_info().uss / 2**20)
    return out


def measure(n: int, reps: int) -> dict[str, Any]:
    config = StartConfig.of(n=n, oversubscribe=True, pin=False, timeout=600)
    with tempfile.TemporaryDirectory(prefix="nbdist-stub-") as workdir:
        engines = EngineSet(config, StubLauncher(), workdir)
        tic = time.perf_counter()
        try:
            engines.start()
            row: dict[str, Any] = {"start_s": time.perf_counter() - tic}
            ids = engines.engine_ids([r.rank for r in engines.ranks])
            direct = engines.view([r.rank for r in engines.ranks])
            direct.execute(LEAN, block=True)  # as nbdist's ranks publish (compat.lean_iopub), both ways measured here
            broadcast = engines.client.broadcast_view(targets=ids)
            kinds = {
                "nbdist_cell_ms": lambda: nbdist_cell(engines, TRIVIAL),
                "nbdist_cell_idle_ms": lambda: nbdist_cell(engines, TRIVIAL, counted=False),
                "nbdist_broadcast_cell_ms": lambda: nbdist_cell(engines, TRIVIAL, broadcast=True),
                "view_execute_ms": lambda: direct.execute(TRIVIAL, block=True),
                "broadcast_execute_ms": lambda: broadcast.execute(TRIVIAL, block=True),
                "nbdist_print_folded_ms": lambda: nbdist_cell(engines, PRINT),
                "nbdist_broadcast_print_folded_ms": lambda: nbdist_cell(engines, PRINT, broadcast=True),
                "view_execute_print_ms": lambda: direct.execute(PRINT, block=True),
            }
            for run in kinds.values():  # warm: the views' sockets, the first transcript
                run()
            samples: dict[str, list[float]] = {k: [] for k in kinds}
            cpu: dict[str, float] = {k: 0.0 for k in kinds}
            ctl: dict[str, float] = {k: 0.0 for k in kinds}
            controller = controller_of(engines)
            for _ in range(reps):
                for kind, run in kinds.items():
                    mine, theirs = time.process_time(), sum(controller.cpu_times()[:2])
                    tic = time.perf_counter()
                    run()
                    samples[kind].append((time.perf_counter() - tic) * 1e3)
                    cpu[kind] += (time.process_time() - mine) * 1e3 / reps
                    ctl[kind] += (sum(controller.cpu_times()[:2]) - theirs) * 1e3 / reps
            row.update({k: statistics.median(v) for k, v in samples.items()})
            row["notebook_cpu"], row["controller_cpu"] = cpu, ctl
            row["folded_lines"] = len(nbdist_cell(engines, PRINT).splitlines())
            row["folded_lines_broadcast"] = len(nbdist_cell(engines, PRINT, broadcast=True).splitlines())
            uss = engines_uss_mib(engines)
            row["engine_uss_mib"] = statistics.median(uss) if uss else None
            row["engines_seen"] = len(uss)
        finally:
            engines.stop()
    row.update(raw_anchor(n, reps))
    return row


def raw_anchor(n: int, reps: int) -> dict[str, float]:
    """ipyparallel's own cluster of n plain engines (its controller as ipyparallel starts it: a coalescing apply hangs
    behind nbdist's, threaded and under CurveZMQ): ``DirectView.execute`` and the coalescing ``apply`` of a no-op."""
    import ipyparallel as ipp

    cluster = ipp.Cluster(n=n, controller_ip=LOOPBACK, log_level=40)
    # one process per engine (no nanny), and a registration that may wait: 128 engines with nannies did not all come
    cluster.config.LocalEngineSetLauncher.engine_args = ["--IPEngine.timeout=600", "--IPEngine.enable_nanny=False"]
    try:
        cluster.start_cluster_sync()
        client = cluster.connect_client_sync(timeout=600)
        client.wait_for_engines(n, timeout=600)
        direct, coalescing = client[:], client.broadcast_view(is_coalescing=True)
        kinds = {
            "raw_view_execute_ms": lambda: direct.execute(TRIVIAL, block=True),
            "raw_coalescing_apply_ms": lambda: coalescing.apply_sync(noop),
        }
        for run in kinds.values():
            run()
        samples: dict[str, list[float]] = {k: [] for k in kinds}
        for _ in range(reps):
            for kind, run in kinds.items():
                tic = time.perf_counter()
                run()
                samples[kind].append((time.perf_counter() - tic) * 1e3)
        client.close()
    finally:
        cluster.stop_cluster_sync()
    return {k: statistics.median(v) for k, v in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", default="16,64,128,256")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--model", type=int, default=1024, help="the world size the line is carried to")
    args = parser.parse_args()
    sizes = list(map(int, args.ranks.split(",")))
    out: dict[str, dict[str, Any]] = {}
    for n in sizes:
        row = measure(n, args.reps)
        out[str(n)] = row
        cpu, ctl = row["notebook_cpu"], row["controller_cpu"]
        print(
            f"{n:>4} stub ranks: start {row['start_s']:.1f} s; trivial cell: nbdist {row['nbdist_cell_ms']:.1f} ms "
            f"(idle as before {row['nbdist_cell_idle_ms']:.1f}; broadcast {row['nbdist_broadcast_cell_ms']:.1f}), DirectView.execute {row['view_execute_ms']:.1f} ms "
            f"({row['nbdist_cell_ms'] / row['view_execute_ms']:.2f}x), BroadcastView.execute "
            f"{row['broadcast_execute_ms']:.1f} ms; raw ipyparallel: DirectView.execute {row['raw_view_execute_ms']:.1f} ms, "
            f"coalescing apply {row['raw_coalescing_apply_ms']:.1f} ms; one print on "
            f"every rank: nbdist {row['nbdist_print_folded_ms']:.1f} ms (broadcast "
            f"{row['nbdist_broadcast_print_folded_ms']:.1f}; {row['folded_lines']}/{row['folded_lines_broadcast']} "
            f"line), DirectView {row['view_execute_print_ms']:.1f} ms; notebook CPU a trivial cell: nbdist "
            f"{cpu['nbdist_cell_ms']:.1f} ms (idle as before {cpu['nbdist_cell_idle_ms']:.1f}; broadcast "
            f"{cpu['nbdist_broadcast_cell_ms']:.1f}), DirectView "
            f"{cpu['view_execute_ms']:.1f} ms; controller CPU: nbdist {ctl['nbdist_cell_ms']:.1f} ms (idle as before "
            f"{ctl['nbdist_cell_idle_ms']:.1f}; broadcast "
            f"{ctl['nbdist_broadcast_cell_ms']:.1f}), DirectView {ctl['view_execute_ms']:.1f} ms; an engine {row['engine_uss_mib']:.0f} MiB of its own",
            flush=True,
        )
    keys = [k for k, v in out[str(sizes[0])].items() if k.endswith("_ms") and isinstance(v, float)] + ["start_s"]
    model = {k: fit(sizes, [float(out[str(n)][k]) for n in sizes]) for k in keys}
    for side in ("notebook_cpu", "controller_cpu"):  # the CPU a cell takes, for the kinds sent through nbdist's client
        for k in ("nbdist_cell_ms", "nbdist_cell_idle_ms", "view_execute_ms"):
            model[f"{side}.{k}"] = fit(sizes, [float(out[str(n)][side][k]) for n in sizes])
    at = {k: m["fixed"] + m["per_rank"] * args.model for k, m in model.items()}
    for k, m in model.items():
        print(
            f"  {k:>24}: {m['fixed']:8.2f} + {m['per_rank']:7.3f} per rank -> {at[k]:9.1f} at {args.model}", flush=True
        )
    uss = [float(r["engine_uss_mib"]) for r in out.values() if r["engine_uss_mib"]]
    avail = psutil.virtual_memory().total / 2**20
    fits = int(avail * 0.8 / statistics.median(uss)) if uss else None
    print(
        f"  an engine holds {statistics.median(uss):.0f} MiB of its own: about {fits} fit in 80% of this machine's "
        f"{avail / 1024:.0f} GiB",
        flush=True,
    )
    save("stub_ranks", {"sizes": out, "model": model, "at": {str(args.model): at}, "engines_that_fit": fits})


if __name__ == "__main__":
    main()
