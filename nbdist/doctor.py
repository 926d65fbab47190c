"""The hang doctor's view: where each rank is, which collective it entered last, who is odd.

Pure functions over the reports engines write when asked where they are
(engine/runtime.py ``where``): ``%dist_where`` prints ``render``; the release notes
(results.py) use ``collective_text`` and ``odd_ranks`` so the watchdog says the same.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any


def collective_text(rep: dict[str, Any]) -> str:
    """'all_reduce [3] float32, this rank's collective #5 (group seq 9), waiting 12.0 s' or ''."""
    c = rep.get("collective") or {}
    if not c:
        return ""
    if not c.get("op"):
        return f"no collective called from Python yet (group seq {c.get('group_seq')})"
    shapes = ", ".join(c.get("shapes") or []) or "no tensors"
    state = "returned" if c.get("done") else f"waiting {c.get('seconds') or 0:.1f} s"
    seq = f" (group seq {c['group_seq']})" if c.get("group_seq") is not None else ""
    return f"{c['op']} {shapes}, this rank's collective #{c.get('count')}{seq}, {state}"


def odd_ranks(reports: dict[int, dict[str, Any]]) -> dict[int, str]:
    """The ranks whose position differs from the others, each with why (empty when none stands out).

    Ranks still in the cell while others finished it; else ranks behind on collectives
    (the others wait for them); else ranks outside a collective while the others wait in
    one; else ranks at a cell line the majority is not at.
    """
    if len(reports) < 2:
        return {}
    busy = {r for r, rep in reports.items() if rep.get("busy")}
    if busy and len(busy) < len(reports):
        idle = ", ".join(map(str, sorted(set(reports) - busy)))
        return {r: f"still in the cell; rank(s) {idle} finished it" for r in sorted(busy)}
    counts = {r: (rep.get("collective") or {}).get("count") or 0 for r, rep in reports.items()}
    if len(set(counts.values())) > 1:
        low, high = min(counts.values()), max(counts.values())
        ahead = sorted(r for r, c in counts.items() if c == high)
        op = (reports[ahead[0]].get("collective") or {}).get("op")
        return {
            r: f"behind: rank(s) {', '.join(map(str, ahead))} entered {op} #{high}; this rank is at #{low}"
            for r, c in sorted(counts.items())
            if c == low
        }
    inside = {r for r, rep in reports.items() if rep.get("in_collective")}
    if inside and len(inside) < len(reports):
        waiting = ", ".join(map(str, sorted(inside)))
        return {r: f"not in a collective while rank(s) {waiting} wait in one" for r in sorted(set(reports) - inside)}
    lines = Counter(rep.get("cell_line") for rep in reports.values())
    (common, n), *rest = lines.most_common()
    if rest and n > rest[0][1]:
        return {
            r: f"at cell line {rep.get('cell_line')}; the others are at line {common}"
            for r, rep in sorted(reports.items())
            if rep.get("cell_line") != common
        }
    return {}


def render(
    reports: dict[int, dict[str, Any]], who: dict[int, str] | None = None, hosts: dict[int, str] | None = None
) -> list[str]:
    """Lines for %dist_where: per rank its state, its cell lines (innermost last), its last collective.
    With ``hosts`` (rank -> host), ranks whose view is the same but for the seconds they have waited
    are one entry: 'ranks 0-13,15 on node1, node2: at cell line 5, ...' (the first one's view)."""
    who = who or {}
    blocks = {rank: _block(rank, rep, odd_ranks(reports)) for rank, rep in sorted(reports.items())}
    lines = []
    if hosts is None:
        for rank, block in blocks.items():
            name = f"rank {rank}" + (f" ({who[rank]})" if who.get(rank) else "")
            lines += [f"{name}: {block[0]}", *block[1:]]
    else:
        groups: dict[tuple[str, ...], list[int]] = {}
        for rank, block in blocks.items():
            groups.setdefault(tuple(_WAITED.sub("waiting", line) for line in block), []).append(rank)
        for ranks in groups.values():
            on = sorted({hosts[r] for r in ranks if hosts.get(r)})
            name = ranks_text(ranks) + (f" on {', '.join(on)}" if on else "")
            lines += [f"{name}: {blocks[ranks[0]][0]}", *blocks[ranks[0]][1:]]
    missing = sorted(set(who) - set(reports))
    if missing:
        lines.append(f"rank(s) {', '.join(map(str, missing))} did not answer (dead, or stuck outside Python)")
    return lines


_WAITED = re.compile(r"waiting [\d.]+ s")


def waiting(reports: dict[int, dict[str, Any]]) -> dict[int, str]:
    """What each rank that waits in a collective waits for, from the ranks' reports: 'waiting in barrier for rank
    1' (the ranks not in one, or behind it on collectives), or 'waiting in barrier' when all are there."""
    inside = {r for r, rep in reports.items() if rep.get("busy") and rep.get("in_collective")}
    counts = {r: (rep.get("collective") or {}).get("count") or 0 for r, rep in reports.items()}
    out = {}
    for rank in sorted(inside):
        rep = reports[rank]
        what = rep.get("function") or (rep.get("collective") or {}).get("op") or "a collective"
        late = [r for r in reports if r != rank and (r not in inside or counts[r] < counts[rank])]
        out[rank] = f"waiting in {what} for {ranks_text(late)}" if late else f"waiting in {what}"
    return out


def ranks_text(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> 'ranks 0-2,5'; [0, 1] -> 'ranks 0,1'; [3] -> 'rank 3'."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    spans: list[str] = []
    start = prev = ranks[0]
    for rank in [*ranks[1:], None]:
        if rank is not None and rank == prev + 1:
            prev = rank
            continue
        spans.append(f"{start}-{prev}" if prev - start >= 2 else ",".join(map(str, range(start, prev + 1))))
        if rank is not None:
            start = prev = rank
    return "ranks " + ",".join(spans)


def _block(rank: int, rep: dict[str, Any], odd: dict[int, str]) -> list[str]:
    """One rank's view: its state line (without its name), then its frames and last collective."""
    mark = f"   <-- {odd[rank]}" if rank in odd else ""
    lines = []
    if not rep.get("busy"):
        lines.append(f"idle (no cell running){mark}")
    else:
        where = f"cell line {rep['cell_line']}" if rep.get("cell_line") else "library code"
        inside = " (inside torch.distributed)" if rep.get("in_collective") else ""
        if rep.get("debugging"):  # its pdb waits for the notebook: where the person stopped it, not pdb's frames
            lines.append(f"in the debugger (breakpoint at {where}; type in the notebook's input box){mark}")
        else:
            lines.append(f"at {where}, in {rep.get('function')}{inside}{mark}")
        for frame in rep.get("cell_stack") or []:
            lines.append(f"    cell line {frame['line']:>3} in {frame['function']}: {frame.get('code') or ''}")
        inner = [s for s in rep.get("stack") or [] if "site-packages" in s or "/lib/python" in s][-2:]
        inner = [] if rep.get("debugging") else inner  # pdb's own frames say nothing about the cell
        for entry in inner:
            lines.append(f"    {entry}")
    text = collective_text(rep)
    if text:
        lines.append(f"    last collective: {text}")
    return lines
