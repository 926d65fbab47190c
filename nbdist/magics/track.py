"""%dist_track: the world's metrics to one run of an experiment tracker (nbdist.track)."""

from __future__ import annotations

from typing import Any

from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from ..tools.track import track, untrack
from .common import call, parse


@magics_class
class TrackMagics(Magics):
    @magic_arguments()
    @argument("kind", metavar="TRACKER", help="tensorboard, mlflow, wandb or trackio; off ends the run")
    @argument("name", nargs="?", default=None, help="the run's name (default: nbdist- and the date and time)")
    @argument(
        "--dir",
        default=None,
        metavar="DIR",
        help="where the run goes: TensorBoard's runs (default runs), MLflow's SQLite store (mlruns), W&B's "
        "wandb folder (.), trackio's TRACKIO_DIR",
    )
    @argument("--project", default=None, help="the W&B or trackio project, MLflow's experiment (default nbdist)")
    @argument("--uri", default=None, help="MLflow's tracking URI, instead of --dir (sqlite:///..., http://...)")
    @line_magic
    def dist_track(self, line: str = "") -> Any:
        """%dist_track tensorboard|mlflow|wandb|trackio [NAME] [--dir DIR] [--project P] [--uri URI]: from the next
        cell on, what every rank logs (and nbdist's step metrics) goes to one run for the world, written from the
        notebook, offline unless told otherwise; %dist_track off ends it."""
        args = parse(self.dist_track, line)
        if args is None:  # --help: shown
            return None
        if args.kind == "off":
            return print(call(untrack))
        tracker = call(lambda: track(args.kind, args.name, args.dir, args.project, args.uri))
        print(f"tracking this world in the {tracker.kind} run at {tracker.run.where} (from the next cell on)")
        return None
