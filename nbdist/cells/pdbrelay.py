"""The notebook's side of ``breakpoint()`` on a rank: its prompts in, the lines typed out.

A rank stopped in its debugger (``engine/debug.py``) sends what pdb printed with each prompt, as a
display of type ``wire.PDB``; the watch hands those here (``take``) and calls ``answer`` each time it
looks. One rank is debugged at a time, named in its prompt; a rank that stops while another is being
debugged waits its turn. A line typed goes to the rank on its control channel (``send``). While any
rank is in its debugger, ``active`` tells the watch to hold its timers (the release policy's
``paused``): a person at a prompt is not a hang.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .. import compat, wire
from ..world.engineset import EngineSet

SEND_S = 10.0  # a line typed for a rank's debugger is taken by its control thread at once; more: it is gone

Send = Callable[[int, str], str]  # (rank, line) -> '' when the rank took it, else why not


class Relay:
    """Routes the ranks' debugger prompts to one input box, one rank after the other."""

    def __init__(self, send: Send, ask: Callable[[str], str] = input, say: Callable[[str], None] = print) -> None:
        self.send, self.ask, self.say = send, ask, say
        self.inside: set[int] = set()  # ranks in their debugger now (at a prompt or stepping)
        self.prompts: dict[int, dict[str, Any]] = {}  # rank -> its prompt not answered yet, oldest first
        self.current: int | None = None  # the rank being debugged
        self.met: set[int] = set()  # ranks already introduced this cell

    @property
    def active(self) -> bool:
        return bool(self.inside)

    def take(self, rank: int, content: dict[str, Any]) -> None:
        """A message from ``rank``'s debugger: a prompt waiting for a line, or it left (continued, quit)."""
        if content.get("state") == "prompt":
            self.inside.add(rank)
            self.prompts[rank] = content
            return
        self.inside.discard(rank)
        self.prompts.pop(rank, None)
        if content.get("text", "").strip():
            self.say(content["text"].rstrip("\n"))
        if self.current == rank:
            self.current = None

    def ended(self, rank: int) -> None:
        """``rank``'s cell is over: whatever its debugger said last, it waits for nothing now."""
        self.take(rank, {"state": "left"})

    def answer(self) -> bool:
        """Ask for a line for the rank being debugged (or the next one that stopped), if it waits; send it.
        Whether a prompt was answered (the person took time: the caller looks at everything again)."""
        if self.current is None and self.prompts:
            self.current = next(iter(self.prompts))
        rank = self.current
        if rank is None or rank not in self.prompts:
            return False  # nobody stopped, or the rank being debugged is running a step
        content = self.prompts.pop(rank)
        if rank not in self.met:
            self.met.add(rank)
            others = sorted(self.inside - {rank})
            queue = f"; rank(s) {', '.join(map(str, others))} stopped too and wait their turn" if others else ""
            self.say(
                f"rank {rank} stopped at a breakpoint: pdb on rank {rank} (c: go on, q: fail the cell there; "
                f"the other ranks wait in their next collective){queue}"
            )
        if content.get("text", "").strip():
            self.say(content["text"].rstrip("\n"))
        prompt = content.get("prompt") or f"(Pdb rank {rank}) "
        try:
            line = self.ask(prompt)
        except (EOFError, NotImplementedError):  # no input box: no stdin, or a front end without input (nbclient)
            self.say(f"no input box here to type into: rank {rank} goes on (c)")
            line = "c"
        refused = self.send(rank, line)
        if refused:
            self.say(f"rank {rank} did not take {line!r}: {refused}")
            self.inside.discard(rank)
            self.current = None
        return True


def send_line(engines: EngineSet, rank: int, line: str) -> str:
    """A line typed for ``rank``'s debugger, sent on its engine's control channel: '' once taken, else why not."""
    future = compat.send_control(engines.client, engines.ranks[rank].engine_id, wire.PDB_REQUEST, {"line": line})
    try:
        content = future.result(timeout=SEND_S)[0]["content"]
    except Exception as exc:
        return f"no answer within {SEND_S:.0f} s ({type(exc).__name__})"
    return "" if content.get("status") == "ok" else str(content.get("why", "refused"))
