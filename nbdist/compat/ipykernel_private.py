"""ipykernel's private names nbdist relies on, on an engine (its Kernel's status and echo, and what its Session sends);
each entry is listed in ``nbdist.compat.PRIVATE_APIS``."""

from __future__ import annotations

import sys
import threading
from typing import Any

# In a cell's request's metadata (True): end the request's output with a count instead of an ``idle`` status. In its
# reply's metadata (an int): how many iopub messages, status aside, the rank published for the request before it
# replied. The notebook has the rank's whole output once it heard that many (ipyparallel_private.execute_heard).
OUTPUT_COUNT = "nbdist_output_count"
# A node's tree (engine/nodetree.py, world/nodes.py). In a leader's request's metadata: [[rank, msg_id], ...], the
# node's other ranks and the id of each one's request. The msg_type of an iopub message of a leader that carries its
# node's replies: {"replies": [{"header", "parent_header", "metadata", "content"}, ...]}.
NODE = "nbdist_node"
NODE_REPLIES = "nbdist_replies"


def add_control_handler(kernel: Any, msg_type: str, handler: Any) -> None:
    """On an engine: have its kernel's control thread call ``handler(stream, idents, msg)`` for ``msg_type``."""
    kernel.control_handlers[msg_type] = handler


def lean_iopub(kernel: Any) -> None:
    """On an engine: its kernel no longer publishes, on iopub, the ``busy`` status before each request it handles nor
    the ``execute_input`` echo of each cell's code (ipykernel's ``Kernel._publish_status`` and
    ``_publish_execute_input``). nbdist's client reads neither: a rank is busy from the moment its cell is sent, and
    the code is the notebook's own. Two of a trivial cell's five messages a rank, each one read by the controller and
    the notebook (benchmarks/cell_messages.py).

    A request that asks for it (``OUTPUT_COUNT`` in its metadata: nbdist's cells) is not followed by an ``idle``
    status either: its reply says how many iopub messages the rank published for it (``_OutputCount``), and the
    notebook counts them as they come. One message a rank fewer again; any other request (ipyparallel's own
    ``view.execute``, an apply) still ends with its ``idle``."""
    if kernel is None or getattr(kernel, "_nbdist_lean_iopub", False):
        return
    status = kernel._publish_status
    count = _OutputCount()

    def publish_status(state: str, channel: str, parent: Any = None) -> None:
        if state == "busy":
            if channel == "shell":  # a request begins: sent before anything it publishes
                count.begin(kernel.get_parent("shell"))
            return
        if state == "idle" and count.ends(parent if parent is not None else kernel.get_parent(channel)):
            return
        status(state, channel, parent)

    kernel._publish_status = publish_status
    kernel._publish_execute_input = lambda code, parent, execution_count: None
    session = getattr(kernel, "session", None)
    if session is not None:  # the one Session the engine's streams, displays, data and replies all send with
        session.send = count.sending(session.send)
    kernel._nbdist_lean_iopub = True


class _OutputCount:
    """On an engine: how many iopub messages, status aside, it published for the request it handles, where that
    request asked (``OUTPUT_COUNT``); the count goes in the request's reply. A message counts once sent (handed to the
    iopub thread, which sends in order), so a count never names a message that will not come; one published after
    the reply (a thread that prints late) is not in it, as one published after an ``idle`` status is late."""

    def __init__(self) -> None:
        self.msg_id: str | None = None  # the request being counted
        self.sent = 0
        self._lock = threading.Lock()  # streams are sent from the iopub thread, displays from the main one

    def begin(self, parent: Any) -> None:
        """A request begins (its ``busy`` status): count for it if it asked."""
        asked = bool(((parent or {}).get("metadata") or {}).get(OUTPUT_COUNT))
        with self._lock:
            self.msg_id = _msg_id(parent) if asked else None
            self.sent = 0

    def ends(self, parent: Any) -> bool:
        """True for the ``idle`` status of a request that is counted: its reply said its count instead."""
        return self.msg_id is not None and _msg_id(parent) == self.msg_id

    def sending(self, send: Any) -> Any:
        """``Session.send``, counting what is sent for the counted request and saying the count in its reply."""

        def counted(
            stream: Any,
            msg_or_type: Any,
            content: Any = None,
            parent: Any = None,
            ident: Any = None,
            buffers: Any = None,
            track: bool = False,
            header: Any = None,
            metadata: Any = None,
        ) -> Any:
            counting = self.msg_id
            if counting is not None:
                if isinstance(msg_or_type, dict):  # a message made before (the display hook's)
                    kind, of = msg_or_type["header"]["msg_type"], _msg_id(msg_or_type.get("parent_header"))
                else:
                    kind, of = msg_or_type, _msg_id(parent)
                if of == counting:
                    if kind == "execute_reply":
                        metadata = {**(metadata or {}), OUTPUT_COUNT: self.sent}
                    elif kind != "status" and not kind.endswith("_reply"):
                        sent = send(stream, msg_or_type, content, parent, ident, buffers, track, header, metadata)
                        with self._lock:
                            if self.msg_id == counting:
                                self.sent += 1
                        return sent
            return send(stream, msg_or_type, content, parent, ident, buffers, track, header, metadata)

        return counted


def _msg_id(parent: Any) -> str | None:
    """The msg_id of a parent given as a message or as its header (as ``Session.send`` takes either)."""
    if not parent:
        return None
    header = parent.get("header", parent) if "msg_id" not in parent else parent
    return header.get("msg_id") if isinstance(header, dict) else None


def before_execute(kernel: Any, before: Any) -> None:
    """On an engine: ``before(request)`` is called as its kernel begins each execute request it handles (after its
    ``busy`` status, before the cell runs), by ipykernel's handler of ``execute_request`` (``Kernel.shell_handlers``).
    Called again, the new ``before`` replaces the last."""
    handle = getattr(kernel, "_nbdist_execute_request", None)
    if handle is None:
        handle = kernel._nbdist_execute_request = kernel.shell_handlers["execute_request"]

    async def handled(stream: Any, ident: Any, parent: Any) -> Any:
        before(parent)
        return await handle(stream, ident, parent)

    kernel.shell_handlers["execute_request"] = handled


async def run_relayed(kernel: Any, reply_to: Any, frames: list[Any]) -> None:
    """On an engine: handle a shell request that came on a socket of nbdist's own (a node's leader handed it on) as
    ipykernel's ``Kernel.dispatch_shell`` handles one from the controller: its signature checked, its parent set, its
    ``busy`` status, the abort and ``should_handle`` checks, SIGINT's handler set while it runs, stdout and stderr
    flushed, its ``idle`` status; and one at a time with the controller's (``shell_main`` holds the same lock). Its
    reply goes to ``reply_to`` (a socket) instead of the kernel's shell stream."""
    import inspect

    async with kernel._main_asyncio_lock:
        idents, parts = kernel.session.feed_identities(frames, copy=False)
        try:
            msg = kernel.session.deserialize(parts, content=True, copy=False)
        except Exception:
            kernel.log.error("nbdist: a relayed request could not be read", exc_info=True)
            return
        kernel.set_parent(idents, msg, channel="shell")
        kernel._publish_status("busy", "shell")
        msg_type = msg["header"]["msg_type"]
        handler = kernel.shell_handlers.get(msg_type)
        if msg_type == "execute_request" and kernel._aborting:
            kernel._send_abort_reply(reply_to, msg, idents)
        elif handler is not None:
            should = kernel.should_handle(reply_to, msg, idents)
            if inspect.isawaitable(should):
                should = await should
            if should:
                kernel.pre_handler_hook()
                try:
                    result = handler(reply_to, idents, msg)
                    if inspect.isawaitable(result):
                        await result
                except Exception:
                    kernel.log.error("nbdist: a relayed request's handler failed", exc_info=True)
                except KeyboardInterrupt:
                    kernel.log.error("KeyboardInterrupt caught in kernel.")
                finally:
                    kernel.post_handler_hook()
        for out in (sys.stdout, sys.stderr):
            if out is not None:
                out.flush()
        kernel._publish_status("idle", "shell")
