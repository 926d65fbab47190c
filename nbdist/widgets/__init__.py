"""Notebook views of cluster state. Widgets read results; they never import torch."""

from __future__ import annotations

import html
from typing import Any

from ..results import RankState

STATE_COLOURS: dict[str, str] = {
    RankState.IDLE: "#2e7d32",
    RankState.BUSY: "#f9a825",
    RankState.DEAD: "#c62828",
    RankState.FAILED: "#c62828",
}


def status_html(rows: list[dict[str, Any]]) -> str:
    """An HTML table of Cluster.status() rows, the state cell coloured."""
    if not rows:
        return "<p>no ranks</p>"
    cols = list(rows[0])
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in cols)
    body = []
    for row in rows:
        cells = []
        for c in cols:
            value = html.escape(str(row[c]))
            if c == "state":
                colour = STATE_COLOURS.get(str(row[c]), "#555")
                value = f'<span style="color:{colour};font-weight:bold">{value}</span>'
            cells.append(f"<td>{value}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f'<table class="nbdist-status"><tr>{head}</tr>{"".join(body)}</table>'
