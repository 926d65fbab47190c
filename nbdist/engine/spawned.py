"""Code that starts its own processes runs on the world: ``mp.spawn`` and hand-started ``mp.Process``.

PyTorch's tutorials start their workers themselves: ``mp.spawn(fn, args=(world_size,),
nprocs=world_size)`` runs ``fn(i, *args)`` in ``nprocs`` new processes, each of which joins a process
group as rank ``i``; "Writing Distributed Applications" starts ``mp.Process(target=init_process,
args=(rank, size, run))`` in a loop. Pasted into a cell (or run by ``%dist_run``) every rank would
start them again, and a new process cannot even find a function defined in a cell by its name. On a
rank whose world is up (``install``):

- ``torch.multiprocessing.spawn`` / ``start_processes`` with ``nprocs`` equal to the world's size run
  ``fn(RANK, *args)`` here, once (on several hosts, ``nprocs`` equal to the ranks of a host runs
  ``fn(LOCAL_RANK, *args)``); ``init_process_group`` inside keeps the world (hosted.py); an exception
  is ``fn``'s own, with its traceback; an exit of status 0 is a child's normal end, another status is
  torch's ``ProcessExitedException``. The environment ``fn`` changes (``MASTER_PORT``) is put back, as
  a child's would vanish with it. Another ``nprocs``, ``join=False``, a start method the platform
  lacks, or a ``fn`` that a new process could not unpickle fail at once in one line naming the fix;
- ``Process.start()`` of a target defined in the cell or script (``__module__ == "__main__"``) whose
  code calls ``init_process_group`` (itself or through the cell's functions and arguments it gets):
  the k-th such process a cell starts is rank k's; this rank runs its own in place (``start()`` returns
  when it is done), the others are done elsewhere (``exitcode`` 0, ``join()`` returns at once);
- any other process a cell's own code starts is a real child (children.py: its output is shown, and
  one that fails fails the cell); a DataLoader's workers are the loader's, untouched;
- ``set_start_method`` checks the method and leaves the rank's own as it is: the processes a pasted
  script starts run on the world instead, and the rank's later DataLoader workers keep working.

With the world down the originals run.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any

from . import children
from .adapters import world_up
from .state import STATE

ORIGINAL: dict[str, Any] = {}
@dataclass(slots=True)
class _Started:
    """Processes joining the world started in this cell (the k-th is rank k's)."""

    cell: int = -1
    count: int = 0


_STARTED = _Started()


def install() -> None:
    """Replace spawn, start_processes, set_start_method and Process.start (once per process)."""
    if ORIGINAL:
        return
    import torch.multiprocessing as tmp

    spawn_module = sys.modules["torch.multiprocessing.spawn"]  # the module (its package's `spawn` is the function)

    ORIGINAL.update(
        start_processes=spawn_module.start_processes,
        set_start_method=multiprocessing.set_start_method,
        start=BaseProcess.start,
    )
    for module in (tmp, spawn_module):
        setattr(module, "spawn", spawn)  # noqa: B010 - the module's own name
        setattr(module, "start_processes", start_processes)  # noqa: B010
    for module in (multiprocessing, tmp):
        setattr(module, "set_start_method", set_start_method)  # noqa: B010
    BaseProcess.start = _start  # type: ignore[method-assign]
    children.install()


# --------------------------------------------------------------------------- mp.spawn


def spawn(
    fn: Callable[..., Any],
    args: tuple = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str = "spawn",
) -> Any:
    """torch.multiprocessing.spawn: on the world, ``fn(rank, *args)`` runs in this rank."""
    __tracebackhide__ = True  # a traceback goes from the cell to its own code
    return start_processes(fn, args, nprocs, join, daemon, start_method=start_method, _name="spawn")


def start_processes(
    fn: Callable[..., Any],
    args: tuple = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str = "spawn",
    _name: str = "start_processes",
) -> Any:
    """torch.multiprocessing.start_processes: on the world, ``fn(rank, *args)`` runs in this rank."""
    __tracebackhide__ = True  # a traceback goes from the cell to its own code
    if not world_up():
        return ORIGINAL["start_processes"](fn, args, nprocs, join, daemon, start_method=start_method)
    call = f"mp.{_name}({_fn_name(fn)}, nprocs={nprocs!r})"
    index = _index_for(nprocs, call)
    _check_method(start_method, call)
    if not join:
        raise ValueError(
            f"{call} with join=False hands back processes to join later, but on nbdist's world {_fn_name(fn)} runs "
            f"in each rank itself: drop join=False (the call returns when {_fn_name(fn)} is done on this rank)."
        )
    if start_method != "fork":
        _check_picklable(fn, call)
    try:
        _in_place(fn, (index, *args))
    except SystemExit as exc:
        from torch.multiprocessing import ProcessExitedException

        from .exits import status_of

        status = status_of(exc.code)
        if status:
            raise ProcessExitedException(
                f"process {index} terminated with exit code {status}", index, os.getpid(), status
            ) from None
    return None


def _index_for(nprocs: Any, call: str) -> int:
    """This rank's process index among ``nprocs``: RANK for the world's size, LOCAL_RANK for a host's."""
    __tracebackhide__ = True  # a traceback goes from the cell to its own code
    rank, world = STATE.placed()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if nprocs == world:
        return rank
    if nprocs == local:
        return int(os.environ.get("LOCAL_RANK", "0"))
    hosts = f" ({local} on each host)" if local != world else ""
    raise ValueError(
        f"{call} would start {nprocs} processes on each rank, but this world has {world} ranks{hosts} and runs "
        f"the code once on each: pass nprocs={world} (int(os.environ['WORLD_SIZE'])), or start {nprocs} ranks with "
        f"%dist_start -n {nprocs}."
    )


def _check_method(method: Any, call: str) -> None:
    """A start method this platform lacks is refused, as torch would refuse it."""
    __tracebackhide__ = True  # a traceback goes from the cell to its own code
    methods = multiprocessing.get_all_start_methods()
    if method not in methods:
        raise ValueError(
            f"{call}: start_method={method!r} is not one this platform has ({', '.join(map(repr, methods))}); "
            "pass one of those (on nbdist's world the function runs in each rank, whichever you pass)."
        )


def _check_picklable(fn: Any, call: str) -> None:
    """A new process gets ``fn`` by its qualified name: a lambda or a nested function it cannot find."""
    __tracebackhide__ = True  # a traceback goes from the cell to its own code
    qualname = getattr(fn, "__qualname__", "")
    if "<lambda>" in qualname or "<locals>" in qualname:
        raise ValueError(
            f"{call}: {qualname} cannot be pickled, so a new process could not run it (python prog.py fails on it "
            "too); define it with def at the top level of the cell or script, or pass start_method='fork'."
        )


def _in_place(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any] | None = None) -> None:
    """``fn(*args, **kwargs)`` here, as a child would run it: what it changes in os.environ is put back after."""
    __tracebackhide__ = True  # a traceback goes from the cell to its own code
    saved = dict(os.environ)
    try:
        fn(*args, **(kwargs or {}))
    finally:
        if dict(os.environ) != saved:
            os.environ.clear()
            os.environ.update(saved)


def _fn_name(fn: Any) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


# --------------------------------------------------------------------------- set_start_method


def set_start_method(method: Any, force: bool = False) -> None:
    """multiprocessing.set_start_method: on the world, checked and left as it is (see the module's doc)."""
    __tracebackhide__ = True  # a traceback goes from the cell to its own code
    if not world_up():
        return ORIGINAL["set_start_method"](method, force=force)
    if method is not None:
        _check_method(method, f"set_start_method({method!r})")
    return None


# --------------------------------------------------------------------------- Process.start


class _Ended:
    """Stands for a process whose work ran in a rank (this one, or the rank it was for): ended, with a status."""

    sentinel = None

    def __init__(self, returncode: int) -> None:
        self.returncode = returncode
        self.pid = os.getpid()

    def poll(self, flag: int = 0) -> int:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        return self.returncode

    def terminate(self) -> None:
        return None

    kill = terminate

    def close(self) -> None:
        return None


def _start(self: BaseProcess) -> None:
    """Process.start: a target that joins the world runs on it (rank k's is the k-th); others start as usual."""
    __tracebackhide__ = True  # a traceback goes from the cell to its own code
    target: Any = getattr(self, "_target", None)
    if not world_up() or not _from_cell(target) or not _joins_world(target, getattr(self, "_args", ())):
        if _from_cell(target):
            with _main_for(self, target):
                children.start(self, ORIGINAL["start"])
        else:
            ORIGINAL["start"](self)
        return
    if _STARTED.cell != STATE.cell:
        _STARTED.cell, _STARTED.count = STATE.cell, 0
    k, (rank, world) = _STARTED.count, STATE.placed()
    _STARTED.count += 1
    name = _fn_name(target)
    if k >= world:
        raise ValueError(
            f"this cell starts a process #{k + 1} running {name}, which joins a process group, but the world has "
            f"{world} ranks: start one per rank (the k-th is rank k's), or start {k + 1} ranks with %dist_start -n {k + 1}."
        )
    status = 0
    if k == rank:
        try:
            _in_place(target, getattr(self, "_args", ()), getattr(self, "_kwargs", {}))
        except SystemExit as exc:
            from .exits import status_of

            status = status_of(exc.code)
    self._popen = _Ended(status)  # type: ignore[attr-defined]
    self._sentinel = None  # type: ignore[attr-defined]
    if status:
        children.ended(self)


@contextlib.contextmanager
def _main_for(process: BaseProcess, target: Any) -> Iterator[None]:
    """A process started with spawn or forkserver (Python 3.14's default) finds a target of the main module by
    importing that module anew, by its file: a %dist_run script's is its file, as under ``python prog.py``
    (this rank's main module is the engine's while it starts); a cell is no file, refused in one line."""
    __tracebackhide__ = True  # a traceback goes from the cell to its own code
    method = getattr(type(process), "_start_method", None) or multiprocessing.get_start_method()
    if method == "fork":
        yield
        return
    path = getattr(target, "__globals__", {}).get("__file__")
    if not isinstance(path, str) or not os.path.isfile(path):
        name = _fn_name(target)
        raise ValueError(
            f"Process(target={name}) starts with {method!r}: the new process finds {name} by importing the main "
            f"module, and a notebook cell is no module it can import (python prog.py works: it imports prog.py). "
            f"Put {name} in a .py file beside the notebook and import it from there, or use "
            "multiprocessing.get_context('fork')."
        )
    main = types.ModuleType("__main__")  # what pickle looks the target up in, and the child's preparation reads
    main.__dict__.update(target.__globals__)
    main.__file__, main.__spec__ = path, None
    saved = sys.modules["__main__"]
    sys.modules["__main__"] = main
    try:
        yield
    finally:
        sys.modules["__main__"] = saved


def _from_cell(target: Any) -> bool:
    """Whether ``target`` is the cell's or the %dist_run script's own code (not a library's)."""
    return callable(target) and getattr(target, "__module__", None) == "__main__"


def _joins_world(target: Any, args: tuple, depth: int = 3) -> bool:
    """Whether ``target``'s code calls init_process_group, itself or through the cell's functions it calls
    or is given (looked for by name in its code, ``depth`` calls deep)."""
    seen: set[int] = set()
    todo = [(target, depth), *((a, depth - 1) for a in args if _from_cell(a))]
    while todo:
        fn, left = todo.pop()
        code = getattr(fn, "__code__", None)
        if code is None or id(code) in seen:
            continue
        seen.add(id(code))
        names = _names(code)
        if "init_process_group" in names:
            return True
        if left > 0:
            found = getattr(fn, "__globals__", {})
            todo += [(found[n], left - 1) for n in names if _from_cell(found.get(n))]
    return False


def _names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names
