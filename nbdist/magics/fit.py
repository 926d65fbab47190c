"""%%dist_fit: will the cell's model fit, and how fast is a step, under each strategy and world size."""

from __future__ import annotations

from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from ..tools.fit import fit
from .common import call, parse, usage


@magics_class
class FitMagics(Magics):
    @magic_arguments()
    @argument("-n", "--world-sizes", default="2,4,8", metavar="N,N", help="world sizes to forecast (default 2,4,8)")
    @argument(
        "--strategies",
        default="ddp,fsdp,tp,pp",
        metavar="S,S",
        help="ddp, fsdp, tp, pp, fsdp+tp (2-D: TP in pairs of ranks, FSDP across them); default: the first four",
    )
    @argument("--memory", default=None, metavar="SIZE", help="what one rank may hold (16GiB): name what fits")
    @argument("--device", default="cpu", metavar="D", help="cpu, cuda or cuda:N: where the ranks' tensors live")
    @argument("--microbatches", type=int, default=4, metavar="M", help="a pipeline's micro-batches per step")
    @argument("--timeout", type=float, default=120.0, metavar="S", help="seconds the forecast may take")
    @argument("--no-setup", action="store_true", help="do not run the world's --setup cells first")
    @argument("--watch", default=None, metavar="S", help="the strategy the run uses: its dashboards draw the forecast")
    @line_cell_magic
    def dist_fit(self, line: str = "", cell: str | None = None) -> Any:
        """%%dist_fit -n 2,4,8 --memory 16GiB: forecast each rank's peak memory and step time for the model the cell
        builds (it defines `model` and `batch`), under fake tensors: nothing the size of the model is allocated, and
        the world and the kernel are untouched."""
        args = parse(self.dist_fit, line, cell=cell is not None)
        if args is None:  # --help: shown
            return None
        if cell is None or not cell.strip():
            raise UsageError(
                f"%%dist_fit forecasts the model its cell builds: put the cell that defines `model` and `batch` under "
                f"{usage(self.dist_fit, cell=True)}"
            )
        return call(
            lambda: fit(
                cell,
                setup=not args.no_setup,
                watch=args.watch,
                strategies=args.strategies,
                world_sizes=args.world_sizes,
                memory=args.memory,
                microbatches=args.microbatches,
                timeout=args.timeout,
                device=args.device,
            )
        )
