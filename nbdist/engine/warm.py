"""The warm process (a fork server): import torch and ipyparallel's engine once, fork engines from it.

Started by ``nbdist.launch.pool`` while nobody waits for it (right after ``%load_ext nbdist``).
Importing torch takes about 1 s of one core; two engines importing it at once on a
2-core laptop take twice that, next to the controller's own start. Here it happens once,
and every engine is a ``fork()`` of a process that already has it: copy-on-write, a few
milliseconds.

Protocol (one line each way): the pool writes a JSON job (the arguments, environment,
working directory and log file the launcher would have given a fresh
``python -m nbdist.engine``); this process forks, answers the child's pid, and the child
becomes that engine. End of input (the pool closing the pipe, or the kernel dying) ends
this process; engines already forked keep running, watching the kernel themselves.

With ``--lean`` (``%dist_start --start forkserver``: Python's forkserver model) it imports only what every engine
needs (``preload``) and does no idle work: it is begun for one world and ends with it.

Forking is safe because nothing here starts a thread before ``fork()``: torch's OpenMP
pool, gloo's threads and ipyparallel's IO threads all start in the child. Each fork checks that first
(``unsafe()``: no thread besides the main one, CUDA not initialised) and refuses with the reason otherwise. The child
gets a new session (no terminal Ctrl-C, like ipyparallel's engines), default signal
handlers, its own random seeds (numpy's legacy global RNG would otherwise be the same
on every rank), and watches the kernel.
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator

from nbdist.engine.quiet import Quiet


def _become(job: dict) -> None:
    """Turn this (forked) process into the engine the job describes: output, cwd, env, argv."""
    out = os.open(job["output"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    args = list(job["args"])
    if not any(a.startswith(("--work-dir", "--BaseParallelApplication.work_dir")) for a in args):
        # ipyparallel's default is the cwd at import time, which was before the job came
        args.append(f"--work-dir={job['cwd']}")
    sys.argv = [sys.argv[0], *args]
    if sys.path and sys.path[0] != job["cwd"]:
        sys.path[0] = job["cwd"]  # what `python -m` started in cwd would have


def unsafe() -> str:
    """Why a fork from this process would not be safe now, in words ('' when it is): CUDA initialised in it (a
    forked child cannot use CUDA), or a thread besides the main one (a fork copies only the calling thread, and a
    lock another thread held stays locked in the child: the child hangs, or dies, later). This process starts no
    thread and never touches CUDA; something that runs at its start (a sitecustomize, a .pth file) can."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialised in it (a forked rank could not use CUDA)"
    driver = accelerator_driver()
    if driver:
        return (
            f"an accelerator's driver is loaded in it ({driver}: something asked the device, such as "
            "torch.get_device_module().device_count(), though torch.cuda.is_initialized() says no), and a forked "
            "rank could not use the device"
        )
    try:
        tasks = [t for t in os.listdir("/proc/self/task") if int(t) != os.getpid()]
    except OSError:  # no /proc: the threads Python knows of
        import threading

        names = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    else:
        names = [_thread_name(t) for t in tasks]
    if names:
        return (
            f"{len(names)} thread(s) besides its main one run in it ({', '.join(sorted(set(names)))}): a fork copies "
            "none of them, and a lock one holds stays locked in the forked rank"
        )
    return ""


# NVIDIA's driver. ROCm's and Intel's are not looked for: whether their torch builds load them on import was not
# seen here.
DRIVERS = ("libcuda.so",)


def accelerator_driver(maps: str = "/proc/self/maps") -> str:
    """The file name of an accelerator driver library mapped into this process ('' when none). torch's wheels
    load none of these when imported; a driver is loaded by the first call that asks the device (CUDA's driver
    initialises as it loads), and a child forked after that cannot use the device: it dies with 'CUDA error:
    initialization error' (pytorch/pytorch#190708)."""
    try:
        with open(maps) as fh:
            mapped = {line.rsplit("/", 1)[-1].strip() for line in fh if ".so" in line}
    except OSError:
        return ""
    return next((name for name in sorted(mapped) if name.startswith(DRIVERS)), "")


def _thread_name(task: str) -> str:
    try:
        with open(f"/proc/self/task/{task}/comm") as fh:
            return fh.read().strip()
    except OSError:
        return task


def _job_waiting(timeout: float = 0.0) -> bool:
    return bool(select.select([sys.stdin.buffer], [], [], timeout)[0])


def cell_helpers() -> None:
    """Import what a replayed setup cell builds with: the cell helpers and ``torch._dynamo`` (``_idle_work`` says
    why). Also run on a spare engine (world/spare.py), which may have been forked before this process was idle."""
    import torch._dynamo  # noqa: F401 - DDP's constructor imports it: 0.44 s of a restarted rank's first apply_ddp

    import nbdist.parallel  # noqa: F401


# What a replayed setup cell imports, in pieces (after torch: nbdist.parallel 0.86 s in all, most of it DTensor's, for
# DCP checkpoints; torch._dynamo 0.6 s; numba 0.2 s). Each is a module its users import first: a submodule imported
# out of its package's order can fail halfway (a circular import) and leave a module without its attributes in every
# fork (torch's AOT autograd wrappers did: DDP's constructor then failed on the ranks forked after).
_PIECES = (
    "sympy",
    "torch.fx.experimental.symbolic_shapes",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "nbdist.parallel",
    "torch._dynamo",  # DDP's constructor imports it: 0.44 s of a restarted rank's first apply_ddp
    "numba",
)


def _idle_work() -> Iterator[None]:
    """What this process does while no engine waits, one short step per ``next()``; the server
    loop forks any job that comes between two steps, so a start never waits behind this.

    The cell helpers (``nbdist.parallel``: DDP, FSDP, DCP checkpoints; 0.86 s after torch) are
    imported first, then ``torch._dynamo``, which DistributedDataParallel's constructor imports (0.56 s): a rank
    restarted by recovery replays setup cells that import and build them, and would pay it while training waits
    (the whole world waits in DDP's first broadcast for it). Then numba: it sets up its typing registries on the
    first call of any jitted function and loads each kernel from its cache on that kernel's
    first call (about 0.35 s in all, with every kernel cached), one kernel per step. Forks made
    after this inherit the loaded kernels. With the cache empty or stale (a fresh install, an
    upgrade), compiling every kernel takes ~16 s of a core: a niced child process fills the
    cache instead, and this process loads the kernels once it is done. Nothing here starts a
    thread (forking stays safe). Each step waits for a free core (engine/quiet.py), so the big imports go in
    pieces of at most about 0.6 s (``_PIECES``): a step that began just before a cell shares a core with one of its
    ranks that long."""
    import importlib

    for name in _PIECES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError:  # not in this torch: the next piece
            pass
        except Exception:  # only an optimisation; what failed halfway is not built on (tests/unit/test_fork_check.py)
            return
        yield
    from nbdist.compression import kernels

    if not kernels.cached():
        compiler = _compile_in_background()
        while compiler.poll() is None:
            yield
        if not kernels.cached():  # the cache cannot be written: ranks compile what they use
            return
    for _, step in kernels.warm_up_steps():
        try:
            step()
        except Exception:  # only an optimisation; the engine reports real errors when used
            return
        yield
    gc.freeze()  # what numba built is shared by the forks too


_COMPILER: list[subprocess.Popen] = []
_DONE = object()


def _compile_in_background() -> subprocess.Popen:
    """A child that compiles every kernel into numba's cache, at low priority; it ends with this process."""
    code = (
        "import os; os.nice(10)\n"
        "from nbdist.engine.parentwatch import watch_parent; watch_parent(interval=0.2)\n"
        "from nbdist.engine.warm import compile_when_quiet; compile_when_quiet()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        env={**os.environ, "NBDIST_PARENT_PID": str(os.getpid())},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _COMPILER.append(proc)
    return proc


def compile_when_quiet() -> None:
    """In the compiler child: compile each kernel into numba's cache, one at a time, each once a core is free
    (engine/quiet.py). Its nice does not rank it below the ranks: each engine is a session of its own, and with the
    kernel's autogroups the scheduler weighs sessions before it weighs a session's processes by their nice."""
    import time

    from nbdist.compression import kernels

    quiet = Quiet()
    for _, step in kernels.warm_up_steps():
        while not quiet.free():
            time.sleep(0.1)
        try:
            step()
        finally:
            quiet.release()


def _reap() -> None:
    """Collect the engines that ended (they are this process's children until it exits)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _child(job: dict) -> None:
    """In the forked child: become an ordinary engine; never returns into the server loop."""
    os.setsid()
    # The signal dispositions a freshly started Python has (what a cold engine gets): SIGTERM and SIGCHLD as the
    # OS sets them, SIGINT raising KeyboardInterrupt, and SIGPIPE ignored, so that writing to a socket whose peer
    # died (gloo's pairs, the store rank 0 hosts, when another rank is killed) raises BrokenPipeError instead of
    # ending this rank without a word.
    for sig in (signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()  # fresh entropy, as a freshly started process would have
    _become(job)
    from nbdist.engine.__main__ import run_engine
    from nbdist.engine.parentwatch import ENV, watch_process

    kernel = os.environ.get(ENV, "")
    if kernel.isdigit():
        watch_process(int(kernel))  # the kernel (the job's NBDIST_PARENT_PID), not this server
    gc.enable()
    run_engine()


def main() -> None:
    from nbdist.engine.__main__ import preload

    gc.disable()  # no collection may touch (and so copy) the imported heap before it is frozen
    preload()
    lean = "--lean" in sys.argv[1:]
    # Everything imported so far is the same in every engine: out of the collector's sight, so
    # that no engine's collections copy those pages (copy-on-write stays shared, and an engine's
    # exit does not walk a heap of torch objects for seconds).
    gc.freeze()
    # Reap an engine the moment it ends: until then it is a zombie, which the launcher waiting
    # for its pid (psutil, from the kernel) takes for a running process.
    signal.signal(signal.SIGCHLD, lambda signum, frame: _reap())
    pending = b""  # read from the pipe's fd directly: a buffered reader could hide a second job
    idle: Iterator[None] | None = None if lean else _idle_work()
    quiet = Quiet()
    while True:
        while b"\n" not in pending:
            ready = _job_waiting(timeout=0.5 if idle is None else 0.1)
            _reap()
            if not ready:
                if idle is not None and quiet.free():  # no engine waits: a step, the host's turn held
                    try:
                        idle = None if next(idle, _DONE) is _DONE else idle
                    finally:
                        quiet.release()  # before any fork: a child would hold the turn for its whole life
                continue
            chunk = os.read(0, 1 << 16)
            if not chunk:  # the pool closed the pipe, or the kernel is gone
                for proc in _COMPILER:
                    proc.kill()
                return
            pending += chunk
        line, pending = pending.split(b"\n", 1)
        if not line.strip():
            continue
        try:
            job = json.loads(line)
        except ValueError:
            os.write(1, b"-1\n")  # the pool starts that engine cold
            continue
        reason = unsafe()
        if reason:  # checked before every fork: the pool starts that engine cold, and says why
            os.write(1, f"-1 {reason}\n".encode())
            continue
        pid = os.fork()
        if pid == 0:
            _child(job)  # never returns: the engine ends the process
        os.write(1, f"{pid}\n".encode())


if __name__ == "__main__":
    main()
