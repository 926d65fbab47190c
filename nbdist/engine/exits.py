"""``exit()``, ``quit()`` and ``sys.exit()`` on a rank end the code, not the rank.

Code written as a script ends itself: ``exit()`` in a "not enough GPUs" branch, ``sys.exit(main())``
at the bottom, argparse's ``sys.exit(2)`` on a bad argument. In an IPython kernel ``exit`` is the
shell's own: it lets the cell run on, reports ok, then stops the kernel, so every rank died a moment
after a cell that said ok. ``install`` makes a rank behave as a script does up to the exit, and as a
notebook should after it:

- ``exit`` and ``quit`` are a script's (``site.Quitter``'s behaviour: raise ``SystemExit(code)``),
  in the cells' namespace and for ``%dist_run`` (``script_builtins``);
- a ``SystemExit`` out of a cell skips the rest of the cell on this rank; the rank stays up. Status
  0 (or None) is success: one line on the rank says where the cell ended; anything else fails the
  cell, in one line naming the status (a message or a value that is not an int is status 1, as
  Python itself exits). argparse's exit says that a cell has no command line, and the fix;
- the notebook learns which ranks exited, with which status and at which line (``wire.EXITED``):
  the result says so, and ranks left waiting in a collective for one are released (cells/release.py).
"""

from __future__ import annotations

import builtins
import sys
import traceback
import warnings
from types import TracebackType
from typing import Any

from .. import compat, wire
from .state import STATE

_INSTALLED: set[int] = set()  # shells given a script's exit
CELL_ARGV = "<cell>"  # sys.argv[0] on a rank: a cell has no command line


class Quit:
    """A script's ``exit``/``quit``: calling it raises SystemExit(code); it leaves stdin alone."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Use {self.name}() to end this rank's code here"

    def __call__(self, code: Any = None) -> None:
        raise SystemExit(code)


EXIT, QUIT = Quit("exit"), Quit("quit")


def script_builtins() -> dict[str, Any]:
    """The builtins a script sees (IPython hides ``exit`` and ``quit`` while a cell runs)."""
    return {**vars(builtins), "exit": EXIT, "quit": QUIT}


def install(shell: Any) -> None:
    """Give this rank's shell a script's exit, and a cell's SystemExit handling (once per shell)."""
    if id(shell) in _INSTALLED:
        return
    sys.argv = [CELL_ARGV]  # not the engine's own arguments (argparse would read them)
    for name, obj in (("exit", EXIT), ("quit", QUIT)):
        shell.user_ns[name] = obj
        shell.user_ns_hidden[name] = obj
    original = shell.showtraceback

    def showtraceback(exc_tuple: Any = None, *args: Any, **kwargs: Any) -> Any:
        etype, value, tb = exc_tuple or sys.exc_info()
        if isinstance(value, SystemExit) and kwargs.get("exception_only"):
            said = describe(value, tb)
            STATE.exited = said
            if said["status"] == 0:
                return None  # success: nothing to show but the rank's line (at_end)
            return compat.show_error(shell, SystemExit(said["text"]))
        return original(exc_tuple, *args, **kwargs)

    shell.showtraceback = showtraceback
    # IPython adds a warning to a cell's SystemExit for a person at a terminal; a rank has none
    warnings.filterwarnings("ignore", message="To exit: use 'exit', 'quit', or Ctrl-D")
    _INSTALLED.add(id(shell))


def at_end(result: Any) -> None:
    """At the end of a cell (runtime's post-cell hook): an exit of status 0 is success; say where each
    exit happened, and tell the notebook."""
    said, STATE.exited = STATE.exited, None
    if said is None or result is None or not isinstance(result.error_in_exec, SystemExit):
        return
    if said["status"] == 0:
        result.error_in_exec = None
        print(f"nbdist: {said['text']}", flush=True)
    else:
        result.error_in_exec = SystemExit(said["text"])
    from .metrics import publish

    publish(wire.EXITED, {k: said[k] for k in ("status", "line", "code")})


def status_of(code: Any) -> int:
    """The process status Python gives ``SystemExit(code)``: None is 0, an int is itself, anything else 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return int(code)
    return 1


def describe(exc: SystemExit, tb: TracebackType | None) -> dict[str, Any]:
    """What to say of this SystemExit: its status, the cell line it came from, and one line of text."""
    from .debug import in_cell

    frames = traceback.extract_tb(tb) if tb is not None else []
    cells = [f for f in frames if in_cell(f.filename)]
    line = cells[-1].lineno if cells else None
    at = f" at cell line {line}" if line else ""
    code, status = exc.code, status_of(exc.code)
    shown = code if isinstance(code, (int, str)) or code is None else repr(code)
    if any(f.filename.endswith("argparse.py") for f in frames) and status:
        text = (
            f"argparse's parse_args(){at} exited with status {status}: a cell has no command line (sys.argv is "
            f"[{CELL_ARGV!r}]); pass the arguments in the cell, e.g. parser.parse_args(['--epochs', '1']), or run "
            "the file with %dist_run script.py --epochs 1"
        )
    elif status == 0:
        text = f"the code exited with status 0{at} (exit(), quit() or sys.exit()): the rest of the cell was skipped; the rank stays up"
    elif isinstance(code, int):
        text = f"the code exited with status {status}{at}: the rest of the cell was skipped; the rank stays up (exit(0) is success)"
    elif isinstance(code, str):
        text = f"the code exited with message {code!r}{at} (status 1, as a script's): the rest of the cell was skipped; the rank stays up"
    else:
        text = (
            f"exit({shown}){at}: {type(code).__name__} is not a status, so Python counts it as status 1; pass an "
            "int (0: success) or a message string. The rest of the cell was skipped; the rank stays up"
        )
    return {"status": status, "line": line, "code": code if isinstance(code, (int, str)) else repr(code), "text": text}
