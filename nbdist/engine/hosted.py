"""torchrun-style code inside the world nbdist built: one process group per engine, kept up.

A script written for torchrun, or tutorial code pasted into a ``%%distributed`` cell, calls
``dist.init_process_group(...)`` first and ``dist.destroy_process_group()`` last. In a
rank whose world is already up, torch would refuse the first ("trying to initialize the
default process group twice!") and the second would leave the next cell without a world.
``install()`` replaces both in ``torch.distributed`` (and ``distributed_c10d``):

- ``init_process_group`` with a compatible request (no backend or the world's own, the
  world's rank and size or none) keeps the world and says so in one line on rank 0; an
  incompatible one (nccl asked on CPU ranks, another world size) raises ``ValueError``
  naming the values and the fix. With no world up it is torch's own call;
- ``destroy_process_group()`` of the default group leaves it up for the next cell (one line
  on rank 0); a subgroup's is torch's own call.

nbdist's own joining and leaving (world.py) go through ``init_world`` / ``destroy_world``,
torch's originals. ``run_script`` runs a script's source as ``__main__`` with ``sys.argv`` (``%dist_run``).
"""

from __future__ import annotations

import linecache
import os
import sys
from typing import Any

from .state import STATE

ORIGINAL: dict[str, Any] = {}


def install() -> None:
    """Replace init_process_group and destroy_process_group (once per process)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if ORIGINAL:
        return
    ORIGINAL.update(init=c10d.init_process_group, destroy=c10d.destroy_process_group)
    for module in (dist, c10d):
        setattr(module, "init_process_group", init_process_group)  # noqa: B010 - the module's own name
        setattr(module, "destroy_process_group", destroy_process_group)  # noqa: B010


def init_world(*args: Any, **kwargs: Any) -> None:
    """torch's own init_process_group (nbdist forming the world)."""
    import torch.distributed as dist

    ORIGINAL.get("init", dist.init_process_group)(*args, **kwargs)


def destroy_world() -> None:
    """torch's own destroy_process_group of the default group (nbdist leaving the world)."""
    import torch.distributed as dist

    ORIGINAL.get("destroy", dist.destroy_process_group)()


def init_process_group(backend: Any = None, init_method: str | None = None, *args: Any, **kwargs: Any) -> None:
    """Keep the world nbdist built when the request fits it; otherwise say what does not fit."""
    import torch.distributed as dist

    __tracebackhide__ = True  # the cell's call, then the error

    if STATE.child_of is not None:
        rank, pid = STATE.child_of
        raise RuntimeError(
            f"init_process_group in a process that rank {rank}'s cell started (pid {os.getpid()}, a child of the "
            f"rank's pid {pid}): the rank is already in the world, and its children cannot join it. Call the "
            "process's target in the cell instead, with this rank: target(int(os.environ['RANK']), "
            "int(os.environ['WORLD_SIZE']), ...)."
        )
    if not dist.is_initialized():
        return ORIGINAL["init"](backend, init_method, *args, **kwargs)
    names = ("timeout", "world_size", "rank", "store", "group_name", "pg_options", "device_id")
    given = {**dict(zip(names, args, strict=False)), **kwargs}
    torch_checks(backend, init_method, given)
    rank, size, current = dist.get_rank(), dist.get_world_size(), str(dist.get_backend())
    call = _call_text(backend, init_method, given)
    check_backend(backend, call, "the backend argument")
    for key, value in (("world_size", size), ("rank", rank)):
        asked = given.get(key, -1)
        if asked not in (-1, None) and int(asked) != value:
            raise ValueError(
                f"{call} asks for {key}={asked}, but this rank is rank {rank} of a world of {size}. Read them "
                f"from the environment (RANK, WORLD_SIZE are set on every rank, as torchrun sets them), or start "
                f"the world you want with %dist_start -n {given.get('world_size', size)}."
            )
    if rank == 0:
        ignored = [k for k in ("timeout", "store", "pg_options", "group_name") if given.get(k) not in (None, "")]
        extra = f"; its {', '.join(ignored)} not applied" if ignored else ""
        print(f"nbdist: {call} kept the world nbdist built ({size} ranks, {current}){extra}", flush=True)
    return None


def torch_checks(backend: Any, init_method: str | None, given: dict[str, Any]) -> None:
    """Refuse what torch's init_process_group refuses before it would form a world, with torch's own
    message, in torch's order: a call that fails under torchrun fails in a cell too."""
    import datetime

    import torch
    from torch.distributed import Backend
    from torch.distributed.distributed_c10d import BackendConfig

    __tracebackhide__ = True  # the cell's call, then the error
    store, device = given.get("store"), given.get("device_id")
    if store is not None and init_method is not None:
        raise AssertionError("Cannot specify both init_method and store.")
    if store is not None:
        if not given.get("world_size", -1) > 0:
            raise AssertionError("world_size must be positive if using store")
        if not given.get("rank", -1) >= 0:
            raise AssertionError("rank must be non-negative if using store")
    acc = torch.accelerator.current_accelerator()
    if isinstance(device, int):
        if acc is None:
            raise ValueError(
                "device_id is an int, but no accelerator support is found from the current compilation. "
                "Please use a different compiled version that supports your accelerator."
            )
        device = torch.device(acc.type, device)
    if device is not None and device.type != "cpu":
        if acc is None or device.type != acc.type:
            raise ValueError(
                f"device_id {device} does not match the current compilation's accelerator support: {acc}. "
                "Please use a different compiled version that supports your accelerator."
            )
        if device.index is None:
            raise ValueError("Please use a device_id with index.")
        if device.index >= torch.accelerator.device_count():
            raise ValueError(
                f"device_id {device} is out of range. Please use a device index less than "
                f"the number of accelerators available: {torch.accelerator.device_count()}."
            )
    if backend is None and device is not None:
        backend = Backend.default_device_backend_map.get(device.type)
    name = Backend("undefined" if backend is None else backend)
    timeout = given.get("timeout")
    if timeout is not None and not isinstance(timeout, datetime.timedelta):
        raise TypeError(f"Expected timeout argument to be of type datetime.timedelta, got {timeout}")
    # the rest torch checks after the rendezvous, as it forms the group
    if device is not None and (device.index is None or device.type == "cpu"):
        raise ValueError("init_process_group device_id parameter must be an accelerator with an index")
    BackendConfig(name)
    if "," not in str(name) and ":" not in str(name) and name not in Backend.backend_type_map:
        raise AssertionError(f"Unknown backend type {name}")


def check_backend(backend: Any, call: str, setting: str) -> None:
    """Raise ValueError when ``call`` (code that asked for ``backend`` through ``setting``) wants a
    backend the world nbdist built does not run; the message names both and the fix."""
    import torch.distributed as dist

    current = str(dist.get_backend())
    want = _backends(backend)
    if not want - _backends(current):
        return
    asked = "/".join(sorted(want))
    hint = (
        "CPU ranks: start GPU ranks with %dist_start --backend nccl"
        if "nccl" in want and "nccl" not in _backends(current)
        else "restart with %dist_start --backend " + asked
    )
    raise ValueError(
        f"{call} asks for {asked}, but this world runs {current} (rank {dist.get_rank()} of "
        f"{dist.get_world_size()}, built by %dist_start). Drop {setting} (or pass {current!r}) to use it, or for "
        f"{asked} on {hint}."
    )


def destroy_process_group(group: Any = None) -> None:
    """Leave the default group up for the next cell; destroy a subgroup as torch does."""
    import torch.distributed as dist

    if group is not None and group is not dist.GroupMember.WORLD:
        return ORIGINAL["destroy"](group)
    if dist.is_initialized() and dist.get_rank() == 0:
        print("nbdist: destroy_process_group() left the world up for the next cell (%dist_stop ends it)", flush=True)
    return None


def _backends(backend: Any) -> set[str]:
    """'gloo' -> {'gloo'}; 'cpu:gloo,cuda:nccl' -> {'gloo', 'nccl'}; None -> set()."""
    if backend is None:
        return set()
    out = set()
    for part in str(backend).lower().split(","):
        name = part.split(":")[-1].strip()
        if name and name != "undefined":
            out.add(name)
    return out


def _call_text(backend: Any, init_method: str | None, given: dict[str, Any]) -> str:
    shown = [repr(str(backend))] if backend is not None else []
    if init_method:
        shown.append(f"init_method={init_method!r}")
    shown += [f"{k}={v!r}" for k, v in given.items() if k in ("world_size", "rank") and v not in (-1, None)]
    return f"init_process_group({', '.join(shown)})"


def run_script(source: str, path: str, argv: list[str]) -> None:
    """Run a script on this rank as torchrun would: ``__name__ == "__main__"``, ``sys.argv``, its
    folder first on ``sys.path`` (torchrun's env vars are every rank's: engine/launched.py). Its
    globals join the rank's namespace afterwards (as IPython's %run does); ``exit()``, ``quit()`` and
    ``sys.exit()`` end it as they end a script: status 0 is success, another status an error naming it."""
    from . import exits

    code = compile(source, path, "exec")
    linecache.cache[path] = (len(source), None, source.splitlines(True), path)  # tracebacks show its lines
    ns: dict[str, Any] = {"__name__": "__main__", "__file__": path, "__builtins__": exits.script_builtins()}
    saved = sys.argv, list(sys.path)
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(path))
    try:
        exec(code, ns)
    except SystemExit as exc:
        status = exits.status_of(exc.code)
        if status:
            said = f" (its message: {exc.code!r})" if exc.code != status else ""
            raise RuntimeError(f"{os.path.basename(path)} exited with status {status}{said}") from None
    finally:
        sys.argv, sys.path[:] = saved[0], saved[1]
        _share(ns)


def _share(ns: dict[str, Any]) -> None:
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover
        return
    shell = get_ipython()
    if shell is not None:
        shell.user_ns.update({k: v for k, v in ns.items() if not k.startswith("__")})
