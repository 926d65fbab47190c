"""Every private API of another project that nbdist relies on, in one package: one module per project it adapts
(``ipyparallel_private``, ``ipykernel_private``, ``ipython_private``, ``torch_private``, ``lightning_private``,
``numba_private``, and Python's own, ``python_private``), re-exported here, so ``compat.name`` is the one way in.

Each accessor names what it reaches into, where nbdist uses it, and the versions it was
checked against (``CHECKED``). ``tests/unit/test_compat.py`` probes every entry of
``PRIVATE_APIS`` against the installed packages and fails, naming the entry, when a
release moves one; it also fails when an installed version is outside ``CHECKED``, so an
upgrade is a decision: run the suite, re-check each entry, then widen the range.

This package imports nothing heavy at import time (engines and light processes load it).
"""

from __future__ import annotations

from dataclasses import dataclass

from .ipykernel_private import (
    NODE,
    NODE_REPLIES,
    OUTPUT_COUNT,
    add_control_handler,
    before_execute,
    lean_iopub,
    run_relayed,
)
from .ipyparallel_private import (
    UNREADABLE,
    add_engines,
    async_result_children,
    controller_engines,
    drop_unreadable_messages,
    execute_heard,
    execute_heard_broadcast,
    fast_iso_dates,
    io_paused,
    launcher_popen,
    lean_hub_monitor,
    on_engine_registration,
    on_io_thread,
    route_run_command,
    send_control,
    set_launcher_popen,
    skip_controller_settle_sleep,
    start_waiting,
)
from .ipyparallel_tree import execute_heard_tree, hear_node_replies
from .ipython_private import cell_filenames, show_error
from .lightning_private import (
    lightning_launch_settings,
    lightning_script_launcher,
    lightning_set_launcher,
    lightning_wrap_configure_launcher,
)
from .numba_private import numba_cached
from .python_private import parser_actions, thread_frames
from .torch_private import (
    abort_process_group,
    cuda_bad_fork,
    ddp_time_every_step,
    ddp_timers,
    fsdp_collective_classes,
    fsdp_waits,
    group_sequence_number,
    world_of_one,
)

# package -> (lowest, highest) version the entries below are known to hold for, inclusive.
# Probed on torch 2.13.0, ipyparallel 9.2.0 and IPython 9.18.1 (November 2026), and torch 2.14.1 and 2.15.0 by
# `make compat` (the unit tests, the core integration tests and notebook 01 on each). pyproject.toml sets no ceiling
# on torch (pip keeps a user's newer torch); a release past these bounds fails test_compat first, in `make compat`.
CHECKED = {
    "torch": ("2.13", "2.15.99"),
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
        "ipyparallel Hub.__init__, Hub.monitor, Hub.monitor_handlers and Hub.monitor_iopub_message",
        "ipyparallel",
        "engine.controller: the hub hears only the monitor topics it acts on (lean_hub_monitor)",
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
        "ipykernel Kernel._publish_status, Kernel._publish_execute_input, Kernel.get_parent, Session.send (wrapped on "
        "the instance); ipyparallel Client._queue_handlers['execute_reply'] (wrapped), Client._output_futures",
        "ipyparallel",
        "engine.runtime: an engine publishes no busy status and no echo of the cell's code, which nbdist never reads, "
        "and ends a cell's output with a count in its reply instead of an idle status (execute_heard counts)",
    ),
    PrivateAPI(
        "ipyparallel util._parse_date, util.ISO8601_PAT, util._ensure_tzinfo, client.asyncresult._parse_date, "
        "controller.hub.parse_date",
        "ipyparallel",
        "the notebook's client and nbdist's controller read a reply's timestamps with datetime, not dateutil",
    ),
    PrivateAPI(
        "ipyparallel Client._send_control_request, ipykernel Kernel.control_handlers",
        "ipyparallel",
        "breakpoint() on a rank: a line typed in the notebook reaches its debugger on the engine's control channel",
    ),
    PrivateAPI(
        "ipyparallel Client._io_loop, Client._io_thread",
        "ipyparallel",
        "world.registration: engines the client missed are added on the client's IO thread, between two messages",
    ),
    PrivateAPI(
        "ipyparallel Client._build_targets, Client._send's bookkeeping (outstanding, history, _outstanding_dict, "
        "create_message_futures, _io_loop), DirectView._socket, AsyncResult(client, futures, fname, targets, owner)",
        "ipyparallel",
        "cells.run: a cell's requests made as view.execute makes them, each future heard from before its request is "
        "sent, and sent SEND_CHUNK at a time in one callback of the IO thread",
    ),
    PrivateAPI(
        "ipyparallel BroadcastView._socket, Client.create_message_futures, Client._outstanding_dict, Client._futures/"
        "_output_futures/results/metadata, the broadcast schedulers' '<request>_<engine uuid>' ids",
        "ipyparallel",
        "cells.run: a cell sent as one broadcast request, each engine's reply heard as BroadcastView.execute makes it",
    ),
    PrivateAPI(
        "ipykernel Kernel.shell_handlers['execute_request'] (replaced on the instance), Kernel._main_asyncio_lock, "
        "Kernel._aborting, Kernel._send_abort_reply, Kernel.should_handle, Kernel.pre_handler_hook/post_handler_hook, "
        "Kernel.set_parent, Kernel._publish_status, Session.clone",
        "ipyparallel",
        "engine.nodetree: a node's leader hands its node's ranks their requests as it begins its own; they run them "
        "as Kernel.dispatch_shell runs a request from the controller, replying to the leader",
    ),
    PrivateAPI(
        "ipyparallel Client._dispatch_iopub.__wrapped__, Client._iopub_stream (its callback replaced), "
        "Client._queue_handlers['execute_reply'], util._parse_date, and execute_heard's bookkeeping",
        "ipyparallel",
        "world.nodes: a cell sent to each node's leader alone; the node's replies, batched on the leader's iopub, "
        "handed to the client's handler one by one",
    ),
    PrivateAPI(
        "ipyparallel MessageFuture (subclassed, its __init__ not called: msg_id, header, track, _tracker, tracker, "
        "iopub_callbacks, wait; output and metadata set as Client.create_message_futures sets them), "
        "AsyncResult's multi_future of its children's trackers",
        "ipyparallel",
        "cells.run: a cell's two futures a rank made with one lock each, not three (compat.ipyparallel_futures)",
    ),
    PrivateAPI(
        "ipyparallel AsyncResult._init_futures (replaced: _children, _result_future, _sent_future, _output_future, "
        "_handle_sent, _resolve_result, _resolve_output, _finalize_result)",
        "ipyparallel",
        "cells.run: a cell's AsyncResult follows its futures by a count, not multi_future (compat.async_result)",
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
    PrivateAPI(
        "torch.distributed.distributed_c10d._world.default_pg (set aside and put back)",
        "torch",
        "engine.equiv: %dist_equiv runs a cell on rank 0 in a world of one rank, then the world's group is back",
    ),
    PrivateAPI(
        "torch FSDP2 FSDPParamGroup.unshard / wait_for_unshard / post_backward / finalize_backward (wrapped)",
        "torch",
        "engine.why: the time a rank waits for FSDP2's all-gathers and reduce-scatters, apart from its compute",
    ),
    PrivateAPI(
        "torch.cuda._is_in_bad_fork (replaced in a forked child), asked first by torch.cuda._lazy_init",
        "torch",
        "engine.children: a child forked from a rank whose GPU driver is loaded says torch's own bad-fork error",
    ),
)

__all__ = [
    "CHECKED",
    "PRIVATE_APIS",
    "PrivateAPI",
    "OUTPUT_COUNT",
    "UNREADABLE",
    "abort_process_group",
    "add_control_handler",
    "add_engines",
    "async_result_children",
    "cuda_bad_fork",
    "cell_filenames",
    "controller_engines",
    "ddp_time_every_step",
    "ddp_timers",
    "drop_unreadable_messages",
    "execute_heard",
    "execute_heard_broadcast",
    "execute_heard_tree",
    "hear_node_replies",
    "before_execute",
    "run_relayed",
    "NODE",
    "NODE_REPLIES",
    "fast_iso_dates",
    "fsdp_collective_classes",
    "fsdp_waits",
    "group_sequence_number",
    "io_paused",
    "launcher_popen",
    "lean_hub_monitor",
    "lean_iopub",
    "lightning_launch_settings",
    "lightning_script_launcher",
    "lightning_set_launcher",
    "lightning_wrap_configure_launcher",
    "numba_cached",
    "on_engine_registration",
    "on_io_thread",
    "parser_actions",
    "route_run_command",
    "send_control",
    "set_launcher_popen",
    "show_error",
    "skip_controller_settle_sleep",
    "start_waiting",
    "thread_frames",
    "world_of_one",
]
