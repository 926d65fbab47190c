"""Per-rank runtime inside an engine: rank env, the process group, and the watcher.

The client calls these functions on each engine through ipyparallel's apply.
The watcher thread is what lets nbdist release a rank that is blocked inside a
gloo collective: a blocked collective holds the main thread in C++, so neither a
Python signal handler nor ``ProcessGroup.abort()`` (a no-op for gloo in torch
2.13) gets it out. The watcher wakes on the signal through ``signal.set_wakeup_fd``
(the C-level handler writes to it from any thread), and if the cell is still
running after a moment (``abort_after``) it shuts down the process group's own TCP
connections. gloo then raises "Connection closed by peer" on this rank and on
every peer, and the cell ends; the client rebuilds the group afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any

from .. import compat, wire
from ..launch import net
from . import (
    adapters,
    children,
    collectives,
    debug,
    exits,
    gpu,
    group,
    hosted,
    launched,
    preempt,
    released,
    schedulers,
    spawned,
)
from .state import CELL_END, STATE

_HOOKED: set[int] = set()  # shells whose cell events carry nbdist's hooks


def configure(
    *,
    rank: int,
    world_size: int,
    local_rank: int,
    local_world_size: int,
    master_addr: str,
    threads: int,
    report_dir: str,
    abort_after: float = 0.3,
    cpus: list[int] | None = None,
    node_rank: int = 0,
    interface: bool = False,
    max_restarts: int = 0,
    peer: bool = False,
) -> dict[str, Any]:
    """Give this engine its rank: env vars, thread count, cores, watcher, cell hooks.

    The rank looks like a worker torchrun launched (engine/launched.py): torchrun's variables
    and no interactive prompt, so libraries that decide how to launch (Lightning, Accelerate)
    use the world nbdist builds; ``adapters`` adjusts the ones that would start processes.

    gloo and NCCL listen on one interface (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME, unless
    set): with ``interface`` (ranks on several hosts) the one this engine reaches the
    controller through; without, loopback. Left to themselves they listen on the address the
    host name resolves to: on most GPU nodes, the node's address on the network.
    """
    launched.apply(
        launched.worker_env(
            rank=rank,
            world_size=world_size,
            local_rank=local_rank,
            local_world_size=local_world_size,
            node_rank=node_rank,
            master_addr=master_addr,
            threads=threads,
            max_restarts=max_restarts,
        )
    )
    launched.not_interactive()
    os.environ[wire.PEER_ENV] = "1" if peer else "0"  # parallel/peer.py keeps what a lost rank is rebuilt from
    name = net.interface_of(_address()) if interface else net.loopback_interface()
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if name and not os.environ.get(var):
            os.environ[var] = name
    import torch

    pin(cpus)  # before the process group starts gloo's threads, so they inherit it
    torch.set_num_threads(threads)
    STATE.update(rank=rank, world_size=world_size, report_dir=report_dir, abort_after=abort_after)
    STATE.main_ident = threading.main_thread().ident
    _install_watcher()
    _install_cell_hooks()
    debug.install()  # breakpoint() in a cell: pdb typed from the notebook
    collectives.install()
    hosted.install()  # torchrun-style init/destroy calls keep the world (%dist_run, pasted code)
    adapters.install()  # libraries that would start processes of their own run on the world instead
    spawned.install()  # so do mp.spawn and hand-started processes that join a process group
    schedulers.install(first=True)  # save_checkpoint finds the LR schedulers that hold its optimizer
    _preload_namespace()
    return {
        "rank": rank,
        "pid": os.getpid(),
        "host": socket.gethostname(),
    }


def launch_rank(names: list[str]) -> int | None:
    """This engine's rank in its launch (SLURM_PROCID, the MPI rank): the first of these env vars set."""
    for name in names:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def _address() -> str:
    """This host's address on the route to the controller (loopback when the controller is local)."""
    controller = os.environ.get("NBDIST_CONTROLLER_IP", "")
    if not controller or controller.startswith("127."):
        return net.LOOPBACK
    try:
        return net.route_source(controller)
    except OSError:
        return net.LOOPBACK


def local_info() -> dict[str, Any]:
    """pid, host, address and GPU count of this engine (before it has a rank)."""
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "addr": _address(),
        "gpu_ids": gpu.ids(),
        "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [],
    }


def pin(cpus: list[int] | None) -> None:
    """Keep this rank's main thread, and the threads it starts from now on (gloo's, the
    OpenMP pool), on these cores; None: every core this engine may use."""
    if not hasattr(os, "sched_setaffinity"):
        return
    if STATE.all_cpus is None:
        STATE.all_cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, cpus or STATE.all_cpus)


# --------------------------------------------------------------------------- cells


def _install_cell_hooks() -> None:
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover
        return
    shell = get_ipython()
    if shell is None or id(shell) in _HOOKED:
        return

    def pre(info: Any = None) -> None:
        STATE.busy_since = time.monotonic()
        STATE.cell += 1
        released.at_start()

    def post(result: Any = None) -> None:
        _deaf_until_replied()  # first: a release that comes while the cell's end is handled must not cut it short
        try:
            debug.cell_over()
            released.at_end(result)  # a cell run again after a recovery begins with the grad mode it began with
            exits.at_end(result)  # exit(0) in the cell is success; any exit is told to the notebook
            children.at_end(result)  # what the processes the cell started printed; one that failed fails the cell
            for fn in list(CELL_END):  # state.at_cell_end: before the cell counts as done (a background save ends)
                try:
                    fn()
                except Exception as exc:
                    print(f"nbdist: {exc}", file=sys.stderr, flush=True)
        finally:  # whatever failed above, the cell is over: a rank left busy and idle is ended as stuck
            STATE.busy_since = None
        from .metrics import cell_over

        cell_over()  # what the cell logged since the last batch; the next cell's input checked afresh
        if preempt.asked():  # this rank was sent SIGTERM; the cell is over, so it goes now
            preempt.leave()

    shell.events.register("pre_run_cell", pre)
    shell.events.register("post_run_cell", post)
    _deaf_after_the_code(shell)
    exits.install(shell)  # exit(), quit(), sys.exit() end the cell's code, not the rank
    compat.lean_iopub(getattr(shell, "kernel", None))  # 2 of a cell's 5 messages a rank, which nothing reads
    traceback_uninterrupted(shell)
    _HOOKED.add(id(shell))


def _deaf_until_replied() -> None:
    """From the cell's end until its reply is sent, SIGINT is ignored (ipykernel installs its own handler again for
    the next request, after this one's reply). A release that reached a rank just after its cell ended (the notebook
    had not had its reply yet) raised KeyboardInterrupt between the cell and the reply: the engine never sent the
    reply and sat idle while the notebook waited for it, until nbdist ended the rank ('its cell over, no reply
    sent'; 1 kill in about 50 at 8 ranks). It is the first thing the post-cell hook does. When it was the last, a
    release during the hook's own work (a rank whose collective broke as another rank died, and the release after
    that death) raised KeyboardInterrupt there; IPython catches it, so the hook stopped before marking the cell over
    and before ignoring SIGINT, and the next signal, before the reply, lost the reply: the living rank sat idle in
    the kernel's event loop, busy, until nbdist ended it ('(in its cell): selectors.py in select <- ...')."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: no handler of ours to change
        pass


def _deaf_after_the_code(shell: Any) -> None:
    """SIGINT is ignored from the moment the cell's code is over (its last statement ran, or it raised), until the
    reply is sent: not only from the post-cell hook on. Between the two IPython stores history and calls the
    post-execute callbacks, and a KeyboardInterrupt raised outside a callback leaves ``run_cell`` with no post-cell
    hook run and no reply sent (CI saw a living rank idle, busy and silent, ended as stuck: test_elastic,
    2026-12-02). A cell inside a cell (a magic that runs one) goes deaf only when the outer one is over."""
    run, depth = shell.run_ast_nodes, [0]

    async def run_ast_nodes(*args: Any, **kwargs: Any) -> Any:
        depth[0] += 1
        try:
            return await run(*args, **kwargs)
        finally:
            depth[0] -= 1
            if depth[0] == 0:
                _deaf_until_replied()

    shell.run_ast_nodes = run_ast_nodes


def traceback_uninterrupted(shell: Any) -> None:
    """A rank formats the traceback of a cell that nbdist released (a Ctrl-C, a recovery) with SIGINT ignored:
    a second release signal that came while it formatted (slow on a loaded machine) made IPython print a bare
    ``KeyboardInterrupt`` to stderr, shown under the cell as if the user had pressed Ctrl-C.

    The error of a lost group (``released.group_lost``) is formatted in IPython's plain mode until the cell is over
    (IPython 9 formats it a second time for its history): every frame's file, line and source line, without the
    context around each or its colours. The context mode costs a rank 0.2-0.4 s of CPU for its first traceback (pygments, stack_data
    reading torch's sources), twice; after a death every rank formats one at once: 1.4 s of the 3.4 s from a kill to
    progress at 8 ranks on 2 cores, for tracebacks a recovery never shows."""
    show, formatter = shell.showtraceback, shell.InteractiveTB
    restore: list[str] = []  # the mode to go back to when the cell is over

    def showtraceback(*args: Any, **kwargs: Any) -> Any:
        if not restore and released.group_lost(sys.exc_info()[1]):
            restore.append(formatter.mode)
            formatter.set_mode("Plain")
        try:
            before = signal.signal(signal.SIGINT, signal.SIG_IGN)
        except ValueError:  # not the main thread: nothing to hold off
            return show(*args, **kwargs)
        try:
            return show(*args, **kwargs)
        finally:
            signal.signal(signal.SIGINT, before)

    def cell_over(result: Any = None) -> None:
        if restore:
            formatter.set_mode(restore.pop())

    shell.showtraceback = showtraceback
    shell.events.register("post_run_cell", cell_over)


def _preload_namespace() -> None:
    """Every rank starts with torch and dist (torch.distributed) imported."""
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover
        return
    shell = get_ipython()
    if shell is not None:
        import torch
        import torch.distributed as dist

        shell.user_ns.setdefault("torch", torch)
        shell.user_ns.setdefault("dist", dist)


def _cell_label(filename: str) -> str | None:
    """'cell' for a notebook cell's code object, None for library code."""
    return "cell" if debug.in_cell(filename) else None


def where(frame: Any) -> dict[str, Any]:
    """Summarise a stack: innermost cell line and function, the cell's frames with their source
    lines, the last collective this rank entered (engine/collectives.py), and the stack's end."""
    stack = traceback.extract_stack(frame)
    cells = [e for e in stack if _cell_label(e.filename)]
    inner = stack[-1] if stack else None
    in_collective = any("torch/distributed" in e.filename.replace("\\", "/") for e in stack[-6:])
    return {
        "cell_line": cells[-1].lineno if cells else None,
        "function": inner.name if inner else None,
        "in_collective": in_collective,
        "cell_stack": [{"line": e.lineno, "function": e.name, "code": (e.line or "").strip()} for e in cells[-8:]],
        "collective": collectives.describe(),
        "stack": [f"{e.filename}:{e.lineno} in {e.name}" for e in stack[-12:]],
    }


def _main_thread_cpu() -> float | None:
    """Seconds of CPU the main thread (where cells run) has used, from /proc; None where there is no /proc. The main
    thread's id is the process's: ``threading.main_thread().native_id`` is the warm process's in a rank forked from
    it (Python 3.11 keeps it across fork), which made every rank's CPU unknown, and a rank working at one line for
    two looks after a release was ended as stuck."""
    try:
        with open(f"/proc/self/task/{os.getpid()}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    except (OSError, ValueError, IndexError):
        return None


def _write_report(reason: str) -> None:
    frame = compat.thread_frames().get(STATE.main_ident) if STATE.main_ident is not None else None
    busy = STATE.busy_since is not None
    report: dict[str, Any] = {
        "rank": STATE.rank,
        "reason": reason,
        "time": time.time(),
        "busy": busy,
        "debugging": STATE.debugging,
        "cpu_s": _main_thread_cpu(),  # a rank that works uses its core; one that waits does not (cells/release.py)
        "broke": STATE.broke,  # the watcher's last break of the group (cells/watch.py says it of a rank it ends)
        "broke_cpu_s": STATE.broke_cpu if STATE.broke is not None else None,  # its main thread's CPU at the break
    }
    if frame is not None and busy:
        report.update(where(frame))
    else:
        report["collective"] = collectives.describe()
        if frame is not None:  # out of the cell: where its reply is on the way (or what holds it)
            report["stack"] = where(frame)["stack"]
    try:
        report["gpu"] = gpu.info()  # {} in a rank that never touched CUDA (a gloo world)
    except Exception:  # a failing driver must not cost the report its cell line
        report["gpu"] = {}
    directory = STATE.report_dir
    if not directory:
        return
    wire.write_private(os.path.join(directory, wire.REPORT.format(rank=STATE.rank)), json.dumps(report))


# --------------------------------------------------------------------------- watcher


def _noop_handler(signum: int, frame: Any) -> None:
    return None


def _install_watcher() -> None:
    if STATE.watcher is not None:
        return
    rsock, wsock = socket.socketpair()
    rsock.setblocking(True)
    wsock.setblocking(False)
    signal.signal(signal.SIGUSR1, _noop_handler)
    signal.signal(signal.SIGUSR2, preempt.asking_to_resize)  # %dist_grow while a loop runs
    previous = signal.set_wakeup_fd(wsock.fileno(), warn_on_full_buffer=False)
    thread = threading.Thread(target=_watch, args=(rsock, wsock, previous), name="nbdist-watcher", daemon=True)
    STATE.watcher = thread
    thread.start()


def _watch(rsock: socket.socket, wsock: socket.socket, previous: int) -> None:
    while True:
        data = rsock.recv(64)
        if not data:
            return
        if previous not in (-1, None):
            try:
                os.write(previous, data)  # keep whoever had the wakeup fd before us informed
            except OSError:
                pass
        signums = set(data)
        try:
            if signal.SIGUSR1 in signums:
                _write_report("report")
            if signal.SIGINT in signums and STATE.busy_since is not None:
                cell = STATE.cell
                deadline = time.monotonic() + (0.0 if released.break_now() else STATE.abort_after)
                while time.monotonic() < deadline:
                    if STATE.busy_since is None or STATE.cell != cell:
                        break
                    time.sleep(0.02)
                else:
                    _write_report("interrupt")
                    if STATE.pg_fds or STATE.backend == "nccl":
                        group.abort_world()
                        STATE.broke_cpu = _main_thread_cpu()  # what it used since tells a wait from work
        except Exception:  # the watcher must survive anything
            traceback.print_exc(file=sys.__stderr__)
