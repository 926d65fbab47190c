"""ipyparallel's private names a cell sent through the nodes' leaders relies on (world/nodes.py, engine/nodetree.py);
each entry is listed in ``nbdist.compat.PRIVATE_APIS``."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from .ipykernel_private import NODE, NODE_REPLIES, OUTPUT_COUNT
from .ipyparallel_futures import async_result, awaited, registered
from .ipyparallel_private import SEND_CHUNK, OutputHeard, on_io_thread, output_counts, send_all


def execute_heard_tree(
    view: Any, code: str, heard: Callable[[int, Any], None], nodes: list[list[tuple[int, int]]]
) -> Any:
    """``execute_heard``, each node's requests sent as one, to its leader: ``nodes`` lists, for each node, the
    (index in the view's targets, rank) of its ranks, its leader first. The notebook makes every rank's request id,
    future and output count as ``execute_heard`` does (each rank's output and its failure stay its own), and sends the
    leader its request alone, naming the others' ranks and ids (``NODE``); the leader hands each its request, and
    their replies come back on the leader's iopub, a batch a message (``hear_node_replies``)."""
    client = view.client
    if client._closed:
        raise RuntimeError("Client cannot be used after its sockets have been closed")
    if not isinstance(code, str):
        raise TypeError(f"code must be text, not {type(code)}")
    hear_node_replies(client)
    idents, targets = client._build_targets(view.targets)
    content = {"code": code, "silent": False, "user_expressions": {}, "stop_on_error": False}
    counts = output_counts(client)
    futures: list[Any] = [None] * len(idents)
    messages: list[tuple[bytes, Any]] = []
    known = registered(client)
    for n, node in enumerate(nodes):
        others = []
        lead = client.session.msg(
            "execute_request", content=content, metadata={"label": view.label, OUTPUT_COUNT: True}
        )
        for k, rank in node:
            header = lead["header"] if k == node[0][0] else {**lead["header"], "msg_id": client.session.msg_id}
            msg_id = header["msg_id"]
            client.history.append(msg_id)
            futures[k] = awaited(client, msg_id, header, idents[k].decode("utf-8"), view.label, known)
            heard(k, futures[k])
            counts[msg_id] = OutputHeard(client, msg_id, futures[k])
            if k != node[0][0]:
                others.append([rank, msg_id])
        if others:
            lead["metadata"][NODE] = others
        messages.append((idents[node[0][0]], lead))
        if len(messages) == SEND_CHUNK or n == len(nodes) - 1:
            client._io_loop.add_callback(partial(send_all, client.session, view._socket, messages))
            messages = []
    return async_result(client, futures, targets)


def hear_node_replies(client: Any) -> None:
    """The client hears a leader's batch of its node's replies (``NODE_REPLIES``, on iopub) as if each had come on
    its own from its rank: each goes to the client's handler of execute replies. The rest of iopub is handled as
    ipyparallel handles it (``Client._dispatch_iopub``, unpacked once here)."""
    if getattr(client, "_nbdist_node_replies", False):
        return
    from ipyparallel import util

    dispatch = type(client)._dispatch_iopub.__wrapped__
    session = client.session

    def dispatched(frames: list[Any]) -> None:
        _, parts = session.feed_identities(frames, copy=False)
        try:
            msg = session.deserialize(parts, content=True, copy=False)
        except Exception:
            client.log.error("Invalid Message", exc_info=True)
            return
        if msg["header"]["msg_type"] != NODE_REPLIES:
            dispatch(client, msg)
            return
        handle = client._queue_handlers["execute_reply"]
        for reply in msg["content"].get("replies") or []:
            if reply["parent_header"].get("msg_id") not in client.outstanding:
                continue  # had already (a leader's death: the rank sent its last reply again on its own)
            for part in ("header", "parent_header"):
                if "date" in reply[part]:
                    reply[part]["date"] = util._parse_date(reply[part]["date"])
            handle(reply)

    on_io_thread(client, lambda: client._iopub_stream.on_recv(dispatched, copy=False))
    client._nbdist_node_replies = True
