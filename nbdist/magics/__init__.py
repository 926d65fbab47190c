"""IPython magics: parse the line, build a config, call the API. Nothing else.

%dist_start, %dist_attach, %dist_status, %dist_where, %dist_restart, %dist_grow, %dist_stop, %%distributed, %%rank,
%dist_mode, %dist_push, %dist_pull; %dist_run and %dist_export live in scripts.py, %%dist_fit in fit.py."""

from __future__ import annotations

import os
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class, needs_local_scope
from IPython.core.magic_arguments import argument, magic_arguments

from .. import cluster as api
from ..config import BACKENDS, RankSpec, launchers
from ..errors import ClusterError, ConfigError
from ..results import GROUP_ABOVE, STATE_COLOURS, grouped, state_phrase
from ..stragglers import slow
from .common import (
    USAGE,
    call,
    cell_options,
    check_choice,
    given_options,
    keep_running,
    names_and_ranks,
    parse,
    show,
    strip_comment,
    with_launcher_options,
)


@magics_class
class DistMagics(Magics):
    """The magics are thin faces on nbdist.start / Cluster."""

    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        self.mode = False

    # ---------------------------------------------------------------- lifecycle

    @magic_arguments()
    @argument(
        "-n",
        type=int,
        default=None,
        help="number of ranks (default: one per allocated GPU or task in a Slurm job, one per GPU here, else 2)",
    )
    @argument(
        "--backend", default=None, metavar="gloo|nccl", help="gloo or nccl (default: nccl when every rank has a GPU)"
    )
    @argument("--launcher", default=None, help="filled from the launchers known when the magic runs")
    @argument("--timeout", type=float, default=45.0, metavar="S", help="seconds to wait for the world to form")
    @argument("--oversubscribe", action="store_true", help="allow more ranks than cores")
    @argument("--threads", type=int, default=None, metavar="N", help="threads per rank (OMP_NUM_THREADS; on Ray, the "
              "CPUs each rank holds); default: a host's cores / its ranks")
    @argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="let every rank run on every core (default: each rank its own)",
    )
    @argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="recover from this many rank deaths by itself: restart, replay --setup cells, load the checkpoint, re-run",
    )
    @argument(
        "--recover-from",
        choices=["peer", "checkpoint"],
        default="peer",
        help="with --max-restarts, rebuild a lost rank from the living ranks' memory (peer: no step recomputed; "
        "the last checkpoint where it cannot) or always from the last checkpoint",
    )
    @argument(
        "--min-ranks",
        type=int,
        default=None,
        metavar="N",
        help="with --max-restarts, when a lost rank's replacement cannot start (its node is gone), go on with the "
        "ranks left, down to N (the process group rebuilt, the data split again, nothing recomputed)",
    )
    @argument(
        "--debug-collectives",
        action="store_true",
        help="check every collective across ranks (TORCH_DISTRIBUTED_DEBUG=DETAIL): a mismatch fails instead of hanging",
    )
    @argument(
        "--restart",
        action="store_true",
        help="replace a world that runs already (its ranks' variables are lost); without it the same %%dist_start "
        "keeps that world, and another asks for --restart or %%dist_stop",
    )
    @argument(
        "--keep",
        default=None,
        metavar="DURATION",
        help="the ranks outlive this kernel for at most DURATION idle (30m, 2h); %%dist_attach in a new kernel "
        "reconnects (default: they end with the kernel)",
    )
    @line_magic
    def dist_start(self, line: str = "") -> None:
        """Start n ranked engines with an initialised torch.distributed world."""
        args = parse(with_launcher_options(self.dist_start), line)
        if args is None:  # --help: shown
            return None
        check_choice(args.backend, BACKENDS, "backend")
        check_choice(args.launcher, tuple(launchers.known()), "launcher")
        try:
            old = api.current()
        except ClusterError:
            old = None
        given = given_options(
            self.dist_start, args
        )  # each option's dest is a keyword of StartConfig.of (a test checks)
        if old is not None and not args.restart:
            keep_running(old, given, strip_comment(line))
            return None
        if old is not None:
            print(f"stopping the running world ({old.world_size} ranks) first: --restart")
            old.stop()
        try:
            cluster = api.start(**given)
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
        except ClusterError as exc:
            raise UsageError(str(exc)) from None
        if cluster.chosen:
            print(cluster.chosen)
        hosts = sorted({r.host for r in cluster.ranks})
        where = f" on {len(hosts)} hosts ({', '.join(hosts)})" if len(hosts) > 1 else ""
        print(
            f"{cluster.world_size} ranks ready{where}, backend {cluster.backend}, "
            f"in {cluster.startup['total']:.1f} s; torch and dist (torch.distributed) are imported on every rank. "
            "Run cells on them with %%distributed."
        )

    @magic_arguments()
    @argument("name", nargs="?", default=None, metavar="NAME", help="the kept world (default: the newest)")
    @line_magic
    def dist_attach(self, line: str = "") -> None:
        """Reconnect this kernel to a world kept by %dist_start --keep (yours, on this host), proved alive."""
        args = parse(self.dist_attach, line)
        if args is None:  # --help: shown
            return None
        cluster = call(lambda: api.attach(args.name))
        assert cluster.keeper is not None and cluster.keeper.record is not None
        print(
            f"attached to {cluster.keeper.record.name}: {cluster.world_size} ranks, backend {cluster.backend}; every "
            "rank answered with its pid just now. Variables, models and the process group are as they were left."
        )

    @magic_arguments()
    @argument("--all", action="store_true", help=f"one row per rank, also above {GROUP_ABOVE} ranks")
    @line_magic
    def dist_status(self, line: str = "") -> None:
        """Show rank, engine id, host, pid, device (and GPU: name, memory held), backend and state of each rank;
        above GROUP_ABOVE ranks, one line per kind of rank (``--all``: every row)."""
        args = parse(self.dist_status, line)
        if args is None:  # --help: shown
            return None
        cluster = call(api.current)
        rows = call(cluster.status)
        if cluster.keeper is not None:
            print(cluster.keeper.describe())
        if cluster.membership.sizes:  # the world went on with fewer ranks (--min-ranks), or grew
            print(cluster.membership.sizes_line())
        if cluster.engines is not None and cluster.engines.standby is not None:  # world/standby.py
            print(cluster.engines.standby.said() + ".")
        if len(rows) > GROUP_ABOVE and not args.all:
            for text in grouped(rows):
                print(text)
            print("(%dist_status --all: one row per rank)")
            return
        for r in rows:  # a busy rank's line, when it said
            r["state"] = state_phrase(r["state"], r["line"])
        cols = ["rank", "engine_id", "host", "pid", "device", "backend", "state"]
        if any(r["gpu"] for r in rows):
            cols.insert(5, "gpu")
        widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in cols]
        print("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)))
        for r in rows:
            print("  ".join(str(r[c]).ljust(w) for c, w in zip(cols, widths, strict=True)))

    @magic_arguments()
    @argument("--all", action="store_true", help=f"one entry per rank, also above {GROUP_ABOVE} ranks")
    @line_magic
    def dist_where(self, line: str = "") -> None:
        """Where each rank is now (also while a --noblock cell runs): its cell lines, its last collective,
        and the rank whose position differs from the others; above GROUP_ABOVE ranks, ranks at the same
        place are one entry (``--all``: one per rank)."""
        args = parse(self.dist_where, line)
        if args is None:  # --help: shown
            return None
        cluster = call(api.current)
        group = cluster.world_size > GROUP_ABOVE and not args.all
        for text in call(lambda: cluster.where(group=group)):
            print(text)

    @magic_arguments()
    @argument("--ranks", default=None, metavar="SPEC", help="restart only these ranks (default: all)")
    @line_magic
    def dist_restart(self, line: str = "") -> None:
        """Replace the engines (all, or --ranks) and rebuild the world with the same ranks."""
        args = parse(self.dist_restart, line)
        if args is None:  # --help: shown
            return None
        seconds = call(lambda: api.current().restart(args.ranks))
        print(f"world rebuilt in {seconds:.1f} s; restarted ranks start with empty namespaces.")

    @magic_arguments()
    @argument("count", type=int, metavar="N", help="how many ranks to add")
    @line_magic
    def dist_grow(self, line: str = "") -> None:
        """Add N ranks: the setup cells run again on every rank, the new ranks take the training state from a
        living rank's memory, and the loaders split the rest of the epoch over the larger world. Beside a --noblock
        cell that trains, at its loop's next step boundary, and the cell goes on with them."""
        args = parse(self.dist_grow, line)
        if args is None:  # --help: shown
            return None
        call(lambda: api.current().grow(args.count))  # its line is printed as it is said

    @magic_arguments()
    @argument("--ranks", default=None, metavar="SPEC", help="ranks to draw one by one beside the spread: 3 or 3,14")
    @line_magic
    def dist_dashboard(self, line: str = "") -> Any:
        """Plot what the last %%distributed cell logged with nbdist.log (above 8 ranks: the spread over
        ranks, the slowest and the fastest; --ranks SPEC draws those ranks too)."""
        from ..config import parse_ranks
        from ..widgets.dashboard import Dashboard

        args = parse(self.dist_dashboard, line)
        if args is None:  # --help: shown
            return None
        last = call(api.current).last
        metrics = getattr(last, "metrics", None)
        if last is not None and not metrics and hasattr(last, "wait"):
            metrics = last.wait(show=False).metrics
        if not metrics or not any(metrics.values()):
            raise UsageError(
                "the last cell logged no metrics; call nbdist.log(step=i, loss=...) in a %%distributed cell."
            )
        picked = call(lambda: parse_ranks(args.ranks, call(api.current).world_size)) if args.ranks else []
        board = Dashboard(picked=picked, ranks=len(metrics), palette=STATE_COLOURS, judge=slow)
        board.store.add_runs(metrics)
        return board.figure()

    @line_magic
    def dist_bench(self, line: str = "") -> Any:
        """All-reduce bandwidth sweep (4 KiB to 64 MiB) beside memcpy, and the scaling report."""
        from ..tools.bench import bench, figure

        report = call(bench)
        for r in report["allreduce"]:
            print(
                f"{r['bytes']:>10,d} B  {r['seconds'] * 1e6:9.1f} us  algbw {r['algbw_GBps']:6.3f} GB/s  busbw {r['busbw_GBps']:6.3f} GB/s"
            )
        print(f"memcpy on one rank: {report['memcpy_GBps']:.2f} GB/s")
        sc = report.get("scaling")
        if sc:
            n = report["world_size"]
            print(
                f"training throughput (one small MLP, samples/s): 1 rank alone {sc['one_rank_samples_per_s']:.0f}; "
                f"{n} ranks {sc['n_ranks_samples_per_s']:.0f} ({sc['n_ranks_no_comm_samples_per_s']:.0f} without the "
                f"all-reduce); one process on all {sc['cores']} cores, no ranks, {sc['one_process_all_cores_samples_per_s']:.0f}\n"
                f"scaling efficiency = {n} ranks / ({n} x 1 rank) = {sc['efficiency']:.0%}"
            )
        self.shell.user_ns["bench_report"] = report  # type: ignore[union-attr]
        return figure(report)

    @line_magic
    def dist_stop(self, line: str = "") -> None:
        """Stop the engines and controller nbdist started."""
        try:
            cluster = api.current()
        except ClusterError:
            print("no cluster is running")
            return
        cluster.stop()
        jobs = (
            f"; cancelled Slurm job(s) {', '.join(cluster.membership.cancelled)}"
            if cluster.membership.cancelled
            else ""
        )
        print(f"cluster stopped{jobs}")

    # ---------------------------------------------------------------- running code

    @magic_arguments()
    @argument("--ranks", default=None, metavar="SPEC", help="ranks to run on: 0, 0,2 or 1-3 (default: all)")
    @cell_options
    @cell_magic
    def distributed(self, line: str, cell: str) -> Any:
        """Run the cell on every rank (or --ranks), output tagged by rank."""
        args = parse(self.distributed, line, cell=True)
        if args is None:  # --help: shown
            return None
        return self._run(cell, args.ranks, args)

    @magic_arguments()
    @argument("spec", metavar="SPEC", help="ranks to run on: 0, 0,2 or 1-3")
    @cell_options
    @cell_magic
    def rank(self, line: str, cell: str) -> Any:
        """%%rank SPEC: shorthand for %%distributed --ranks SPEC."""
        args = parse(self.rank, line, cell=True)
        if args is None:  # --help: shown
            return None
        return self._run(cell, args.spec, args)

    def _run(self, cell: str, ranks: RankSpec, args: Any) -> Any:
        """Run a cell with the options every cell magic takes (``cell_options``)."""
        cluster = call(api.current)
        block = not args.noblock
        result = call(
            lambda: cluster.run(
                cell, ranks=ranks, timeout=args.timeout, block=block, quiet=args.quiet, setup=args.setup, each=args.each
            )
        )
        return show(result, block)

    @line_magic
    def dist_mode(self, line: str = "") -> None:
        """%dist_mode on|off: run every following cell on all ranks."""
        word = line.strip().lower()
        if word not in ("on", "off"):
            raise UsageError(f"%dist_mode takes on or off, not {line.strip()!r}; type {USAGE['dist_mode']}")
        self.mode = word == "on"
        assert self.shell is not None  # set by IPython when the magics are registered
        transformers = self.shell.input_transformers_cleanup
        if self.mode and self.mode_transform not in transformers:
            transformers.insert(0, self.mode_transform)
        if not self.mode and self.mode_transform in transformers:
            transformers.remove(self.mode_transform)
        print("every cell now runs on all ranks" if self.mode else "cells run locally again")

    def mode_transform(self, lines: list[str]) -> list[str]:
        if not self.mode or not lines:
            return lines
        first = next((ln for ln in lines if ln.strip()), "")
        if first.lstrip().startswith(("%%", "%dist_", "!")):
            return lines
        return ["%%distributed\n", *lines]

    # ---------------------------------------------------------------- data

    @needs_local_scope
    @line_magic
    def dist_push(self, line: str = "", local_ns: Any = None) -> None:
        """%dist_push a b: send notebook variables to every rank."""
        names, ranks = names_and_ranks(line, "dist_push")
        assert self.shell is not None
        ns = {**self.shell.user_ns, **(local_ns or {})}
        missing = [n for n in names if n not in ns]
        if missing:
            raise UsageError(
                f"{missing[0]!r} is not defined in this notebook; define it first, then {USAGE['dist_push']}"
            )
        call(lambda: api.current().push({n: ns[n] for n in names}, ranks=ranks))

    @line_magic
    def dist_pull(self, line: str = "") -> list[Any]:
        """%dist_pull name: a list with the variable's value on each rank, by rank."""
        names, ranks = names_and_ranks(line, "dist_pull")
        if len(names) != 1:
            raise UsageError(f"%dist_pull takes one name, got {len(names)}; type {USAGE['dist_pull']}")
        return list(call(lambda: api.current().pull(names[0], ranks=ranks)))


_LOADED: dict[int, DistMagics] = {}


def load(ipython: Any) -> None:
    from ..config import default_threads
    from ..launch import pool
    from . import fit, scripts, track

    magics = DistMagics(ipython)
    _LOADED[id(ipython)] = magics
    for face in (magics, scripts.ScriptMagics(ipython), fit.FitMagics(ipython), track.TrackMagics(ipython)):
        ipython.register_magics(face)
    # Import torch for the likely first %dist_start (2 ranks) while the user types it; inside a
    # Slurm job the ranks start through srun on the allocation's nodes, so local ones would be wasted.
    if not os.environ.get("SLURM_JOB_ID"):
        pool.warm(2, default_threads(2))


def unload(ipython: Any) -> None:
    from ..launch import pool

    pool.shutdown()
    magics = _LOADED.pop(id(ipython), None)
    if magics is not None and magics.mode_transform in ipython.input_transformers_cleanup:
        ipython.input_transformers_cleanup.remove(magics.mode_transform)
