"""What a cell's result keeps of each rank's nbdist.log rows: bounded, however long the cell runs."""

from __future__ import annotations

import math
from array import array
from typing import Any

KEPT_ROWS = 4_000  # nbdist.log rows a cell's result keeps per rank, at most
EXACT_ROWS = 1_000  # ... of which the last this many are every row


class KeptRows:
    """A rank's nbdist.log rows of one cell, bounded however long the cell runs: every row up to KEPT_ROWS, then
    the last EXACT_ROWS rows as they came and, of the older ones, every ``stride``-th (the first among them), the
    stride doubling whenever more would be kept: the whole run, evenly thinned, and the last steps exactly.

    Kept as columns of floats (``array``), not as the rows' dicts: a few rows kept out of every batch that arrives
    would each pin the memory of the batch around it (measured: +620 MiB in the kernel over 500,000 steps on 8
    ranks when 4,000 dicts a rank were kept, +21 MiB when none). A value a row lacks is NaN in its column, so a
    NaN logged on purpose comes back as a missing value."""

    __slots__ = ("numbers", "columns", "seen", "stride")

    def __init__(self) -> None:
        self.numbers = array("q")  # each kept row's number in the cell, in order
        self.columns: dict[str, array[float]] = {}  # name -> one value per kept row
        self.seen = 0
        self.stride = 1

    def add(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            self.numbers.append(self.seen)
            self.seen += 1
            size = len(self.numbers)
            for column in self.columns.values():
                column.append(math.nan)
            for key, value in row.items():
                values = self.columns.get(key)
                if values is None:
                    values = self.columns[key] = array("d", [math.nan]) * size
                try:
                    values[-1] = math.nan if value is None else float(value)
                except (TypeError, ValueError):
                    pass
            if size > KEPT_ROWS:
                self._thin()

    def _thin(self) -> None:
        """Drop the older rows off the stride; double it until there is room for half the older share again
        (so thinning runs once every (KEPT_ROWS - EXACT_ROWS) / 2 rows at most)."""
        exact_from = self.seen - EXACT_ROWS
        room = KEPT_ROWS - (KEPT_ROWS - EXACT_ROWS) // 2
        while True:
            keep = [i for i, n in enumerate(self.numbers) if n >= exact_from or n % self.stride == 0]
            if len(keep) <= room:
                break
            self.stride *= 2
        self.numbers = array("q", [self.numbers[i] for i in keep])
        self.columns = {k: array("d", [c[i] for i in keep]) for k, c in self.columns.items()}

    def __len__(self) -> int:
        return len(self.numbers)

    def rows(self) -> list[dict[str, Any]]:
        """The kept rows as dicts (a step that was a whole number is an int again)."""
        out = []
        for i in range(len(self.numbers)):
            row: dict[str, Any] = {}
            for key, column in self.columns.items():
                value = column[i]
                if value == value:  # not NaN
                    row[key] = int(value) if key == "step" and value.is_integer() else value
                elif key == "step":
                    row[key] = None
            out.append(row)
        return out
