"""The processes a cell's own code starts: their output reaches the notebook, and one that fails fails the cell.

A process forked from a rank inherits the rank's kernel streams, which cannot send from another process,
so whatever it printed (its traceback too) was lost, and the cell said ok however it ended. A process
started by a cell's own code (``Process(target=f)`` with ``f`` defined in the cell or the script,
engine/spawned.py) writes its stdout and stderr to a file of its own in the world's 0700 directory
instead (``start``); at the end of each cell (``at_end``) every such process that has ended shows what
it printed, under a line naming it, and the first that ended with a non-zero status fails the cell,
naming it and its last line. One still running is looked at again at the end of the next cell.

Any process forked from a rank (these, and a DataLoader's workers) knows it is not the rank
(``STATE.child_of``): engine/hosted.py refuses it the world, in one line, instead of letting it
use the rank's sockets or hang waiting for peers. A rank is never refused a fork (its DataLoader workers need
one, and it always runs threads: ipykernel's, gloo's); a child forked after the rank loaded the GPU's driver by a
path torch does not mark (pytorch/pytorch#190708) is marked as torch marks the children of a rank that
initialised CUDA, so using CUDA there raises torch's own error naming the 'spawn' start method instead of dying
with 'CUDA error: initialization error' (``_gpu_driver_in_parent``).
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any

from .. import compat
from .state import STATE

_CHILDREN: list[tuple[BaseProcess, str | None]] = []  # started by cells' code, until their end was shown
_CAPTURE: dict[str, str | None] = {"path": None}  # where the process being forked now writes its output
_INSTALLED: list[bool] = []


def install() -> None:
    """Mark every process forked from this rank as a child (once per process)."""
    if not _INSTALLED:
        os.register_at_fork(after_in_child=_in_child)
        _INSTALLED.append(True)


def _in_child() -> None:
    if STATE.child_of is None:
        STATE.child_of = (STATE.rank, os.getppid())
    _gpu_driver_in_parent()
    path = _CAPTURE["path"]
    if path:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the child's, for its life
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115


def _gpu_driver_in_parent() -> None:
    """Mark this child as a bad fork for CUDA when the rank it was forked from had the GPU's driver loaded."""
    torch = sys.modules.get("torch")
    if torch is None or torch.cuda.is_initialized():  # torch marked it itself
        return
    from .warm import accelerator_driver

    if accelerator_driver():  # the mapping is inherited: it was the parent's
        compat.cuda_bad_fork(torch)


def start(process: BaseProcess, original: Callable[[BaseProcess], None]) -> None:
    """Start a cell's own process with ``original`` (multiprocessing's start), its output to a file when forked."""
    directory = STATE.report_dir or tempfile.gettempdir()
    fd, path = tempfile.mkstemp(prefix="child-", suffix=".out", dir=directory)  # 0600
    os.close(fd)
    _CAPTURE["path"] = path
    try:
        original(process)
    finally:
        _CAPTURE["path"] = None
    _CHILDREN.append((process, path))


def ended(process: BaseProcess) -> None:
    """A process that already ended (its work ran in the rank) and whose status the cell's end must see."""
    _CHILDREN.append((process, None))


def at_end(result: Any) -> None:
    """At the end of a cell: show what each ended child printed; the first that failed fails the cell."""
    done = [(p, path) for p, path in _CHILDREN if p.exitcode is not None]
    _CHILDREN[:] = [(p, path) for p, path in _CHILDREN if p.exitcode is None]
    failed: list[tuple[BaseProcess, str]] = []
    for p, path in done:
        text = _read(path)
        if text.strip():
            print(f"nbdist: {p.name} (pid {p.pid}), started by this rank's cell, printed:\n{text.rstrip()}", flush=True)
        if p.exitcode:
            failed.append((p, text))
    if not failed or result is None or result.error_in_exec is not None:
        return
    p, text = failed[0]
    code = int(p.exitcode or 0)
    why = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
    last = next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip()), "")
    more = f" ({len(failed) - 1} more failed)" if len(failed) > 1 else ""
    hint = (
        f"; a process started with the {type(p).__name__.removesuffix('Process').lower()} method cannot find "
        "code defined in a cell: use multiprocessing.get_context('fork')"
        if type(p).__name__ in ("SpawnProcess", "ForkServerProcess") and not text
        else ""
    )
    exc = ChildProcessError(
        f"the process {p.name} (pid {p.pid}) that this cell started {why}{more}" + (f": {last}" if last else "") + hint
    )
    result.error_in_exec = exc
    from IPython import get_ipython

    compat.show_error(get_ipython(), exc)


def _read(path: str | None) -> str:
    if path is None:
        return ""
    try:
        with open(path, errors="replace") as fh:
            return fh.read()
    except OSError:
        return ""
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
