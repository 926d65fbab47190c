"""On a rank: its part in a node's tree, through which a cell reaches the node's ranks with one request from the
notebook and their replies go back in a few messages (world/nodes.py is the notebook's side).

A node's leader (its lowest rank) binds two sockets in the world's private folder (``ipc://``, 0700): ``down``, on
which it hands each other rank of its node that rank's request, and ``up``, on which those ranks reply. The notebook
sends a cell to the leader alone; its request names the node's other ranks and the id the notebook gave each one's
request (``NODE``). As the leader's kernel begins it, each of them gets a copy under its own id, signed with the
world's key (``before_execute``); then the leader runs the cell itself. The others run it on their kernel's loop, one
at a time with whatever the controller sends them (``compat.run_relayed``), and reply on ``up``. A thread of the
leader's reads those replies and sends them to the notebook on the leader's iopub in batches, one message each
(``NODE_REPLIES``): a batch goes once every request handed down has its reply, or ``BATCH_S`` after its first reply.
What a rank prints or displays still goes out on its own iopub, as any cell's.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import time
from typing import Any

from .. import compat
from ..compat import NODE, NODE_REPLIES

# A batch of a node's replies waits at most this long after its first reply for the rest: a node's ranks end a cell a
# moment apart, and a batch sent each time one came held about 2 replies of a node of 8 (256 ranks, docs/scaling.md).
BATCH_S = 0.005

_HERE: dict[str, Any] = {}  # this rank's part: its sockets, and a leader's thread
# each relay's stop socket its own name: zmq frees a closed inproc name later, on its own thread, so a name that
# comes back (an id() of a relay just ended) may still be taken
_STOPS = itertools.count()


def join(folder: str, leader: int, rank: int, others: list[int], tag: str, leader_pid: int = 0) -> None:
    """Take this rank's part in the node whose leader is ``leader`` (``others``: the node's other ranks, for the
    leader). A leader binds its sockets; the others connect and say they are there (``wait_for``). ``tag``: this
    join's, in the sockets' names, so a rank that joins again never reaches the sockets of an earlier join.
    ``leader_pid``: the leader's process, which the others follow (``_Replies``)."""
    import zmq
    from zmq.eventloop.zmqstream import ZMQStream

    leave()
    kernel = get_kernel()
    ctx: Any = zmq.Context.instance()
    down, up = _address(folder, leader, tag)
    if rank == leader:
        handed = ctx.socket(zmq.ROUTER)
        handed.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a request for a rank not connected fails here, not silently
        handed.bind(down)
        replies = ctx.socket(zmq.PULL)
        replies.bind(up)
        relay = _Relay(kernel, replies)
        _HERE.update(down=handed, relay=relay, others=set(others))
        compat.before_execute(kernel, lambda request: _hand_down(kernel, handed, relay, request))
        relay.start()
    else:
        asked = ctx.socket(zmq.DEALER)
        asked.setsockopt(zmq.IDENTITY, str(rank).encode())
        asked.setsockopt(zmq.LINGER, 0)
        asked.connect(down)
        push = ctx.socket(zmq.PUSH)
        push.connect(up)
        reply = _Replies(kernel, push, leader_pid)
        stream = ZMQStream(asked, kernel.io_loop)  # the loop the kernel runs cells on

        def came(frames: list[Any]) -> None:
            if frames and frames[-1].bytes == b"hello":  # the leader's answer to ours
                return
            kernel.io_loop.add_callback(compat.run_relayed, kernel, reply, frames)

        stream.on_recv(came, copy=False)
        asked.send(b"hello")
        _HERE.update(stream=stream, replies=reply)


def wait_for(timeout: float) -> list[int]:
    """On a leader: wait until each other rank of its node said it is connected; the ranks that did not, in time."""
    import time

    import zmq

    handed, waiting = _HERE["down"], set(_HERE["others"])
    end = time.monotonic() + timeout
    while waiting and handed.poll(max(0, int((end - time.monotonic()) * 1000))):
        ident, *_ = handed.recv_multipart()
        waiting.discard(int(ident))
    if not waiting:
        for rank in _HERE["others"]:
            handed.send_multipart([str(rank).encode(), b"hello"], flags=zmq.NOBLOCK)
    return sorted(waiting)


def leave() -> None:
    """Leave the tree: this rank's sockets closed, a leader's thread ended and its kernel's handler as it was."""
    relay = _HERE.pop("relay", None)
    if relay is not None:
        relay.stop()
        compat.before_execute(get_kernel(), lambda request: None)
    replies = _HERE.pop("replies", None)
    if replies is not None:
        replies.close()
    stream = _HERE.pop("stream", None)
    if stream is not None:
        stream.close(linger=0)
    handed = _HERE.pop("down", None)
    if handed is not None:
        handed.close(linger=0)
    _HERE.clear()


def get_kernel() -> Any:
    from IPython import get_ipython

    shell = get_ipython()
    kernel = getattr(shell, "kernel", None)
    if kernel is None:
        raise RuntimeError("nbdist's node tree runs on an engine's kernel")
    return kernel


def _address(folder: str, leader: int, tag: str) -> tuple[str, str]:
    return f"ipc://{folder}/tree-{tag}-{leader}.down", f"ipc://{folder}/tree-{tag}-{leader}.up"


def _hand_down(kernel: Any, handed: Any, relay: _Relay, request: dict[str, Any]) -> None:
    """On a leader, as its kernel begins ``request``: each rank it names gets a copy under the id the notebook gave it,
    and the relay waits for its reply."""
    node = (request.get("metadata") or {}).get(NODE)
    if not node:
        return
    metadata = {k: v for k, v in request["metadata"].items() if k != NODE}
    for rank, msg_id in node:
        copy = {
            "header": {**request["header"], "msg_id": msg_id},
            "parent_header": request.get("parent_header") or {},
            "metadata": metadata,
            "content": request["content"],
            "buffers": request.get("buffers") or [],
        }
        relay.owe(msg_id)  # before it is sent: its reply may come before this returns
        try:
            handed.send_multipart(kernel.session.serialize(copy, ident=str(rank).encode()))
        except Exception as exc:  # the rank left (its death is the notebook's to see): the others still get theirs
            relay.paid([msg_id])
            kernel.log.warning("nbdist: rank %s was not handed its request: %s", rank, exc)


def _batch(session: Any, kernel: Any, replies: list[dict[str, Any]]) -> None:
    """Replies sent on to the notebook on this rank's iopub, in one message."""
    session.send(kernel.iopub_socket, NODE_REPLIES, {"replies": replies}, ident=b"nbdist.replies")


def _read(session: Any, kernel: Any, frames: list[Any]) -> dict[str, Any] | None:
    """A reply's message (its signature checked), as the notebook's client reads one."""
    copy = isinstance(frames[0], bytes)  # a reply kept (bytes) or one just received (zmq frames)
    _, parts = session.feed_identities(frames, copy=copy)
    try:
        msg = session.deserialize(parts, content=True, copy=copy)
    except Exception:
        kernel.log.error("nbdist: a reply of this node could not be read", exc_info=True)
        return None
    return {k: msg[k] for k in ("header", "parent_header", "metadata", "content")}


class _Replies:
    """On a rank that is not a leader: where its replies to relayed requests go (the stream its kernel's handler
    sends on). To its leader while the leader lives; once the leader's process ends, on this rank's own iopub, and the
    last one it sent the leader again (the leader may have died before passing it on; the notebook drops a reply it
    already had). So a leader's death is its own, not its node's."""

    def __init__(self, kernel: Any, push: Any, leader_pid: int) -> None:
        self.kernel, self.push, self.session = kernel, push, kernel.session.clone()
        self.last: list[Any] | None = None
        self.orphan = False
        self._lock = threading.Lock()
        self._stop_r, self._stop_w = os.pipe()
        self._thread = None
        if leader_pid and hasattr(os, "pidfd_open"):
            try:
                fd = os.pidfd_open(leader_pid)
            except OSError:  # it ended already
                self.orphan = True
            else:
                self._thread = threading.Thread(target=self._follow, args=(fd,), name="nbdist-node-leader", daemon=True)
                self._thread.start()

    def send_multipart(self, frames: list[Any], copy: bool = True, track: bool = False) -> None:
        """As a socket's (``Session.send`` calls it with the reply's frames)."""
        frames = [bytes(f) if not isinstance(f, bytes) else f for f in frames]
        with self._lock:
            self.last = frames
            if not self.orphan:
                self.push.send_multipart(frames)
                return
        self._publish(frames)

    def _publish(self, frames: list[Any]) -> None:
        reply = _read(self.session, self.kernel, frames)
        if reply is not None:
            _batch(self.session, self.kernel, [reply])

    def _follow(self, fd: int) -> None:
        import select

        try:
            ready, _, _ = select.select([fd, self._stop_r], [], [])
        finally:
            os.close(fd)
        if fd in ready:
            with self._lock:
                self.orphan, last = True, self.last
            if last is not None:
                self._publish(last)

    def close(self) -> None:
        os.write(self._stop_w, b"x")
        if self._thread is not None:
            self._thread.join(timeout=5)
        for fd in (self._stop_r, self._stop_w):
            os.close(fd)
        self.push.close(linger=0)


class _Relay(threading.Thread):
    """On a leader: the node's replies, sent on to the notebook on the leader's iopub in batches, one message each. A
    batch goes once every request handed down (``owe``) has its reply, or ``BATCH_S`` after its first reply (a rank
    that is slow, or dead, holds the others' replies that long at most). Its own Session (a clone: the same key, a
    digest history of its own)."""

    def __init__(self, kernel: Any, replies: Any) -> None:
        import zmq

        super().__init__(name="nbdist-node-replies", daemon=True)
        self.kernel, self.replies, self.session = kernel, replies, kernel.session.clone()
        self.owed: set[str] = set()  # the ids of the requests handed down whose replies have not come
        self._lock = threading.Lock()  # owed is changed by the kernel's thread and this one
        self.stopping: Any = zmq.Context.instance().socket(zmq.PAIR)
        self._stop_at = f"inproc://nbdist-node-stop-{next(_STOPS)}"
        self.stopping.bind(self._stop_at)

    def owe(self, msg_id: str) -> None:
        with self._lock:
            self.owed.add(msg_id)

    def paid(self, msg_ids: list[str]) -> bool:
        """These requests' replies came (or will not: they were not sent); whether none is owed now."""
        with self._lock:
            self.owed.difference_update(msg_ids)
            return not self.owed

    def run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self.replies, zmq.POLLIN)
        poller.register(self.stopping, zmq.POLLIN)
        batch: list[dict[str, Any]] = []
        until = 0.0  # when the batch goes at the latest (once it has a reply)
        while True:
            ready = dict(poller.poll(math.ceil(max(0.0, until - time.monotonic()) * 1000) if batch else None))
            if self.stopping in ready:
                break
            came = self._take()
            if came and not batch:
                until = time.monotonic() + BATCH_S
            batch += came
            if batch and (
                self.paid([reply["parent_header"].get("msg_id") for reply in came]) or time.monotonic() >= until
            ):
                _batch(self.session, self.kernel, batch)
                batch = []
        if batch:
            _batch(self.session, self.kernel, batch)
        self.stopping.close(linger=0)
        self.replies.close(linger=0)

    def _take(self) -> list[dict[str, Any]]:
        """The replies that came (those that could be read)."""
        import zmq

        came: list[dict[str, Any]] = []
        while True:
            try:
                frames = self.replies.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return came
            reply = _read(self.session, self.kernel, frames)
            if reply is not None:
                came.append(reply)

    def stop(self) -> None:
        import zmq

        told: Any = zmq.Context.instance().socket(zmq.PAIR)
        told.connect(self._stop_at)
        told.send(b"stop")
        self.join(timeout=5)
        told.close(linger=0)
