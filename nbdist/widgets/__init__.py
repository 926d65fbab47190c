"""Notebook views of cluster state (the live dashboard). Widgets read results; they never import torch."""

from __future__ import annotations

from ..results import RankState

STATE_COLOURS: dict[str, str] = {
    RankState.IDLE: "#2e7d32",
    RankState.BUSY: "#f9a825",
    RankState.DEAD: "#c62828",
    RankState.FAILED: "#c62828",
}
