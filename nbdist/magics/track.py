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
    @argument("kind", metavar="TRACKER", help="tensorboard, or off to end the run")
    @argument("name", nargs="?", default=None, help="the run's name (default: nbdist- and the date and time)")
    @argument("--dir", default=None, metavar="DIR", help="where TensorBoard's runs go (default: runs)")
    @line_magic
    def dist_track(self, line: str = "") -> Any:
        """%dist_track tensorboard [NAME] [--dir runs]: from the next cell on, what every rank logs (and nbdist's
        step metrics) goes to one run for the world, written from the notebook; %dist_track off ends it."""
        args = parse(self.dist_track, line)
        if args is None:  # --help: shown
            return None
        if args.kind == "off":
            return print(call(untrack))
        tracker = call(lambda: track(args.kind, args.name, args.dir))
        print(f"tracking this world in the {tracker.kind} run at {tracker.run.where} (from the next cell on)")
        return None
