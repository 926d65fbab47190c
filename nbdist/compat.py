"""Every private API of another project that nbdist relies on, in one place.

Each accessor names what it reaches into, where nbdist uses it, and the versions it was
checked against (``CHECKED``). ``tests/unit/test_compat.py`` probes every entry of
``PRIVATE_APIS`` against the installed packages and fails, naming the entry, when a
release moves one; it also fails when an installed version is outside ``CHECKED``, so an
upgrade is a decision: run the suite, re-check each entry, then widen the range.

This module imports nothing heavy at import time (engines and light processes load it).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# package -> (lowest, highest) version the entries below are known to hold for, inclusive.
# Probed on torch 2.13.0, ipyparallel 9.2.0 and IPython 9.18.1 (November 2026); the upper
# bounds are what pyproject.toml admits, so a release past them fails test_compat first.
CHECKED = {
    "torch": ("2.13", "2.14.99"),
    "ipyparallel": ("9.2", "9.99"),
    "ipython": ("9.18", "9.99"),
    "lightning": ("2.4", "2.99"),
    "numba": ("0.60", "0.99"),
    "python": ("3.10", "3.14"),  # probed on 2.6.6; pytorch-lightning and lightning-fabric are its twins
}


@dataclass(frozen=True)
class PrivateAPI:
    name: str  # what is reached into
    package: str  # whose it is (a key of CHECKED)
    used_by: str  # where nbdist uses it, and why


PRIVATE_APIS = (
    PrivateAPI(
        "ipyparallel AsyncResult._children",
        "ipyparallel",
        "run: the per-engine results of one execute, followed one by one (output, failure, state)",
    ),
    PrivateAPI(
        "ipyparallel LocalProcessLauncher._popen_process",
        "ipyparallel",
        "procs.exited: whether an engine process ended (launcher.state lags); pool hands a warm process over",
    ),
    PrivateAPI(
        "ipyparallel.controller.app's time.sleep(0.25) in IPController.init_hub",
        "ipyparallel",
        "engine.controller: skip an unconditional quarter second before the controller writes its connection files",
    ),
    PrivateAPI(
        "ipyparallel Client._send/_query_stream ('connection_request') and Client._update_engines",
        "ipyparallel",
        "world.registration: the engines the controller lists, added to a client that missed their notifications",
    ),
    PrivateAPI(
        "ipyparallel IPEngine.register / IPEngine.complete_registration (wrapped)",
        "ipyparallel",
        "engine.steps: an engine says when it asks to register, is answered, and has its kernel and heart up",
    ),
    PrivateAPI(
        "IPython CachingCompiler._filename_map",
        "ipython",
        "engine.runtime: which code objects are notebook cells, to report the cell line a rank waits at",
    ),
    PrivateAPI(
        "torch.distributed.distributed_c10d._abort_process_group",
        "torch",
        "engine.runtime: break a NCCL process group so a rank blocked in a collective returns",
    ),
    PrivateAPI(
        "torch DDP._set_ddp_runtime_logging_sample_rate, DDP.logger._get_ddp_logging_data",
        "torch",
        "parallel.instrument: DDP's own C++ timers of the gradient all-reduce, read every step on CPU",
    ),
    PrivateAPI(
        "lightning DDPStrategy._configure_launcher/_start_method/_process_group_backend/_launcher, strategies.ddp."
        "_SubprocessScriptLauncher (lightning.fabric and lightning.pytorch, and the twin packages)",
        "lightning",
        "engine.adapters: a fork/spawn DDP strategy gets Lightning's script launcher and runs on the world; a "
        "process_group_backend the world lacks fails in one line (when moved, the adapter says so and steps aside)",
    ),
    PrivateAPI(
        "ipyparallel LocalProcessLauncher._start_waiting",
        "ipyparallel",
        "launch.pool: a warm engine, forked by nbdist, is then watched by its launcher as if it had started it",
    ),
    PrivateAPI(
        "ipyparallel BatchSystemLauncher._run_command (overridden)",
        "ipyparallel",
        "launch.hosts: sbatch's refusal in Slurm's own words (ipyparallel sends stderr to the kernel's terminal)",
    ),
    PrivateAPI(
        "ipyparallel Client.log (absent) and Session.feed_identities (wrapped)",
        "ipyparallel",
        "world.engineset: a message the notebook's client cannot unpack is dropped, not fatal to its stream",
    ),
    PrivateAPI(
        "ipyparallel Client._send_control_request, ipykernel Kernel.control_handlers",
        "ipyparallel",
        "breakpoint() on a rank: a line typed in the notebook reaches its debugger on the engine's control channel",
    ),
    PrivateAPI(
        "ipyparallel Client._io_loop, Client._io_thread",
        "ipyparallel",
        "cells.watch: a cell's output callbacks are added on the client's IO thread, between two messages, so "
        "output that came before them is taken from the store exactly once",
    ),
    PrivateAPI(
        "numba Dispatcher._cache._cache_file._load_index",
        "numba",
        "compression.kernels / engine.warm: whether the kernels' on-disk cache is fresh (else compile in the background)",
    ),
    PrivateAPI(
        "torch ProcessGroup._get_sequence_number_for_group",
        "torch",
        "engine.collectives: the group's collective count, DDP's C++ calls included, for %dist_where",
    ),
    PrivateAPI(
        "ipykernel ZMQInteractiveShell._showtraceback",
        "ipython",
        "engine.exits, engine.spawned: a cell's error in one line (an exit's status, a failed child), no IPython preamble",
    ),
    PrivateAPI(
        "argparse ArgumentParser._actions",
        "python",
        "magics.common: every option a magic's parser declares (the usage tests freeze them)",
    ),
    PrivateAPI(
        "CPython sys._current_frames",
        "python",
        "engine.runtime: the main thread's stack, read by the rank's watcher thread for %dist_where",
    ),
    PrivateAPI(
        "torch.distributed.fsdp._fully_shard._fsdp_collectives.DefaultAllGather/DefaultReduceScatter",
        "torch",
        "parallel.instrument: FSDP2's collectives, subclassed to time them",
    ),
)


# ----------------------------------------------------------------------------- ipyparallel


def async_result_children(ar: Any) -> list[Any]:
    """The per-engine futures of a multi-engine AsyncResult, in the order of its targets."""
    return list(ar._children)


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


def add_control_handler(kernel: Any, msg_type: str, handler: Any) -> None:
    """On an engine: have its kernel's control thread call ``handler(stream, idents, msg)`` for ``msg_type``."""
    kernel.control_handlers[msg_type] = handler


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


# ----------------------------------------------------------------------------- IPython


def show_error(shell: Any, exc: BaseException) -> None:
    """Show ``exc`` as the cell's error in one line ``Name: text`` (sent to the notebook, and what the reply's
    traceback holds), without the "use %tb" preamble IPython puts before an exception shown alone."""
    if shell is not None:
        shell._showtraceback(type(exc), exc, [f"{type(exc).__name__}: {exc}"])


def cell_filenames(shell: Any) -> dict[str, Any]:
    """File names IPython gave to the cells it compiled (``{}`` when there is no shell)."""
    return getattr(getattr(shell, "compile", None), "_filename_map", None) or {}


# ----------------------------------------------------------------------------- torch


def parser_actions(parser: Any) -> list[Any]:
    """The actions (options and positionals) an argparse parser declares, help included."""
    return list(parser._actions)


def thread_frames() -> dict[int, Any]:
    """Each thread's current frame, by thread id (CPython's ``sys._current_frames``)."""
    import sys

    return sys._current_frames()


def group_sequence_number(group: Any) -> int:
    """How many collectives this process group has issued (its sequence number), C++ callers included."""
    return int(group._get_sequence_number_for_group())


def lightning_script_launcher(module: Any) -> Any:
    """Lightning's ``_SubprocessScriptLauncher`` as the strategy module ``module`` imported it."""
    return module._SubprocessScriptLauncher


def lightning_wrap_configure_launcher(cls: Any, wrap: Any) -> None:
    """Replace ``cls._configure_launcher`` (a DDPStrategy's) by ``wrap(original)``; the original stays reachable as
    ``__wrapped__``."""
    original = cls._configure_launcher
    wrapped = wrap(original)
    wrapped.__wrapped__ = original
    cls._configure_launcher = wrapped


def lightning_launch_settings(strategy: Any) -> tuple[str, str | None]:
    """A DDPStrategy's start method ("popen", "fork", "spawn", ...) and the backend it was asked for, if any."""
    return strategy._start_method, getattr(strategy, "_process_group_backend", None)


def lightning_set_launcher(strategy: Any, launcher: Any) -> None:
    """Make ``launcher`` the one the DDPStrategy launches with."""
    strategy._launcher = launcher


def abort_process_group() -> None:
    """Abort the default process group (NCCL): collectives blocked on it return with an error."""
    import torch.distributed as dist

    dist.distributed_c10d._abort_process_group()


def ddp_time_every_step(model: Any) -> Any:
    """Have DDP's reducer time every step's gradient reduction; return DDP's C++ logger."""
    model._set_ddp_runtime_logging_sample_rate(1)
    return model.logger


def ddp_timers(logger: Any) -> dict[str, int]:
    """DDP's timers for the last step (nanoseconds): backward_comm_time, *_start, *_end, ..."""
    logger.set_runtime_stats_and_log()  # what DDP's next forward would do; idempotent
    return dict(logger._get_ddp_logging_data().ints_map)


def fsdp_collective_classes() -> tuple[type, type]:
    """FSDP2's default all-gather and reduce-scatter callables (subclassed to time them)."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    return DefaultAllGather, DefaultReduceScatter


def numba_cached(dispatcher: Any) -> bool:
    """Whether numba's on-disk cache holds a fresh compiled form of this ``cache=True`` function
    (its index is there and matches the source): loading it takes milliseconds, compiling seconds."""
    try:
        return bool(dispatcher._cache._cache_file._load_index())
    except Exception:  # no cache, or numba's layout changed: take it as not cached
        return False


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
