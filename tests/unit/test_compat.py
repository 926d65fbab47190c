"""Every private API in nbdist.compat, probed against the installed packages.

When an upgrade moves one of them, the test names the entry; when an installed version
is outside the range compat.CHECKED records, it says so, so that widening the range
follows a re-check. The same accessors also run for real in the integration tests.
"""

from __future__ import annotations

import inspect
import platform
import time
import types
from importlib.metadata import version

import pytest

from nbdist import compat
from tests.helpers import poll


def _tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("+")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


@pytest.mark.parametrize("package", sorted(compat.CHECKED))
def test_installed_versions_are_the_ones_compat_was_checked_against(package):
    low, high = compat.CHECKED[package]
    have = platform.python_version() if package == "python" else version(package)
    assert _tuple(low) <= _tuple(have) <= _tuple(high), (
        f"{package} {have} is outside {low}..{high}, the range nbdist.compat was checked against: "
        "run the suite, re-check each entry of compat.PRIVATE_APIS for it, then widen CHECKED."
    )


def test_every_private_api_has_a_probe_below():
    probed = {name for name in globals() if name.startswith("test_probe_")}
    assert len(probed) == len(compat.PRIVATE_APIS), "add a test_probe_ for each entry of compat.PRIVATE_APIS"


def test_probe_async_result_children():
    from ipyparallel.client.asyncresult import AsyncResult

    source = inspect.getsource(AsyncResult)
    assert "self._children" in source, (
        "ipyparallel's AsyncResult no longer keeps _children: see nbdist/compat/ipyparallel_private.py"
    )


def test_probe_launcher_popen():
    from ipyparallel.cluster.launcher import LocalProcessLauncher

    assert "_popen_process" in inspect.getsource(LocalProcessLauncher), "see compat.launcher_popen"
    launcher = LocalProcessLauncher.__new__(LocalProcessLauncher)
    compat.set_launcher_popen(launcher, "popen")
    assert compat.launcher_popen(launcher) == "popen"


def test_probe_controller_settle_sleep():
    from ipyparallel.controller import app

    assert "time.sleep(0.25)" in inspect.getsource(app.IPController.init_hub), "see compat.skip_controller_settle_sleep"
    real = app.time
    try:
        compat.skip_controller_settle_sleep()
        assert app.time.sleep is not real.sleep and app.time.time() > 0
        tic = real.time()
        app.time.sleep(0.25)  # skipped
        app.time.sleep(0.01)  # any other pause still happens
        assert 0.01 <= real.time() - tic < 0.2
    finally:
        app.time = real


def test_probe_cell_filenames():
    from IPython.core.compilerop import CachingCompiler

    compiler = CachingCompiler()
    name = compiler.cache("x = 1\n", number=7)
    assert name in compat.cell_filenames(type("Shell", (), {"compile": compiler})())
    assert compat.cell_filenames(None) == {}


def test_probe_show_error():
    """ipykernel's shell publishes what _showtraceback gets as the cell's error and keeps it for the reply."""
    import inspect

    from ipykernel.zmqshell import ZMQInteractiveShell

    params = list(inspect.signature(ZMQInteractiveShell._showtraceback).parameters)
    assert params == ["self", "etype", "evalue", "stb"], params
    shown = []

    class Shell:
        def _showtraceback(self, etype, evalue, stb):
            shown.append((etype, evalue, stb))

    exc = SystemExit("the code exited with status 3")
    compat.show_error(Shell(), exc)
    assert shown == [(SystemExit, exc, ["SystemExit: the code exited with status 3"])]
    compat.show_error(None, exc)  # no shell: nothing to show


def test_probe_abort_process_group():
    import torch.distributed as dist

    assert callable(getattr(dist.distributed_c10d, "_abort_process_group", None)), "see compat.abort_process_group"


def test_probe_ddp_timers():
    """One-process gloo world: DDP's reducer times a step and the timers read back."""
    import torch

    with compat.world_of_one():  # which keeps the group past the model (freeing it with the model could hang)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
        logger = compat.ddp_time_every_step(model)
        for _ in range(2):
            model(torch.randn(3, 4)).sum().backward()
        model(torch.randn(3, 4))  # the forward after a step reports it
        ints = compat.ddp_timers(logger)
        for key in ("backward_comm_time", "backward_comm_time_start", "backward_comm_time_end"):
            assert key in ints, f"DDP's logging data has no {key!r}: see compat.ddp_timers"
        assert "backward_compute_time_end" in ints


def test_probe_fsdp_collective_classes():
    gather, scatter = compat.fsdp_collective_classes()
    params = list(inspect.signature(gather.__call__).parameters)
    assert params[1:] == ["output_tensor", "input_tensor", "group", "async_op"], params
    params = list(inspect.signature(scatter.__call__).parameters)
    assert params[1:] == ["output_tensor", "input_tensor", "group", "op", "async_op"], params


def test_probe_lightning_ddp_launcher():
    import importlib

    for name in ("lightning.fabric.strategies.ddp", "lightning.pytorch.strategies.ddp"):
        module = importlib.import_module(name)
        source = inspect.getsource(module.DDPStrategy)
        assert hasattr(module, "_SubprocessScriptLauncher"), f"{name} no longer imports _SubprocessScriptLauncher"
        assert "def _configure_launcher" in source, (
            f"{name}.DDPStrategy has no _configure_launcher: see nbdist/compat/lightning_private.py"
        )
        for attr in ("self._start_method", "self._process_group_backend", "self._launcher"):
            assert attr in source, f"{name}.DDPStrategy no longer sets {attr}: see engine/adapters.py"


def test_probe_start_waiting():
    from ipyparallel.cluster.launcher import LocalProcessLauncher

    source = inspect.getsource(LocalProcessLauncher.start)
    assert "self._start_waiting()" in source, "LocalProcessLauncher.start no longer calls _start_waiting: see compat"
    assert callable(LocalProcessLauncher._start_waiting)


def test_probe_route_run_command():
    from ipyparallel.cluster.launcher import BatchSystemLauncher

    assert "self._run_command(" in inspect.getsource(BatchSystemLauncher.start), "see compat.route_run_command"

    class Batch(BatchSystemLauncher):
        def run_command(self, command, **kwargs):
            return "said"

    compat.route_run_command(Batch)
    assert Batch._run_command is Batch.run_command


def test_probe_drop_unreadable_messages():
    from ipyparallel import Client
    from jupyter_client.session import Session

    assert not hasattr(Client, "log"), "ipyparallel's Client has a log now: see compat.drop_unreadable_messages"
    import ipyparallel.client.client as client_module

    assert list(inspect.signature(Session.feed_identities).parameters)[1:3] == ["msg_list", "copy"]
    assert "session.feed_identities(" in inspect.getsource(client_module), "see compat.drop_unreadable_messages"
    session = Session(key=b"k")
    client = type("C", (), {"session": session})()
    compat.drop_unreadable_messages(client)
    assert client.session.feed_identities([b"no delimiter"]) == ([], [])
    assert client.log is compat.UNREADABLE


def test_probe_numba_cached():
    from nbdist.compression import kernels

    kernel, step = kernels.warm_up_steps()[0]
    step()  # loaded from numba's cache, or compiled and written to it
    assert callable(kernel._cache._cache_file._load_index), "numba's cache layout moved: see compat.numba_cached"
    assert isinstance(compat.numba_cached(kernel), bool)
    assert compat.numba_cached(object()) is False  # anything else: not cached, never an exception


_GROUPS: list[object] = []


def _outlive_the_test(group: object) -> None:
    """Keep a gloo group past its test: freed right after its last collective, on the thread that holds the GIL, it
    can hang the process (see compat.world_of_one)."""
    _GROUPS.append(group)


def test_probe_group_sequence_number(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        before = compat.group_sequence_number(dist.group.WORLD)
        dist.barrier()
        assert compat.group_sequence_number(dist.group.WORLD) > before
    finally:
        _outlive_the_test(dist.group.WORLD)
        dist.destroy_process_group()


def test_probe_thread_frames():
    import threading

    assert threading.get_ident() in compat.thread_frames()


def test_probe_parser_actions():
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--x")
    assert [a.dest for a in compat.parser_actions(parser)] == ["help", "x"]


def test_probe_on_io_thread():
    import asyncio
    import threading
    import types

    from ipyparallel import Client
    from tornado.ioloop import IOLoop

    assert {"_io_loop", "_io_thread"} <= set(Client.class_traits()), "see compat.on_io_thread"
    assert "iopub_callbacks" in inspect.getsource(Client._dispatch_iopub), "callbacks run where messages are handled"
    ready, box = threading.Event(), {}

    def serve():
        asyncio.set_event_loop(asyncio.new_event_loop())
        box["loop"] = IOLoop.current()
        ready.set()
        box["loop"].start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    ready.wait(5)
    try:
        client = types.SimpleNamespace(_io_loop=box["loop"], _io_thread=thread)
        ran: list[str] = []
        with compat.io_paused(client):  # what the loop would run (a reply handled) waits for the block's end
            box["loop"].add_callback(lambda: ran.append("io"))
            time.sleep(0.2)
            assert ran == [] and compat.on_io_thread(client, lambda: 7) == 7  # held: nothing runs; nested: at once
        assert poll(lambda: ran == ["io"], 5)
        assert compat.on_io_thread(types.SimpleNamespace(), lambda: 7) == 7  # no IO thread: here
        assert "add_callback" in inspect.getsource(Client._send), "sends go through the IO thread io_paused holds"
    finally:
        box["loop"].add_callback(box["loop"].stop)
        thread.join(5)


def test_probe_execute_heard():
    from ipyparallel import Client, DirectView
    from ipyparallel.client.asyncresult import AsyncResult
    from jupyter_client.session import Session

    send = inspect.getsource(Client._send)
    for line in (  # what compat.execute_heard does for each request as ipyparallel's _send does it
        "self.outstanding.add(msg_id)",
        "self.history.append(msg_id)",
        "self._outstanding_dict[ident_str].add(msg_id)",
        "futures = self.create_message_futures(",
        "self.results.pop(msg_id, None)",
        "self._futures.pop(msg_id, None)",
        "self._output_futures.pop(msg_id, None)",
        "self.metadata.pop(msg_id, None)",
        "multi_future(futures).add_done_callback(cleanup)",
        "self._io_loop.add_callback(_really_send)",
    ):
        assert line in send, f"Client._send changed ({line!r}): see compat.execute_heard"
    assert "content = dict(code=code, silent=bool(silent), user_expressions={})" in inspect.getsource(
        Client.send_execute_request
    )
    assert "to_send = self.serialize(msg, ident)" in inspect.getsource(Session.send)  # what send_all signs and sends
    assert "_build_targets" in vars(Client) and "_socket" in inspect.getsource(DirectView.execute)
    assert list(inspect.signature(AsyncResult).parameters)[:5] == ["client", "children", "fname", "targets", "owner"]


def test_execute_heards_sends_go_straight_to_the_socket_and_the_rest_through_the_stream_in_order():
    """compat.execute_heard's requests, sent together on the IO thread (compat.send_all): straight on the socket
    while it takes them at once; from the first it does not (no peer yet: a DEALER holds nothing then), the rest
    through the socket's stream, queued until it can send. Every message arrives once, in order, signed."""
    import asyncio

    import zmq
    from jupyter_client.session import Session
    from zmq.eventloop.zmqstream import ZMQStream

    from nbdist.compat.ipyparallel_private import send_all

    session, ctx = Session(key=b"secret"), zmq.Context.instance()

    async def send_and_hear(connect_first: bool) -> tuple[list[int], bool]:
        dealer, router = ctx.socket(zmq.DEALER), ctx.socket(zmq.ROUTER)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        stream = ZMQStream(dealer)
        try:
            if connect_first:
                dealer.connect(f"tcp://127.0.0.1:{port}")
                while not dealer.poll(10, zmq.POLLOUT):  # the connection made: the socket takes a message
                    await asyncio.sleep(0.01)
            messages = [(b"engine-%d" % k, session.msg("execute_request", content={"k": k})) for k in range(50)]
            send_all(session, stream, messages)
            queued = stream.sending()
            if not connect_first:
                dealer.connect(f"tcp://127.0.0.1:{port}")
            heard: list[int] = []
            deadline = time.monotonic() + 20  # a message lost would wait for ever
            while len(heard) < len(messages):
                assert time.monotonic() < deadline, heard
                if router.poll(10):
                    frames = router.recv_multipart()
                    idents, msg = session.feed_identities(frames[1:])  # the first is the dealer's own identity
                    assert idents == [b"engine-%d" % len(heard)]
                    heard.append(session.deserialize(msg)["content"]["k"])  # checks the signature
                else:
                    await asyncio.sleep(0.01)
            return heard, queued
        finally:
            stream.close(linger=0)
            router.close(linger=0)

    assert asyncio.run(send_and_hear(connect_first=True)) == (list(range(50)), False)  # all straight on the socket
    assert asyncio.run(send_and_hear(connect_first=False)) == (list(range(50)), True)  # all through the stream


def test_replies_that_come_while_execute_heard_sends_are_all_heard():
    """compat.send_all sends on the socket itself, under the stream that also reads the replies (the client's mux
    socket): a zmq socket's descriptor is edge-triggered, and a send can take in a reply without the loop being told,
    so the stream is flushed after. Here a peer answers each request at once, for 30 rounds of 64 requests, and every
    answer must reach the stream's callback (without the flush, the 2nd round's answers waited in the socket)."""
    import asyncio
    import threading

    import zmq
    from jupyter_client.session import Session
    from zmq.eventloop.zmqstream import ZMQStream

    from nbdist.compat.ipyparallel_private import send_all

    session, ctx = Session(key=b"secret"), zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def echo() -> None:  # the controller's side: each request answered as it comes
        while not stop.is_set():
            if router.poll(10):
                router.send_multipart(router.recv_multipart())

    async def rounds() -> list[int]:
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{port}")
        stream, heard = ZMQStream(dealer), []
        stream.on_recv(lambda frames: heard.append(1))
        try:
            while not dealer.poll(10, zmq.POLLOUT):
                await asyncio.sleep(0.01)
            counts = []
            for r in range(30):
                send_all(session, stream, [(b"e%d" % k, session.msg("execute_request", content={})) for k in range(64)])
                deadline = time.monotonic() + 10  # an answer not heard waits for ever
                while len(heard) < 64 * (r + 1) and time.monotonic() < deadline:
                    await asyncio.sleep(0.001)
                counts.append(len(heard))
                if len(heard) < 64 * (r + 1):
                    break
            return counts
        finally:
            stream.close(linger=0)

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    try:
        assert asyncio.run(rounds()) == [64 * (r + 1) for r in range(30)]
    finally:
        stop.set()
        thread.join(5)
        router.close(linger=0)


def test_probe_execute_heard_broadcast():
    """A broadcast request's per-engine ids and futures, as BroadcastView makes them (compat.execute_heard_broadcast);
    the live round trip is tests/integration/test_broadcast_cells.py."""
    from ipyparallel import BroadcastView, Client
    from ipyparallel.controller.broadcast_scheduler import BroadcastScheduler

    made = inspect.getsource(BroadcastView._make_async_result)
    assert "f'{original_msg_id}_{ident}'" in made and "create_message_futures" in made, (
        "see compat.execute_heard_broadcast"
    )
    assert "_outstanding_dict[ident]" in made
    assert "f'{original_msg_id}_{outgoing_id" in inspect.getsource(BroadcastScheduler.get_new_msg_id)
    assert list(inspect.signature(Client.create_message_futures).parameters)[:4] == [
        "self",
        "msg_id",
        "header",
        "async_result",
    ]
    cleanup = inspect.getsource(Client._send)
    assert all(f"self.{c}.pop(msg_id" in cleanup for c in ("results", "_futures", "_output_futures", "metadata"))
    assert "is_broadcast=True" in inspect.getsource(BroadcastView._init_metadata)


def test_probe_control_channel_for_nbdist_messages():
    """breakpoint() on a rank: nbdist's own message type on the engine's control channel (compat.send_control,
    compat.add_control_handler); the live round trip is tests/integration/test_breakpoint.py."""
    from ipykernel.kernelbase import Kernel
    from ipyparallel import Client

    source = inspect.getsource(Client._send_control_request)
    assert "_control_stream" in source and "multi_future" in source, "see compat.send_control"
    assert "control_handlers.get(msg_type" in inspect.getsource(Kernel.process_control), (
        "see compat.add_control_handler"
    )
    kernel = types.SimpleNamespace(control_handlers={})
    compat.add_control_handler(kernel, "x_request", print)
    assert kernel.control_handlers == {"x_request": print}


def test_probe_lean_iopub():
    """An engine's kernel publishes its busy status and the execute_input echo through the two methods
    compat.lean_iopub replaces on the instance, and everything it sends (streams, displays, its value, its error,
    ipyparallel's data, the reply) through its one Session's ``send``; the notebook's client hands each reply to the
    handler compat.execute_heard wraps, which resolves the output future an idle status would. The live messages are
    tests/integration/test_cells.py's."""
    from ipykernel.kernelbase import Kernel
    from ipyparallel import Client
    from jupyter_client.session import Session

    execute = inspect.getsource(Kernel.execute_request)
    assert "self._publish_execute_input(code, parent, self.execution_count)" in execute, "see compat.lean_iopub"
    reply = execute[execute.index("= self.session.send(") :]
    assert reply.index('"execute_reply"') < reply.index("metadata=metadata") < reply.index(")"), "see compat.lean_iopub"
    dispatch = inspect.getsource(Kernel.dispatch_shell) + inspect.getsource(Kernel.process_control)
    assert 'self._publish_status("busy"' in dispatch, "see compat.lean_iopub"
    assert dispatch.index('self.set_parent(idents, msg, channel="shell")') < dispatch.index('_publish_status("busy"')
    assert list(inspect.signature(Kernel._publish_status).parameters) == ["self", "status", "channel", "parent"]
    assert list(inspect.signature(Session.send).parameters) == [
        "self", "stream", "msg_or_type", "content", "parent", "ident", "buffers", "track", "header", "metadata"
    ], "see compat.ipykernel_private._OutputCount.sending"
    assert "get_parent" in dir(Kernel)
    client = inspect.getsource(Client)
    assert "'execute_reply': self._handle_execute_reply" in client and "self._output_futures[msg_id] = output" in client

    sent: list[tuple[str, str]] = []
    out: list[tuple[str, dict]] = []
    parents = {"shell": {}}

    def send(stream, msg_or_type, content=None, parent=None, ident=None, buffers=None, track=False, header=None,
             metadata=None):
        out.append((msg_or_type if isinstance(msg_or_type, str) else msg_or_type["header"]["msg_type"], metadata))

    kernel = types.SimpleNamespace(
        _publish_status=lambda status, channel, parent=None: sent.append((status, channel)),
        get_parent=lambda channel: parents[channel],
        session=types.SimpleNamespace(send=send),
    )
    compat.lean_iopub(kernel)
    compat.lean_iopub(kernel)  # once, however often a rank is configured
    for state in ("busy", "idle", "starting"):
        kernel._publish_status(state, "shell")
    kernel._publish_execute_input("x = 1", {}, 1)
    assert sent == [("idle", "shell"), ("starting", "shell")]

    # A request that asks for its output counted: no idle after it; its reply says how many messages came before it.
    asked = {"header": {"msg_id": "a"}, "metadata": {compat.OUTPUT_COUNT: True}}
    parents["shell"] = asked
    sent.clear()
    kernel._publish_status("busy", "shell")
    for kind in ("stream", "display_data", "data_message", "error"):
        kernel.session.send("iopub", kind, {}, asked["header"])  # as a header, as OutStream gives it
    kernel.session.send("iopub", {"header": {"msg_type": "execute_result"}, "parent_header": asked["header"]})
    kernel.session.send("iopub", "stream", {}, {"header": {"msg_id": "other"}})  # another request's: not counted
    kernel.session.send("shell", "execute_reply", {}, asked, metadata={"status": "ok"})
    kernel._publish_status("idle", "shell")
    kernel._publish_status("idle", "control", {"header": {"msg_id": "c"}})  # a control request's idle still goes
    assert out[-1] == ("execute_reply", {"status": "ok", compat.OUTPUT_COUNT: 5}), out
    assert sent == [("idle", "control")], sent

    # A request that does not ask (ipyparallel's own view.execute): its idle comes, its reply says no count.
    parents["shell"] = {"header": {"msg_id": "b"}, "metadata": {}}
    sent.clear()
    kernel._publish_status("busy", "shell")
    kernel.session.send("iopub", "stream", {}, parents["shell"])
    kernel.session.send("shell", "execute_reply", {}, parents["shell"], metadata={"status": "ok"})
    kernel._publish_status("idle", "shell")
    assert out[-1] == ("execute_reply", {"status": "ok"}) and sent == [("idle", "shell")], (out, sent)


def test_probe_fast_iso_dates(monkeypatch):
    """ipyparallel reads a reply's timestamps with dateutil where the time goes (the client's reply, the hub's
    request and reply); compat.fast_iso_dates reads them with datetime, to the same instant, and leaves what is not a
    date (or a date datetime cannot read) to ipyparallel's own parser."""
    import warnings
    from datetime import datetime, timedelta, timezone

    from ipyparallel import util
    from ipyparallel.client import asyncresult, client
    from ipyparallel.controller import hub
    from jupyter_client.jsonutil import json_default

    assert "util._parse_date(msg_meta['started'])" in inspect.getsource(client.Client._extract_metadata)
    assert "extract_dates(md.get('started', None))" in inspect.getsource(hub.Hub.save_queue_result)
    assert "parse_date(header['date'])" in inspect.getsource(hub.ensure_date_is_parsed)
    assert "_parse_date(md[key])" in inspect.getsource(asyncresult.AsyncResult._parse_metadata_dates)
    original = getattr(util._parse_date, "__wrapped__", util._parse_date)  # a world this process started patched it
    for module, name in ((util, "_parse_date"), (asyncresult, "_parse_date"), (hub, "parse_date")):
        monkeypatch.setattr(module, name, original)  # ipyparallel's own, put back as it was after the test
    when = datetime(2026, 12, 5, 6, 40, 0, 123456, tzinfo=timezone.utc)
    samples = [
        json_default(when),  # as jupyter_client writes a header's date and an engine's 'started'
        json_default(when.replace(microsecond=0)),
        when.astimezone(timezone(timedelta(hours=1))).isoformat(),
        "2026-12-05T06:40:00.1234567Z",  # seven digits: datetime cannot, ipyparallel's parser can
        "2026-12-05T06:40:00",  # naive: both make it local, with ipyparallel's warning
        "not a date",
        None,
    ]
    compat.fast_iso_dates()
    fast = util._parse_date
    compat.fast_iso_dates()  # once, however many worlds the kernel starts
    assert fast is not original and util._parse_date is fast and asyncresult._parse_date is fast
    assert hub.parse_date is fast
    assert fast(json_default(when)) == when
    read = util.extract_dates({"started": [json_default(when)]})["started"][0]  # the hub's path
    assert read == when and read.tzinfo is timezone.utc  # datetime's own UTC: read by the patched parser
    monkeypatch.setenv("TZ", "Asia/Kolkata")  # a local time that is not UTC: a 'Z' read as local would show
    time.tzset()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            for s in samples:
                theirs, ours = original(s), fast(s)
                assert ours == theirs and type(ours) is type(theirs), s
                if isinstance(ours, datetime):
                    assert ours.tzinfo is not None and ours.utcoffset() == theirs.utcoffset(), s
    finally:
        monkeypatch.undo()
        time.tzset()


def test_nbdists_controller_reads_dates_with_datetime_before_it_starts(monkeypatch):
    """``python -m nbdist.engine.controller`` applies compat.fast_iso_dates and compat.lean_hub_monitor before
    ipyparallel's controller starts (its hub reads every request's and reply's dates; it need not hear most of them),
    and starts it with nbdist's hub settings (what they do:
    tests/integration/test_cells.py)."""
    from ipyparallel import util
    from ipyparallel.client import asyncresult
    from ipyparallel.controller import app, hub

    from nbdist.engine import controller, parentwatch

    patched = ((util, "_parse_date"), (asyncresult, "_parse_date"), (hub, "parse_date"), (app, "time"), (hub.Hub, "__init__"))
    for module, name in patched:
        monkeypatch.setattr(module, name, getattr(module, name))
    seen: list[tuple[bool, bool, dict]] = []
    monkeypatch.setattr(parentwatch, "watch_parent", lambda on_exit: None)
    monkeypatch.setattr(
        app,
        "main",
        lambda **kw: seen.append(
            (getattr(hub.parse_date, "_nbdist", False), getattr(hub.Hub.__init__, "_nbdist", False), kw)
        ),
    )
    controller.main()
    hub_settings = {"db_class": "NoDB", "logging_config": {"loggers": {"IPController": {"level": "WARNING"}}}}
    assert seen == [(True, True, hub_settings)]  # dates read with datetime; a hub that hears what it acts on
    assert app.IPController(**hub_settings).db_class.__name__ == "NoDB"  # names ipyparallel takes


def test_probe_lean_hub_monitor(monkeypatch):
    """A real hub on inproc sockets, its monitor fed as ipyparallel's queues feed it (a topic frame, then the signed
    message): made after compat.lean_hub_monitor, it hears the heart monitor, the task and broadcast schedulers and,
    of iopub, an engine's ``shutdown_reply`` alone; a direct request and reply (``in``, ``out``) and the control
    queue's never reach it, nor an iopub status or stream. The hub made before the patch heard them all."""
    import asyncio

    import zmq
    from ipyparallel.controller import hub
    from jupyter_client.session import Session
    from zmq.eventloop.zmqstream import ZMQStream

    source = inspect.getsource(hub.Hub.__init__)
    assert "self.monitor.on_recv(self.dispatch_monitor_traffic)" in source and "b'iopub': self.monitor_iopub_message" in source
    assert "if handler is not None:" in inspect.getsource(hub.Hub.dispatch_monitor_traffic)
    monkeypatch.setattr(hub.Hub, "__init__", hub.Hub.__init__)  # put back after the test
    heard: list[tuple[bytes, str]] = []

    def record(topic: bytes):
        def handler(self, idents, msg):
            heard.append((topic, self.session.deserialize(msg)["header"]["msg_type"]))

        return handler

    for name, topic in (("save_queue_request", b"in"), ("save_queue_result", b"out"), ("save_task_request", b"intask"),
                        ("save_broadcast_result", b"outbcast"), ("monitor_iopub_message", b"iopub"),
                        ("heartmonitor_message", b"heartmonitor")):
        monkeypatch.setattr(hub.Hub, name, record(topic))
    control = []
    monkeypatch.setattr(hub, "_passer", lambda *a: control.append(a))
    sent = [(b"in", "execute_request"), (b"incontrol", "abort_request"), (b"out", "execute_reply"),
            (b"iopub", "status"), (b"iopub", "stream"), (b"intask", "apply_request"), (b"outcontrol", "abort_reply"),
            (b"iopub", "shutdown_reply"), (b"outbcast", "apply_reply")]

    async def feed(lean: bool) -> list[tuple[bytes, str]]:
        if lean:
            compat.lean_hub_monitor()
            compat.lean_hub_monitor()  # once, however often it is called
        heard.clear()
        control.clear()
        ctx, session = zmq.Context.instance(), Session(key=b"k")
        url = f"inproc://monitor-{lean}"
        sub, query, resubmit = ctx.socket(zmq.SUB), ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
        sub.setsockopt(zmq.SUBSCRIBE, b"")  # as ipyparallel's controller makes it
        sub.bind(url)
        pub = ctx.socket(zmq.PUB)
        pub.connect(url)
        streams = [ZMQStream(sub), ZMQStream(query), ZMQStream(resubmit)]
        made = hub.Hub(session=session, monitor=streams[0], query=streams[1], resubmit=streams[2], db=None)

        def send(topic: bytes, msg_type: str) -> None:
            pub.send_multipart([topic, *session.serialize(session.msg(msg_type, content={}), ident=b"engine")])

        try:
            while not heard:  # until the subscription is through (a heart monitor's message is heard both ways)
                send(b"heartmonitor", "hello")
                await asyncio.sleep(0.01)
            for topic, msg_type in sent:
                send(topic, msg_type)
            send(b"heartmonitor", "last")
            for _ in range(500):  # one socket, in order: once the last is heard, all the rest were
                if heard[-1] == (b"heartmonitor", "last"):
                    break
                await asyncio.sleep(0.01)
            return [h for h in heard if h[0] != b"heartmonitor"] + [(b"control", str(len(control)))]
        finally:
            for stream in streams:
                stream.close(linger=0)
            pub.close(linger=0)
            del made

    everything = asyncio.run(feed(lean=False))
    assert everything == [(t, m) for t, m in sent if b"control" not in t] + [(b"control", "2")]
    assert asyncio.run(feed(lean=True)) == [(b"intask", "apply_request"), (b"iopub", "shutdown_reply"),
                                            (b"outbcast", "apply_reply"), (b"control", "0")]


def test_probe_controller_engines():
    from ipyparallel import Client
    from ipyparallel.controller.hub import Hub

    assert "'connection_reply'" in inspect.getsource(Hub.connection_request) and "engines" in inspect.getsource(
        Hub.connection_request
    ), "see compat.controller_engines"
    source = inspect.getsource(Client)
    assert "def _send(" in source and "_query_stream" in source, "see compat.controller_engines"
    assert "def _update_engines(self, engines)" in source, "see compat.add_engines"
    # the cause compat.add_engines answers: the client asks for the list before it subscribes to notifications
    connect = inspect.getsource(Client._connect)
    assert connect.index("'connection_request'") < connect.index("_notification_socket"), "see compat.add_engines"


def test_probe_engine_registration_steps():
    from ipyparallel.engine.app import IPEngine

    assert inspect.iscoroutinefunction(IPEngine.register) and inspect.iscoroutinefunction(
        IPEngine.complete_registration
    )
    assert "self.start_heartbeat(" in inspect.getsource(IPEngine.complete_registration), (
        "see compat.on_engine_registration"
    )


def test_probe_world_of_one(tmp_path):
    """Inside, the default group is a world of one (DDP builds on it); after, the world's group is the default again
    and still reduces; the one-rank group is gone from torch's tables."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        world, groups = c10d._world.default_pg, len(c10d._world.pg_map)
        with compat.world_of_one():
            one = c10d._world.default_pg
            assert one is not world and dist.get_world_size() == 1
            model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
            model(torch.ones(3, 2)).sum().backward()
        assert c10d._world.default_pg is world and one not in c10d._world.pg_map
        assert len(c10d._world.pg_map) == groups
        t = torch.ones(2)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0]
    finally:
        _outlive_the_test(c10d._world.default_pg)
        dist.destroy_process_group()


def test_probe_fsdp_waits():
    """FSDP2's wait points are methods of FSDPParamGroup that take the group (and post_backward, *unused)."""
    import inspect

    waits = compat.fsdp_waits()
    assert [name for _, name in waits] == ["unshard", "wait_for_unshard", "post_backward", "finalize_backward"]
    for owner, name in waits:
        assert list(inspect.signature(getattr(owner, name)).parameters)[0] == "self"


def test_the_torch_requirement_has_no_ceiling_so_pip_keeps_a_newer_torch():
    """A ceiling made pip replace a hub's newer torch (a GPU build of several GB) with an older one, or fail: the
    requirement admits every release from the oldest checked on, the next ones included (README, "Which torch")."""
    import pathlib

    from packaging.requirements import Requirement

    tomllib = pytest.importorskip("tomllib", reason="Python 3.11 reads pyproject.toml")

    meta = tomllib.loads((pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    [torch] = [Requirement(r) for r in meta["project"]["dependencies"] if Requirement(r).name == "torch"]
    for release in (compat.CHECKED["torch"][0] + ".0", "2.14.1", "2.15.0", "2.16.0", "3.0.0"):
        assert torch.specifier.contains(release, prereleases=False), f"{torch} refuses torch {release}"


def test_probe_cuda_bad_fork(monkeypatch):
    import torch

    assert callable(torch.cuda._is_in_bad_fork)
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", torch.cuda._is_in_bad_fork)  # put back after
    compat.cuda_bad_fork(torch)
    with pytest.raises(RuntimeError, match="Cannot re-initialize CUDA in forked subprocess.*'spawn' start method"):
        torch.cuda._lazy_init()


def test_probe_node_tree_ranks_side():
    """compat.run_relayed repeats what ipykernel's dispatch_shell does around a request's handler, and takes the lock
    its shell_main holds; compat.before_execute replaces the execute_request handler on the instance."""
    from ipykernel.kernelbase import Kernel
    from jupyter_client.session import Session

    dispatch = inspect.getsource(Kernel.dispatch_shell)
    for line in (
        'self.set_parent(idents, msg, channel="shell")',
        'self._publish_status("busy", "shell")',
        "aborting = self._aborting",
        "self._send_abort_reply(stream, msg, idents)",
        "self.should_handle(stream, msg, idents)",
        "self.pre_handler_hook()",
        "result = handler(stream, idents, msg)",
        "self.post_handler_hook()",
        'self._publish_status_and_flush("idle", "shell", stream)',
    ):
        assert line in dispatch, f"ipykernel's dispatch_shell no longer says {line}: see compat.run_relayed"
    assert "async with asyncio_lock:" in inspect.getsource(Kernel.shell_main), "see compat.run_relayed"
    assert "asyncio_lock = self._main_asyncio_lock" in inspect.getsource(Kernel.shell_main), "see compat.run_relayed"
    assert "self.shell_handlers[msg_type] = getattr(self, msg_type)" in inspect.getsource(Kernel.__init__)
    session = Session(key=b"k")
    clone = session.clone()
    assert clone.key == session.key and clone.digest_history is not session.digest_history

    handled = []

    class Stub:
        shell_handlers = {"execute_request": None}

    async def execute_request(stream, ident, parent):
        handled.append(parent["n"])

    kernel = Stub()
    kernel.shell_handlers = {"execute_request": execute_request}
    compat.before_execute(kernel, lambda request: handled.append(-request["n"]))
    compat.before_execute(kernel, lambda request: handled.append(-10 * request["n"]))  # replaces the first
    import asyncio

    asyncio.run(kernel.shell_handlers["execute_request"](None, [], {"n": 1}))
    assert handled == [-10, 1]


def test_probe_node_tree_notebooks_side():
    """compat.hear_node_replies takes the client's iopub stream's callback, unpacking as ipyparallel does and handing
    the rest to its _dispatch_iopub; a node's replies go to its handler of execute replies, dates parsed."""
    from ipyparallel import Client
    from ipyparallel.client import client as client_module

    assert callable(Client._dispatch_iopub.__wrapped__), "see compat.hear_node_replies"
    setup = inspect.getsource(Client._setup_streams)
    assert "self._iopub_stream.on_recv(self._dispatch_iopub, copy=False)" in setup, "see compat.hear_node_replies"
    handle = inspect.getsource(Client._handle_execute_reply)
    assert "md.update(self._extract_metadata(msg))" in handle, "see compat.hear_node_replies"
    extract = inspect.getsource(Client._extract_metadata)
    assert "md['completed'] = header['date']" in extract and "md['submitted'] = parent['date']" in extract
    assert "'execute_reply': self._handle_execute_reply," in inspect.getsource(Client.__init__)
    assert callable(client_module.util._parse_date)


def test_probe_lean_future():
    """compat.awaited's futures are ipyparallel's MessageFuture without its Event and tracker Future: what
    MessageFuture sets in __init__ is what the lean one sets, AsyncResult reads each child's tracker (done, None for an
    untracked request), and wait() says whether the future is done, as MessageFuture's does."""
    import threading

    from ipyparallel.client import asyncresult
    from ipyparallel.client.futures import MessageFuture

    from nbdist.compat.ipyparallel_futures import lean_future

    init = inspect.getsource(MessageFuture.__init__)
    for line in ("self._evt = Event()", "self.tracker = Future()", "self.iopub_callbacks = []", "self.track = track"):
        assert line in init, f"MessageFuture.__init__ no longer says {line}: see compat.lean_future"
    assert "multi_future([f.tracker for f in self._children])" in inspect.getsource(asyncresult.AsyncResult)
    lean = lean_future()
    made = lean("m1", {"msg_type": "execute_request"})
    real = MessageFuture("m2", {"msg_type": "execute_request"})
    assert isinstance(made, MessageFuture)
    assert set(vars(real)) - set(vars(made)) == {"_evt"}, "MessageFuture keeps something the lean one lacks"
    assert made.tracker.done() and made.tracker.result() is None and made.iopub_callbacks == []
    assert lean("m3", {}).tracker is made.tracker  # one shared
    assert made.wait(0) is False and real.wait(0) is False
    threading.Timer(0.05, made.set_result, ("reply",)).start()
    assert made.wait(5) is True and made.result() == "reply"
    real.set_result("reply")
    assert real.wait(0) is True and made.wait(0) is True


def test_probe_lean_result():
    """compat.async_result's AsyncResult replaces _init_futures: ipyparallel's still makes the three futures and hangs
    the same callbacks on them, and, on the same children, the lean one and ipyparallel's say the same: not ready
    until every reply is in, then the replies in rank order (or the ranks' errors, as ipyparallel sets them: as
    results), and the client's results and metadata popped as an owner's are, the latter once every output is in."""
    from ipyparallel import error
    from ipyparallel.client import asyncresult

    from nbdist.compat.ipyparallel_futures import lean_future, lean_result

    init = inspect.getsource(asyncresult.AsyncResult._init_futures)
    for name in ("_result_future", "_sent_future", "_output_future", "_handle_sent", "_resolve_result"):
        assert name in init, f"AsyncResult._init_futures no longer uses {name}: see compat.lean_result"
    assert "_resolve_output" in init and "_finalize_result" in init, "see compat.lean_result"

    class Client:  # what an owner AsyncResult reads and pops of its client
        def __init__(self):
            self.results, self.metadata = {}, {}

    def outcome(kind, replies, steps):
        client, children = Client(), []
        for k in range(3):
            child, output = lean_future()(f"m{k}", {}), lean_future()(f"m{k}", {})
            child.output, output.metadata = output, client.metadata.setdefault(f"m{k}", {"engine_id": k})
            client.results[f"m{k}"] = replies[k]
            children.append(child)
        ar = kind(client, children, fname="execute", targets=[0, 1, 2], owner=True)
        states = [(ar.ready(), sorted(client.metadata))]
        for what, k in steps:
            future = children[k] if what == "reply" else children[k].output
            future.set_result(replies[k] if what == "reply" else None)
            states.append((ar.ready(), sorted(client.metadata)))
        try:
            got = ar.get(0)
        except Exception as exc:
            got = (type(exc).__name__, str(exc))
        return states, got, sorted(client.results), ar.sent

    ok = ["r0", "r1", "r2"]
    failed = ["r0", error.RemoteError("KeyError", "one", ""), error.RemoteError("ValueError", "two", "")]
    replies_first = [("reply", 2), ("reply", 0), ("reply", 1), ("output", 2), ("output", 1), ("output", 0)]
    outputs_first = [("output", 1), ("output", 0), ("output", 2), ("reply", 1), ("reply", 2), ("reply", 0)]
    for replies in (ok, failed):
        for steps in (replies_first, outputs_first):
            assert outcome(lean_result(), replies, steps) == outcome(asyncresult.AsyncResult, replies, steps)
    every = ["m0", "m1", "m2"]
    states, got, results, sent = outcome(lean_result(), ok, replies_first)
    assert states == [(False, every)] * 3 + [(True, every)] * 3 + [(True, [])], states
    assert got == ok and results == [] and sent
    assert outcome(lean_result(), ok, outputs_first)[0] == [(False, every)] * 6 + [(True, [])]
    got = outcome(lean_result(), failed, replies_first)[1]
    assert got[0] == "CompositeError" and got[1].endswith("KeyError: one\n[Engine Exception]ValueError: two"), got
