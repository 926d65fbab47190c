"""IPython's private names nbdist relies on (the shell's traceback and its compiled cells' file names)."""

from __future__ import annotations

from typing import Any


def show_error(shell: Any, exc: BaseException) -> None:
    """Show ``exc`` as the cell's error in one line ``Name: text`` (sent to the notebook, and what the reply's
    traceback holds), without the "use %tb" preamble IPython puts before an exception shown alone."""
    if shell is not None:
        shell._showtraceback(type(exc), exc, [f"{type(exc).__name__}: {exc}"])


def cell_filenames(shell: Any) -> dict[str, Any]:
    """File names IPython gave to the cells it compiled (``{}`` when there is no shell)."""
    return getattr(getattr(shell, "compile", None), "_filename_map", None) or {}
