"""pdb on a rank, typed into the notebook: post-mortem (``%dist_debug``) and live (``breakpoint()``).

Post-mortem: the notebook sends each command the user types (``p x``, ``up``, ``l``, ``q``) as an
ordinary apply through ipyparallel's signed channels; a ``pdb.Pdb`` set on the rank's last traceback
runs it and hands back what it printed.

Live: ``breakpoint()`` (or ``nbdist.breakpoint(rank=...)``) in a cell stops this rank in a ``RankPdb``
while the cell runs. Its main thread is busy, so the lines typed in the notebook come on the engine's
control channel (a message type of nbdist's own, ``wire.PDB_REQUEST``, signed with the session's key
and accepted only from the client whose cell is running); what pdb prints goes to the notebook as a
display of type ``wire.PDB`` with each prompt, which the notebook's watch answers
(``cells/pdbrelay.py``). Nothing new listens. A command that asks a question of its own (``clear``:
"Clear all breaks?") gets end-of-input, never a wait.
"""

from __future__ import annotations

import bdb
import builtins
import inspect
import io
import os
import pdb
import queue
import sys
from dataclasses import dataclass, field
from typing import Any

from .. import compat, wire
from .state import STATE


@dataclass(slots=True)
class Session:
    """The open post-mortem debugger of this rank (%dist_debug; one per process: ``SESSION``)."""

    pdb: pdb.Pdb | None = None
    out: io.StringIO = field(default_factory=io.StringIO)  # what its last command printed
    last: str = ""  # its last command (an empty line repeats it)

    def clear(self) -> None:
        self.pdb, self.out, self.last = None, io.StringIO(), ""


SESSION = Session()
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
    SESSION.pdb, SESSION.out, SESSION.last = debugger, out, ""
    value = getattr(sys, "last_value", None)
    head = f"{type(value).__name__}: {value}\n" if value is not None else ""
    return head + out.getvalue()


def command(line: str) -> tuple[str, bool]:
    """Run one pdb command; (what it printed, whether the session is over)."""
    debugger = SESSION.pdb
    if debugger is None:
        return "no debugger is open on this rank; run %dist_debug again.\n", True
    line = line.strip() or SESSION.last  # an empty line repeats the last command, as in pdb
    if line.split(" ", 1)[0] in ENDS:
        close()
        return "", True
    SESSION.last = line
    out = SESSION.out
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


# --------------------------------------------------------------------------- live: breakpoint() in a cell

LINES: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()  # (session, line) typed in the notebook
@dataclass(slots=True)
class Live:
    """While this rank is in its live debugger (breakpoint() in a cell): the one client allowed to type."""

    session: str | None = None

    def clear(self) -> None:
        self.session = None


LIVE = Live()  # one per process
MACHINERY = {"IPython", "ipykernel", "ipyparallel", "nbdist"}  # what runs a cell: a step never stops in it
STEPS = {"n", "next", "s", "step", "r", "return", "unt", "until", "j", "jump"}  # these stop again soon


def install() -> None:
    """Route ``breakpoint()`` on this rank to the notebook, and take typed lines on the control channel."""
    from IPython import get_ipython

    kernel = getattr(get_ipython(), "kernel", None)
    if kernel is None:  # not an engine (a plain process): breakpoint() keeps its own meaning
        return
    compat.add_control_handler(
        kernel, wire.PDB_REQUEST, lambda stream, idents, msg: _on_line(kernel, stream, idents, msg)
    )
    STATE.kernel = kernel
    sys.breakpointhook = breakpoint


def breakpoint(*args: Any, rank: int | None = None, **kwargs: Any) -> None:  # noqa: A001
    """Stop here in pdb, typed from the notebook (``rank``: only on that rank; the others go on).

    ``sys.breakpointhook`` on every rank, so the builtin ``breakpoint()`` comes here.
    ``PYTHONBREAKPOINT=0`` turns it off, as for any Python."""
    if os.environ.get("PYTHONBREAKPOINT") == "0" or (rank is not None and rank != STATE.rank):
        return
    kernel, frame = STATE.kernel, inspect.currentframe()
    if kernel is None or STATE.busy_since is None or frame is None:
        print(f"nbdist: breakpoint() on rank {STATE.rank} outside a %%distributed cell: skipped", file=sys.stderr)
        return
    session = kernel.get_parent("shell").get("header", {}).get("session", "")
    RankPdb(STATE.placed()[0], session).stop_at(frame.f_back)


class RankPdb(pdb.Pdb):
    """pdb whose prompt goes to the notebook and whose input comes from it (see the module's doc)."""

    def __init__(self, rank: int, session: str) -> None:
        self.out = io.StringIO()
        # nosigint: Ctrl-C stays the notebook's stop button (pdb's own handler would break into pdb again)
        super().__init__(stdin=self, stdout=self.out, nosigint=True)  # type: ignore[arg-type]  # readline()
        self.use_rawinput = False
        self.prompt = f"(Pdb rank {rank}) "
        self.rank, self.session, self.last = rank, session, ""

    def stop_at(self, frame: Any) -> None:
        """Stop on ``frame``'s current line now (the ``breakpoint()`` line, as Python 3.13's pdb does: a
        breakpoint at a cell's end still shows its variables), then trace on if a step or a breakpoint
        set in pdb asks for it; ``q`` fails the cell here."""
        self.reset()
        outer = frame
        while outer is not None:  # what Bdb.set_trace does, but the first stop is here, not at the next event
            outer.f_trace = self.trace_dispatch
            self.botframe, outer = outer, outer.f_back
        self.interaction(frame, None)
        if self.breaks or self.last.split(" ", 1)[0] in STEPS:
            sys.settrace(self.trace_dispatch)

    def interaction(self, frame: Any, tb: Any) -> None:
        LIVE.session = self.session
        STATE.debugging = True
        real_input, builtins.input = builtins.input, _no_input
        try:
            super().interaction(frame, tb)
        finally:
            builtins.input = real_input
            if self.last.split(" ", 1)[0] not in STEPS:  # c or q: the notebook may take the next rank
                STATE.debugging = False
                LIVE.clear()
                self._publish("left")
        if self.quitting:  # what pdb would raise at the next line, saying why
            raise bdb.BdbQuit(f"q in the debugger on rank {self.rank}: the cell stops here")

    def stop_here(self, frame: Any) -> bool:
        """Steps stop in the cell and in what it calls, never in the kernel's machinery that runs between
        two of its statements (IPython runs each top-level statement as a code object of its own)."""
        return bool(super().stop_here(frame)) and _under_cell(frame)

    def user_call(self, frame: Any, argument_list: Any) -> None:
        if frame.f_code.co_name == "<module>":  # the cell's next top-level statement: stop on its line instead
            return
        super().user_call(frame, argument_list)

    def user_return(self, frame: Any, return_value: Any) -> None:
        if frame.f_code.co_name == "<module>":  # one top-level statement of the cell ended: step to the next
            return
        super().user_return(frame, return_value)

    def readline(self) -> str:
        """pdb waits for a line: send what it printed and its prompt, then wait for the line typed."""
        self._publish("prompt")
        try:
            while True:
                try:
                    session, line = LINES.get(timeout=0.2)  # a short wait: Ctrl-C (SIGINT) gets through
                except queue.Empty:
                    continue
                if session == self.session:
                    break
        except KeyboardInterrupt:  # the cell was stopped: leave the debugger and fail the cell here
            line = "q"
        self.last = line.strip() or self.last  # an empty line repeats the last command, as in pdb
        return line + "\n"

    def _publish(self, state: str) -> None:
        text = self.out.getvalue()
        if state == "prompt" and text.endswith(self.prompt):
            text = text[: -len(self.prompt)]
        self.out.seek(0)
        self.out.truncate()
        _tell(state, self.rank, text, self.prompt)


def _tell(state: str, rank: int, text: str = "", prompt: str = "") -> None:
    """Tell the notebook (cells/pdbrelay.py) this rank's debugger prompts or left, with what it printed."""
    from IPython.display import publish_display_data

    publish_display_data({wire.PDB: {"state": state, "rank": rank, "text": text, "prompt": prompt}})


def in_cell(filename: str) -> bool:
    """Whether code from ``filename`` is a notebook cell's (IPython names each cell's code)."""
    try:
        from IPython import get_ipython

        if filename in compat.cell_filenames(get_ipython()):
            return True
    except Exception:  # pragma: no cover
        pass
    return "ipykernel_" in filename or filename.startswith("<ipython-input")


def _under_cell(frame: Any) -> bool:
    """Whether this frame is a cell's, or was called from one through user code: the nearest frame below it
    that is a cell's or the kernel's (IPython's display hook, ipyparallel, nbdist) is a cell's."""
    while frame is not None:
        if in_cell(frame.f_code.co_filename):
            return True
        if str(frame.f_globals.get("__name__", "")).split(".", 1)[0] in MACHINERY:
            return False
        frame = frame.f_back
    return False


def _on_line(kernel: Any, stream: Any, idents: Any, msg: dict[str, Any]) -> None:
    """On the control thread: a line typed for this rank's debugger; only its cell's client may type."""
    session = msg.get("header", {}).get("session", "")
    if LIVE.session is not None and LIVE.session == session:
        LINES.put((session, str(msg.get("content", {}).get("line", ""))))
        reply = {"status": "ok"}
    else:
        why = (
            "no debugger is open on this rank" if LIVE.session is None else "only the notebook running the cell can type here"
        )
        reply = {"status": "refused", "why": why}
    kernel.session.send(stream, wire.PDB_REPLY, reply, parent=msg, ident=idents)


def cell_over() -> None:
    """The cell ended (runtime's post-cell hook): a step past its last line leaves the debugger here."""
    if STATE.debugging or sys.gettrace() is not None and LIVE.session is not None:
        sys.settrace(None)
        STATE.debugging = False
        LIVE.clear()
        _tell("left", STATE.placed()[0])
