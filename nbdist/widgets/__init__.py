"""Notebook views of cluster state (the live dashboard). Widgets draw what they are given: they import
nothing of nbdist's and never torch. A rank's state arrives as its word (``RankState``'s values)."""

from __future__ import annotations

STATE_COLOURS: dict[str, str] = {
    "idle": "#2e7d32",
    "busy": "#f9a825",
    "dead": "#c62828",
    "failed": "#c62828",
    "debugging": "#6a1b9a",
    "exited": "#546e7a",
    "restarting": "#1565c0",
}
