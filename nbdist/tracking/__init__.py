"""Tracking: one run of an experiment tracker per world, written from the notebook (tracker.py), its steps going
on across cells, recoveries and size changes (steps.py), to a tracker opened and checked first (sinks.py, runs.py),
and opened again where a kept world's new kernel finds it (``resume``)."""

from __future__ import annotations

from .sinks import KINDS, open_run
from .tracker import Tracker, resume

__all__ = ["KINDS", "Tracker", "open_run", "resume"]
