"""What a session ran on its ranks, in order: the cells ``%dist_export`` turns into a script, and the
setup cells automatic recovery replays.

``Cluster`` adds every cell that succeeded (a failed one is the user's to fix and run
again; a cell re-run after an automatic restart is added once, when it succeeds) and the
names ``push`` sent from the notebook, which a script would not have.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SCRIPT = "# %dist_run "  # the first line of the code a %dist_run cell sends (tools/runscript.py)


@dataclass(slots=True)
class Cell:
    """One successful run on the ranks: its code, the ranks it ran on, how it was marked."""

    code: str
    ranks: list[int]
    setup: bool = False
    script: str = ""  # "train.py --epochs 1" for a %dist_run of a script

    def title(self) -> str:
        """Its first line that says something, for listings."""
        return title(self.code)


def title(code: str) -> str:
    """A cell's first line that says something ('%dist_run train.py --epochs 1' for a script), for listings."""
    if code.startswith(SCRIPT):
        return f"%dist_run {code.splitlines()[0][len(SCRIPT) :]}"
    lines = [ln.strip() for ln in code.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    return (lines[0] if lines else "(empty)")[:70]


@dataclass(slots=True)
class History:
    cells: list[Cell] = field(default_factory=list)
    pushed: set[str] = field(default_factory=set)

    def setup_cells(self) -> list[Cell]:
        """The cells marked ``--setup``, each once, in the order of its last run (what recovery replays)."""
        last = {c.code: i for i, c in enumerate(self.cells) if c.setup}
        return [self.cells[i] for i in sorted(last.values())]

    def add(self, code: str, ranks: list[int], setup: bool) -> None:
        script = code.splitlines()[0][len(SCRIPT) :] if code.startswith(SCRIPT) else ""
        self.cells.append(Cell(code, list(ranks), setup, script))

    def renumber(self, new: dict[int, int]) -> None:
        """The world went on with fewer ranks (``new``: each remaining rank's old number to its new one): the
        cells ran on the ranks that remain, by their new numbers (what a replay after it runs them on)."""
        for cell in self.cells:
            cell.ranks = [new[r] for r in cell.ranks if r in new]

    def widen(self, before: int, after: int) -> None:
        """The world grew from ``before`` ranks to ``after``: a cell that ran on every rank runs on every rank."""
        for cell in self.cells:
            if cell.ranks == list(range(before)):
                cell.ranks = list(range(after))
