"""ipyparallel's private names nbdist relies on (its Client, AsyncResult, launchers and controller); each
entry is listed in ``nbdist.compat.PRIVATE_APIS``."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

from .ipykernel_private import OUTPUT_COUNT
from .ipyparallel_futures import async_result, awaited, forget, registered


def async_result_children(ar: Any) -> list[Any]:
    """The per-engine futures of a multi-engine AsyncResult, in the order of its targets."""
    return list(ar._children)


# A cell's requests go to the IO thread this many at a time: one wake of its loop a chunk, and the first ranks' requests
# sent while the next are made (a 256-rank cell makes its requests in about 25 ms here).
SEND_CHUNK = 16


def execute_heard(view: Any, code: str, heard: Callable[[int, Any], None], counted: bool = True) -> Any:
    """``view.execute(code, silent=False, block=False)``, with ``heard(k, future)`` called for the k-th engine's request
    (in the order of the view's targets) as its future is made, before the request is sent (ipyparallel's
    ``message_future_hook``): callbacks put on the future then hear every message of its reply, in order. The
    requests are made as ``Client.send_execute_request`` makes them (the client's outstanding requests, history and
    each engine's outstanding set, the futures and their cleanup, as ``Client._send``), and go to the IO thread
    ``SEND_CHUNK`` at a time, in one callback each (``send_all``); ipyparallel hands each to the IO thread on its
    own, a wake of its loop each, and queues each on the socket's stream, a callback more each. The view's history
    is not kept; the client's is.

    Each request asks its rank to end its output with a count rather than an ``idle`` status (``OUTPUT_COUNT``, see
    ``lean_iopub``): its output future is done once the reply said how many messages came and that many were heard
    (``OutputHeard``, after ``heard``'s callbacks); a reply that says no count leaves it to the ``idle``, as before.
    ``counted=False``: no request asks, and each rank ends its output with its ``idle`` (benchmarks/cell_messages.py).
    A cell that fails on a rank aborts no request behind it (``stop_on_error`` False): ipykernel aborts each execute
    request that reaches the rank before it has finished aborting, which a cell ended at its reply can outrun."""
    client = view.client
    if client._closed:
        raise RuntimeError("Client cannot be used after its sockets have been closed")
    if not isinstance(code, str):
        raise TypeError(f"code must be text, not {type(code)}")
    idents, targets = client._build_targets(view.targets)
    metadata = {"label": view.label, OUTPUT_COUNT: True} if counted else {"label": view.label}
    content = {"code": code, "silent": False, "user_expressions": {}, "stop_on_error": False}
    counts = output_counts(client) if counted else None
    futures, messages, known = [], [], registered(client)
    for k, ident in enumerate(idents):
        msg = client.session.msg("execute_request", content=content, metadata=metadata)
        client.history.append(msg["header"]["msg_id"])
        futures.append(
            awaited(client, msg["header"]["msg_id"], msg["header"], ident.decode("utf-8"), view.label, known)
        )
        heard(k, futures[-1])
        if counts is not None:
            counts[msg["header"]["msg_id"]] = OutputHeard(client, msg["header"]["msg_id"], futures[-1])
        messages.append((ident, msg))
        if len(messages) == SEND_CHUNK or k == len(idents) - 1:
            client._io_loop.add_callback(partial(send_all, client.session, view._socket, messages))
            messages = []
    return async_result(client, futures, targets)


class OutputHeard:
    """What the notebook heard of one request's output, where its rank counts it (``OUTPUT_COUNT``): every iopub
    message of the request but its status, and the count its reply said. Both are read on the client's IO thread."""

    __slots__ = ("client", "heard", "msg_id", "said")

    def __init__(self, client: Any, msg_id: str, future: Any) -> None:
        self.client, self.msg_id, self.heard, self.said = client, msg_id, 0, -1
        future.iopub_callbacks.append(self.hear)  # last: the message is handed on before the output may be done

    def hear(self, msg: Any) -> None:
        if msg["header"]["msg_type"] != "status":
            self.heard += 1
            self.check()

    def check(self) -> None:
        """The output is all in once the reply said its count and that many messages were heard."""
        if 0 <= self.said <= self.heard:
            output = self.client._output_futures.get(self.msg_id)
            if output is not None and not output.done():
                output.set_result(None)


def output_counts(client: Any) -> dict[str, OutputHeard]:
    """The requests whose output is counted, by msg_id, until their reply comes; the first time, the client's
    handler of execute replies is wrapped to read the count a reply says (``Client._queue_handlers``)."""
    counts: dict[str, OutputHeard] | None = getattr(client, "_nbdist_output_counts", None)
    if counts is None:
        counts = client._nbdist_output_counts = {}
        handle = client._queue_handlers["execute_reply"]

        def handled(msg: Any) -> None:
            counted = counts.pop(msg["parent_header"].get("msg_id"), None)
            said = (msg.get("metadata") or {}).get(OUTPUT_COUNT)
            if counted is not None and isinstance(said, int):
                counted.said = said
                counted.check()  # first: the reply's callbacks find its output in where it is
            handle(msg)

        client._queue_handlers["execute_reply"] = handled
    return counts


def send_all(session: Any, stream: Any, messages: list[tuple[bytes, Any]]) -> None:
    """On the client's IO thread: each (engine identity, message) straight on the stream's socket, signed as
    ``Session.send`` signs it, while the stream has nothing queued before them and the socket takes a message at
    once; from the first it does not take, the rest through the stream, as ipyparallel sends each (queued, sent as
    the socket can take them): the IO thread never blocks on a controller that does not read. Then the stream is
    flushed: a zmq socket's descriptor is edge-triggered, and a send on the socket can take in a reply already there
    without the loop being told; the flush hands the stream's callbacks what is in (replies to earlier requests) and
    sets the loop to watch the socket afresh, as the stream does after each of its own sends. Without it, a reply
    could wait in the socket until another message came."""
    import zmq

    sock = stream.socket
    for i, (ident, msg) in enumerate(messages):
        if not stream.sending():
            try:
                sock.send_multipart(session.serialize(msg, ident), flags=zmq.NOBLOCK)
                continue
            except zmq.Again:
                pass
        for later, rest in messages[i:]:
            session.send(stream, rest, ident=later)
        break
    stream.flush()


def execute_heard_broadcast(view: Any, code: str, heard: Callable[[int, Any], None]) -> Any:
    """``execute_heard`` through a BroadcastView (``client.broadcast_view(targets)``): one request, which the
    controller's broadcast schedulers hand to each engine under the id ``<request>_<engine uuid>``; each engine's reply
    and output come back on their own (not coalesced), heard by ``heard(k, future)`` on the future made for that id,
    as ``BroadcastView.execute`` makes them (ipyparallel's ``_make_async_result``), before the request is sent. Unlike
    ipyparallel's, each engine's future leaves the client's caches once its reply and output are in (a direct request's
    do, in ``Client._send``), and the request's own, to which nothing replies, at once."""
    client = view.client
    idents, targets = client._build_targets(view.targets)
    uuids = [ident.decode("utf8") for ident in idents]
    metadata = {"targets": list(zip(uuids, targets, strict=True)), "is_broadcast": True, "is_coalescing": False}
    futures: list[Any] = []

    def made(request: Any) -> None:
        known = registered(client)
        for k, uuid in enumerate(uuids):
            futures.append(awaited(client, f"{request.msg_id}_{uuid}", request.header, uuid, known=known))
            heard(k, futures[-1])

    request = client.send_execute_request(view._socket, code, silent=False, metadata=metadata, message_future_hook=made)
    client.outstanding.discard(request.msg_id)
    forget(client, request.msg_id)
    return async_result(client, futures, targets)


def launcher_popen(launcher: Any) -> Any:
    """The Popen of a local launcher's process, or None (not a local launcher, or not started)."""
    return getattr(launcher, "_popen_process", None)


def set_launcher_popen(launcher: Any, popen: Any) -> None:
    """Hand a process nbdist started itself (a warm engine) to a local launcher, as its own."""
    launcher._popen_process = popen


def start_waiting(launcher: Any) -> None:
    """Have a local launcher watch its process (for exit) as ``LocalProcessLauncher.start`` does itself."""
    launcher._start_waiting()


def route_run_command(cls: type) -> type:
    """Make a batch launcher class submit through its ``run_command`` (ipyparallel calls ``_run_command``)."""
    cls._run_command = cls.run_command  # type: ignore[attr-defined]
    return cls


_PAUSED: set[int] = set()  # clients whose IO thread ``io_paused`` holds


@contextlib.contextmanager
def io_paused(client: Any, timeout: float = 10.0) -> Iterator[None]:
    """Hold the client's IO thread (where it handles every message) while the block runs, ``timeout`` at most:
    what the block sends goes out, and what comes back is handled, after it (``_send`` hands the send to that
    thread), so callbacks the block registers on its messages hear every reply, in order."""
    import threading

    thread, loop = getattr(client, "_io_thread", None), getattr(client, "_io_loop", None)
    if thread is None or loop is None or not thread.is_alive() or thread is threading.current_thread():
        loop = None
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        release.wait(timeout)

    if loop is not None and id(client) not in _PAUSED:
        loop.add_callback(hold)
        if not held.wait(timeout):
            raise RuntimeError(f"ipyparallel's IO thread did not run a callback within {timeout} s")
        _PAUSED.add(id(client))
    try:
        yield
    finally:
        if held.is_set():
            _PAUSED.discard(id(client))
        release.set()


def on_io_thread(client: Any, fn: Any, timeout: float = 10.0) -> Any:
    """Run ``fn`` while the client's IO thread is held (``io_paused``), as if on that thread; what it returned."""
    with io_paused(client, timeout):
        return fn()


def send_control(client: Any, engine_id: int, msg_type: str, content: dict[str, Any]) -> Any:
    """Send one engine a ``msg_type`` message on its control channel (signed; its control thread takes it while a
    cell runs); a future whose result is the list of replies (one)."""
    return client._send_control_request([engine_id], msg_type, content, block=False)


def controller_engines(client: Any, timeout: float) -> dict[int, str]:
    """The engines the controller has registered, {engine id: uuid}, asked over the client's query channel (the
    'connection_request' a Client sends once, when it connects). TimeoutError when it does not answer in time."""
    future = client._send(client._query_stream, "connection_request")
    reply = future.result(timeout=timeout)
    return {int(eid): uuid for eid, uuid in reply["content"].get("engines", {}).items()}


def add_engines(client: Any, engines: dict[int, str]) -> None:
    """Make these engines known to the client, as a registration notification does: a client learns of engines
    only from notifications after it subscribed, and misses one between (ipyparallel 9's Client._connect)."""
    on_io_thread(client, lambda: client._update_engines({eid: uuid for eid, uuid in engines.items()}))


def on_engine_registration(registering: Any, registered: Any, beating: Any) -> None:
    """In an engine process: call ``registering()`` when ipyparallel's engine sends its registration request,
    ``registered()`` when the controller's answer came (it starts its kernel), ``beating(engine_id)`` once its
    kernel and heart are up (``IPEngine.register`` and ``complete_registration``, ipyparallel 9)."""
    import functools

    from ipyparallel.engine.app import IPEngine

    register, complete = IPEngine.register, IPEngine.complete_registration

    @functools.wraps(register)
    async def _register(self: Any, *args: Any, **kwargs: Any) -> Any:
        registering()
        return await register(self, *args, **kwargs)

    @functools.wraps(complete)
    async def _complete(self: Any, *args: Any, **kwargs: Any) -> Any:
        registered()
        done = await complete(self, *args, **kwargs)
        beating(self.id)
        return done

    IPEngine.register, IPEngine.complete_registration = _register, _complete  # type: ignore[method-assign]


def fast_iso_dates() -> None:
    """ipyparallel reads a reply's timestamps with dateutil's general parser (``ipyparallel.util._parse_date``, 70-120
    us each here): the client once a reply ('started', on its IO thread), the hub once a reply too (``extract_dates``),
    and the hub's jupyter_client ``parse_date`` a request's and a reply's header. They are ISO 8601 as jupyter_client
    writes them, which ``datetime.fromisoformat`` reads in about a microsecond, to the same instant; a string it
    cannot read goes to ipyparallel's own parser. In the notebook (its client) and in nbdist's controller (its hub):
    160 ms of CPU a cell at 1,024 ranks, from the parse times (benchmarks/reply_dates.py)."""
    from datetime import datetime

    from ipyparallel import util
    from ipyparallel.client import asyncresult
    from ipyparallel.controller import hub

    original = util._parse_date
    if getattr(original, "_nbdist", False):
        return

    def parse_date(s: Any) -> Any:
        if isinstance(s, str) and util.ISO8601_PAT.match(s):
            try:
                dt = datetime.fromisoformat(f"{s[:-1]}+00:00" if s.endswith("Z") else s)
            except ValueError:
                return original(s)
            return util._ensure_tzinfo(dt)
        return original(s)

    parse_date._nbdist = True  # type: ignore[attr-defined]
    parse_date.__wrapped__ = original  # type: ignore[attr-defined]  # functools' name for what a wrapper wraps
    util._parse_date = asyncresult._parse_date = hub.parse_date = parse_date


# The monitor topics the hub of nbdist's controller hears (ipyparallel's ``Hub.monitor_handlers``): the heart
# monitor's, the task and broadcast schedulers' (load-balanced and broadcast views), and iopub, of which it acts on an
# engine's ``shutdown_reply`` alone. Not a direct request (``in``) nor its reply (``out``), nor the control queue's.
HUB_TOPICS = (b"heartmonitor", b"intask", b"outtask", b"tracktask", b"inbcast", b"outbcast", b"iopub")


def lean_hub_monitor() -> None:
    """ipyparallel's hub hears a copy of every message its queues pass (its monitor socket subscribes to all) and
    reads each: a direct request and its reply, to keep a record nbdist's controller does not keep (``NoDB``) and a
    count of each engine's requests that only ``Client.queue_status`` reads; each iopub message, to act on an engine's
    ``shutdown_reply``; each control message, to drop it. In the hub of nbdist's controller: its monitor socket
    subscribes to ``HUB_TOPICS`` alone, so the queues' devices do not even send it the rest, and of iopub it reads
    only a message whose header says ``shutdown_reply`` (a status or an output, ipyparallel's hub read only to drop).
    Three messages a rank a trivial cell, each verified and parsed in the controller's Python, are no longer read
    (benchmarks/controller_cost.py). ``queue_status`` then counts no direct request: nbdist never asks it."""
    import functools

    import zmq
    from ipyparallel.controller import hub

    init = hub.Hub.__init__
    if getattr(init, "_nbdist", False):
        return

    @functools.wraps(init)
    def lean_init(self: Any, **kwargs: Any) -> None:
        init(self, **kwargs)
        sock = self.monitor.socket
        sock.setsockopt(zmq.UNSUBSCRIBE, b"")
        for topic in HUB_TOPICS:
            sock.setsockopt(zmq.SUBSCRIBE, topic)

        def iopub(idents: Any, msg: list) -> None:
            if len(msg) > 1 and b"shutdown_reply" in msg[1]:  # msg: signature, header, ... after the identities
                self.monitor_iopub_message(idents, msg)

        self.monitor_handlers[b"iopub"] = iopub

    lean_init._nbdist = True  # type: ignore[attr-defined]
    hub.Hub.__init__ = lean_init  # type: ignore[method-assign]


def skip_controller_settle_sleep() -> None:
    """ipyparallel 9's controller sleeps 0.25 s in ``init_hub`` before it writes the connection files every engine
    waits for (a quarter of a warm ``%dist_start``); nothing waits on that pause, so nbdist's controller skips it."""
    import time as _time
    import types

    from ipyparallel.controller import app

    def sleep(seconds: float) -> None:
        if seconds != 0.25:
            _time.sleep(seconds)

    app.time = types.SimpleNamespace(**{k: getattr(_time, k) for k in dir(_time) if not k.startswith("__")})
    app.time.sleep = sleep


UNREADABLE = logging.getLogger("nbdist.unreadable")  # messages a client dropped; silent unless configured
UNREADABLE.addHandler(logging.NullHandler())
UNREADABLE.propagate = False


def drop_unreadable_messages(client: Any) -> None:
    """Make an ipyparallel Client drop a message it cannot unpack instead of dying on it.

    ipyparallel 9.2's ``unpack_message`` lets ``Session.feed_identities``' ValueError escape, and
    its handler for a bad signature calls ``self.log``, which ``Client`` lacks: either exception
    ends the stream's callback, and the notebook stops hearing from the ranks. A local user can
    send such frames to the controller's loopback ports (ZMTP 1.0 framing needs no handshake),
    which the controller forwards (tests/shared_node/test_other_user.py). Here a message without
    a delimiter reaches ``deserialize`` as nothing, which fails inside the try; the failure is
    logged to ``nbdist.unreadable`` and the message dropped."""
    if not hasattr(client, "log"):
        client.log = UNREADABLE
    session = client.session
    feed = session.feed_identities

    def feed_identities(msg_list: Any, copy: bool = True) -> Any:
        try:
            return feed(msg_list, copy=copy)
        except ValueError:
            return [], []

    session.feed_identities = feed_identities
