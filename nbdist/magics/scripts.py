"""%dist_run, %dist_export and %dist_debug: a torchrun script into the ranks, the session's cells out to one, pdb on a rank."""

from __future__ import annotations

import shlex
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from .. import cluster as api
from ..tools import debug as debugging
from ..tools import export as exporting
from ..tools.runscript import run_script
from .common import USAGE, call, parse, show, usage

_RUN_OPTIONS = {"--ranks": True, "--timeout": True, "--noblock": False, "--quiet": False}  # True: takes a value


@magics_class
class ScriptMagics(Magics):
    @line_magic
    def dist_run(self, line: str = "") -> Any:
        """%dist_run train.py --epochs 1: run a torchrun-style script, unchanged, on every rank as one cell."""
        try:
            words = shlex.split(line)
        except ValueError as exc:
            raise UsageError(f"{exc} in {line!r}; type {USAGE['dist_run']}") from None
        opts: dict[str, Any] = {}
        while words and words[0].startswith("--") and words[0].split("=")[0] in _RUN_OPTIONS:
            name, _, value = words.pop(0).partition("=")
            if _RUN_OPTIONS[name] and not value:
                if not words:
                    raise UsageError(f"{name} needs a value; type {USAGE['dist_run']}")
                value = words.pop(0)
            opts[name] = value if _RUN_OPTIONS[name] else True
        if not words:
            raise UsageError(f"name the script to run; type {USAGE['dist_run']}")
        try:
            timeout = float(opts["--timeout"]) if "--timeout" in opts else None
        except ValueError:
            raise UsageError(f"--timeout {opts['--timeout']!r} is not a number of seconds; e.g. --timeout 60") from None
        block = not opts.get("--noblock")
        cluster = call(api.current)
        result = call(
            lambda: run_script(
                cluster,
                words[0],
                words[1:],
                ranks=opts.get("--ranks"),
                timeout=timeout,
                block=block,
                quiet=bool(opts.get("--quiet")),
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
        cluster = call(api.current)
        if args.list:
            lines = exporting.listing(cluster.history)
            print("\n".join(lines) if lines else "no cell has run on the ranks yet")
            return
        if not args.path:
            raise UsageError(f"name the script to write; type {usage(self.dist_export)}")
        done = call(lambda: exporting.export(cluster.history, cluster.shape, args.path, cells=args.cells, force=args.force))
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
        cluster = call(api.current)
        call(lambda: debugging.debug(cluster, args.rank))
