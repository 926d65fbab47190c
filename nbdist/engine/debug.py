"""Post-mortem pdb on a rank, one command at a time (``%dist_debug``).

The notebook sends each command the user types (``p x``, ``up``, ``l``, ``q``) through ipyparallel's
signed channels; here a ``pdb.Pdb`` set on the rank's last traceback runs it and hands back what it
printed. Nothing new listens. A command that asks a question of its own (``clear``: "Clear all
breaks?") gets end-of-input, never a wait.
"""

from __future__ import annotations

import builtins
import io
import pdb
import sys
from typing import Any

SESSION: dict[str, Any] = {}  # the open debugger of this rank: {"pdb": Pdb, "out": StringIO}
ENDS = {"q", "quit", "exit", "c", "cont", "continue"}  # post-mortem: nothing to continue, so these end


def _no_input(prompt: object = "") -> str:
    raise EOFError("nbdist: this pdb command's own question gets no answer from the notebook")


def open_session() -> str:
    """Start pdb on this rank's last exception; what pdb shows first ('' and no session when none)."""
    tb = getattr(sys, "last_traceback", None)
    if tb is None:
        return ""
    out = io.StringIO()
    debugger = pdb.Pdb(stdin=io.StringIO(), stdout=out)
    debugger.reset()
    debugger.setup(None, tb)  # at the frame that raised, as pdb.post_mortem starts
    debugger.print_stack_entry(debugger.stack[debugger.curindex])
    SESSION.update(pdb=debugger, out=out, last="")
    value = getattr(sys, "last_value", None)
    head = f"{type(value).__name__}: {value}\n" if value is not None else ""
    return head + out.getvalue()


def command(line: str) -> tuple[str, bool]:
    """Run one pdb command; (what it printed, whether the session is over)."""
    debugger = SESSION.get("pdb")
    if debugger is None:
        return "no debugger is open on this rank; run %dist_debug again.\n", True
    line = line.strip() or SESSION.get("last", "")  # an empty line repeats the last command, as in pdb
    if line.split(" ", 1)[0] in ENDS:
        close()
        return "", True
    SESSION["last"] = line
    out: io.StringIO = SESSION["out"]
    out.seek(0)
    out.truncate()
    real_input, builtins.input = builtins.input, _no_input
    try:
        debugger.onecmd(line)
    except Exception as exc:  # pdb reports its own errors; anything else is shown, not raised
        out.write(f"*** {type(exc).__name__}: {exc}\n")
    finally:
        builtins.input = real_input
    return out.getvalue(), False


def close() -> None:
    SESSION.clear()
