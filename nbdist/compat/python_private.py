"""Python's own private names nbdist relies on (argparse's actions, CPython's frames of each thread)."""

from __future__ import annotations

from typing import Any


def parser_actions(parser: Any) -> list[Any]:
    """The actions (options and positionals) an argparse parser declares, help included."""
    return list(parser._actions)


def thread_frames() -> dict[int, Any]:
    """Each thread's current frame, by thread id (CPython's ``sys._current_frames``)."""
    import sys

    return sys._current_frames()
