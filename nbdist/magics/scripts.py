"""%dist_run, %dist_export, %dist_debug, %dist_equiv and %dist_why: a torchrun script into the ranks, the session's
cells out to one, pdb on a rank, one rank against N, what holds the world back."""

from __future__ import annotations

import argparse
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from .. import cluster as api
from ..results import RunResult
from ..tools import debug as debugging
from ..tools import equiv as equivalence
from ..tools import export as exporting
from ..tools import why as slowness
from ..tools.runscript import run_script
from .common import call, cell_options, parse, show, usage


@magics_class
class ScriptMagics(Magics):
    @magic_arguments()
    @argument("--ranks", default=None, metavar="SPEC", help="ranks to run on: 0, 0,2 or 1-3 (default: all)")
    @cell_options
    @argument("script", nargs="?", default=None, metavar="script.py", help="the torchrun-style script to run")
    @argument("args", nargs=argparse.REMAINDER, metavar="...", help="the script's own arguments (its sys.argv[1:])")
    @line_magic
    def dist_run(self, line: str = "") -> Any:
        """%dist_run train.py --epochs 1: run a torchrun-style script, unchanged, on every rank as one cell."""
        args = parse(self.dist_run, line)
        if args is None:  # --help: shown
            return None
        if not args.script:
            raise UsageError(f"name the script to run; type {usage(self.dist_run)}")
        cluster = call(api.current)
        block = not args.noblock
        result = call(
            lambda: run_script(
                cluster,
                args.script,
                args.args,
                ranks=args.ranks,
                timeout=args.timeout,
                block=block,
                quiet=args.quiet,
                each=args.each,
                setup=args.setup,
            )
        )
        return show(result, block)

    @magic_arguments()
    @argument(
        "path",
        nargs="?",
        default=None,
        metavar="train.py",
        help="the script to write, e.g. train.py (train.sbatch goes beside it)",
    )
    @argument(
        "--cells",
        default=None,
        metavar="1-3,5",
        help="the cells to export, numbered as --list shows: 1-3,5 (default: all)",
    )
    @argument("--list", action="store_true", help="list the session's cells with their numbers")
    @argument("--force", action="store_true", help="replace a file that %%dist_export did not write")
    @line_magic
    def dist_export(self, line: str = "") -> None:
        """Write the session's distributed cells as a script for torchrun, and an sbatch script beside it."""
        args = parse(self.dist_export, line)
        if args is None:  # --help: shown
            return None
        cluster = call(api.current)
        if args.list:
            lines = exporting.listing(cluster.history)
            print("\n".join(lines) if lines else "no cell has run on the ranks yet")
            return
        if not args.path:
            raise UsageError(f"name the script to write; type {usage(self.dist_export)}")
        done = call(
            lambda: exporting.export(cluster.history, cluster.shape, args.path, cells=args.cells, force=args.force)
        )
        print(
            f"wrote {done.script} ({len(done.cells)} cell(s)) and {done.sbatch.name}; "
            f"run it with: {done.command}, or on Slurm: sbatch {done.sbatch.name}"
        )
        for note in done.notes:
            print(note)

    @magic_arguments()
    @argument(
        "rank",
        nargs="?",
        type=int,
        default=None,
        help="the rank to debug (default: the one whose error failed the last cell)",
    )
    @line_magic
    def dist_debug(self, line: str = "") -> None:
        """Post-mortem pdb on a rank's last exception, typed here as with %debug (p, up, l, q)."""
        args = parse(self.dist_debug, line)
        if args is None:  # --help: shown
            return None
        cluster = call(api.current)
        call(lambda: debugging.debug(cluster, args.rank))

    @magic_arguments()
    @argument("--steps", type=int, default=equivalence.STEPS, metavar="N", help="optimizer steps compared (default 20)")
    @argument("--timeout", type=float, default=None, metavar="S", help="seconds before each run's ranks are released")
    @argument("function", nargs="?", default=None, help="(line form) a function defined on the ranks: runs function()")
    @line_cell_magic
    def dist_equiv(self, line: str = "", cell: str | None = None) -> Any:
        """%%dist_equiv: run the training cell on one rank and on every rank, compare loss, data, gradients and
        learning rate step by step, and say why they differ (or that they agree). %dist_equiv train: train().
        The verdict is the cell's value (``_.cause``, ``_.step``, ``_.figures``)."""
        args = parse(self.dist_equiv, line, cell=cell is not None)
        if args is None:  # --help: shown
            return None
        if (cell is None) == (args.function is None):
            raise UsageError(
                "give the training code as the cell (%%dist_equiv) or name a function defined on the ranks "
                f"(%dist_equiv train), not both or neither; type {usage(self.dist_equiv)}"
            )
        code = cell if cell is not None else f"{args.function}()"
        cluster = call(api.current)
        return call(lambda: equivalence.equiv(code, cluster, steps=args.steps, timeout=args.timeout))

    @magic_arguments()
    @argument("--timeout", type=float, default=None, metavar="S", help="seconds before the ranks are released")
    @line_cell_magic
    def dist_why(self, line: str = "", cell: str | None = None) -> Any:
        """%%dist_why: run the training cell with each step's phases timed on every rank; which rank holds the world
        back and why (slow input, compute skew, slow communication, a host pause, a checkpoint or evaluation in the
        loop), or 'balanced'; a hang or a desync is named while it hangs. %dist_why: the last cell's verdict."""
        args = parse(self.dist_why, line, cell=cell is not None)
        if args is None:  # --help: shown
            return None
        cluster = call(api.current)
        if cell is None:
            last = cluster.last
            if not isinstance(last, RunResult):
                raise UsageError("no finished cell to judge; run the training cell with %%dist_why")
            return slowness.verdict_of(last, cluster.world_size, slowness.crowding(cluster))
        return call(lambda: slowness.why(cell, cluster, timeout=args.timeout))
