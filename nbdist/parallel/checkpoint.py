"""Checkpoints of a whole training loop with torch.distributed.checkpoint (DCP).

Layout: ``path/step-000000100/`` holds a DCP checkpoint (model, optimizer, and the ``state=``
objects: a scheduler, a GradScaler, an EMA model, anything with ``state_dict``/``load_state_dict``)
and ``rank-N.pt`` per rank: what differs from rank to rank (``ckpt_rank.py``). ``path/latest``
names the newest complete step. Every save writes ``step-N.partial`` first; rank 0 renames it and
then rewrites ``latest`` atomically once the whole checkpoint is on disk, so a crash or a kill
mid-save leaves the previous checkpoint as the latest, untouched. ``keep=K`` then removes all but
the K newest complete checkpoints (never the latest).

``asynchronous=True`` returns as soon as the state is copied (``dcp.async_save`` stages it into
memory of its own), so training goes on within the cell; the cell ends when its saves are complete
(a ``%dist_stop`` right after cannot cut the last one short). Files are written by a background thread over a separate gloo group of its
own (``engine/control.control_group("checkpoint")``: its collectives never pair with training's), and ``latest``
moves when they are complete. The next save, a load, and a preemption save wait for it first.

``load_checkpoint`` restores all of it, so a resumed run continues exactly as an uninterrupted
one: the model (with each rank's own buffers), the optimizer, the ``state=`` objects, each rank's
RNG states and loader position, and ``extra=`` (plain values, read back into the dict you pass).
The last save also tells nbdist what to restore after an automatic restart (``restore_latest``)
and what to save on preemption (engine/preempt.py).
"""

from __future__ import annotations

import os
import re
import shutil
import threading
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from .. import wire
from ..engine import control, metrics, preempt, schedulers
from ..engine.state import at_cell_end
from ..errors import ConfigError
from . import ckpt_rank, peer

KEY = wire.CHECKPOINT  # what the notebook learns of the last save (run.py reads it)
_STEP = re.compile(r"^step-(\d+)$")
# The asynchronous save in flight on this rank, and why one failed, each with the world it began in: a
# save of a world since rebuilt (a rank died) is dropped, not waited for; its step never became latest.
_PENDING: list[tuple[threading.Thread, Any]] = []
_FAILED: list[tuple[str, Any]] = []


def _step_dir(path: str, step: int) -> str:
    return os.path.join(path, f"step-{step:09d}")


def latest_step(path: str) -> int | None:
    """The newest complete step under ``path``, or None."""
    try:
        with open(os.path.join(path, "latest")) as fh:
            return int(fh.read().strip())
    except (FileNotFoundError, ValueError):
        return None


def complete_steps(path: str) -> list[int]:
    """The steps with a complete checkpoint directory under ``path``, oldest first."""
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        return []
    steps = [int(m.group(1)) for n in names if (m := _STEP.match(n))]
    return sorted(s for s in steps if os.path.exists(os.path.join(_step_dir(path, s), ".metadata")))


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(
    path: str,
    model: torch.nn.Module,
    optimizer: Any,
    step: int,
    extra: dict | None = None,
    loader: Any = None,
    state: dict[str, Any] | None = None,
    keep: int | None = None,
    asynchronous: bool = False,
) -> str:
    """Save the training loop at ``step`` (the number of steps done); return the step's directory.

    ``state``: more objects to keep, by name (``{"scheduler": sched, "scaler": scaler}``);
    ``extra``: plain values (numbers, text, tensors, lists and dicts of them); ``loader``: a
    ShardedLoader, whose position each rank keeps; ``keep``: how many complete checkpoints to
    keep (None: all); ``asynchronous``: return once the state is copied, write in the background.
    """
    objects = _with_schedulers(optimizer, _stateful(state), say=True)
    given, extra = extra, dict(extra or {})  # the caller's dict is what a restart reloads and preemption saves
    ckpt_rank.check_plain(extra)
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ConfigError(f"keep ({keep!r}) must be 1 or more checkpoints to keep, or None to keep all.")
    wait_for_saves()
    rank = _rank()
    final = _step_dir(path, step)
    partial = final + ".partial"
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
    _barrier()
    os.makedirs(partial, exist_ok=True)
    ckpt_rank.save(partial, rank, model, loader, step, extra)  # before DCP's collectives: done when they end
    payload = _payload(model, optimizer, objects)
    if asynchronous and dist.is_initialized():
        future = dcp.async_save(payload, checkpoint_id=partial, process_group=control.control_group("checkpoint"))
        thread = threading.Thread(
            target=_finish_later, args=(future, path, step, keep, _world()), name="nbdist-checkpoint", daemon=True
        )
        _PENDING.append((thread, _world()))
        thread.start()
        at_cell_end(wait_for_saves)  # the cell's checkpoints are on disk when it ends
    else:
        dcp.save(payload, checkpoint_id=partial)
        if rank == 0:
            _publish(path, step, keep)
        _barrier()  # every rank sees the new latest before it goes on
    _remember(path, model, optimizer, loader, objects, given, keep)
    return final


def _payload(model: torch.nn.Module, optimizer: Any, objects: dict[str, Any]) -> dict[str, Any]:
    """What DCP saves and loads into: the model's and optimizer's state (DDP or FSDP), and the state= objects'."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd, "state": {k: o.state_dict() for k, o in objects.items()}}


def _world() -> Any:
    return dist.group.WORLD if dist.is_initialized() else None


def wait_for_saves() -> None:
    """Wait for this rank's asynchronous save (of this world) to be complete; raise if it failed."""
    now = _world()
    pending, _PENDING[:] = list(_PENDING), []
    for thread, of in pending:
        if of is now:
            thread.join()
    failed, _FAILED[:] = [why for why, of in _FAILED if of is now], []
    if failed:
        raise RuntimeError(
            f"the last asynchronous save_checkpoint failed ({failed[-1]}); the previous checkpoint is kept."
        )


def _finish_later(future: Any, path: str, step: int, keep: int | None, of: Any) -> None:
    try:
        future.result()  # DCP's own last collective: on rank 0, every rank's files are written
        if _rank() == 0 and of is _world():
            _publish(path, step, keep)
    except (Exception, CheckpointException) as exc:  # said by the next save or load; the previous one stays latest
        _FAILED.append((_reason(exc), of))


def _publish(path: str, step: int, keep: int | None) -> None:
    """Rank 0, once the whole of step-N.partial is on disk: make it step-N, point latest at it, prune."""
    final = _step_dir(path, step)
    old = final + f".old-{os.getpid()}"
    if os.path.isdir(final):  # saved again at the same step (a preemption save, say): swap, then drop the old
        os.replace(final, old)
    os.replace(final + ".partial", final)
    tmp = os.path.join(path, f"latest.{os.getpid()}")
    with open(tmp, "w") as fh:
        fh.write(str(step))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, os.path.join(path, "latest"))
    shutil.rmtree(old, ignore_errors=True)
    if keep is not None:
        for gone in complete_steps(path)[:-keep]:
            if gone != step:
                shutil.rmtree(_step_dir(path, gone), ignore_errors=True)


def _stateful(state: dict[str, Any] | None) -> dict[str, Any]:
    """The ``state=`` objects, checked: each keeps and restores its own state."""
    if state is None:
        return {}
    if not isinstance(state, dict):
        raise ConfigError(
            f"state ({type(state).__name__}) must be a dict of name -> object, such as state={{'scheduler': sched}}."
        )
    for name, obj in state.items():
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise ConfigError(
                f"state[{name!r}] (a {type(obj).__name__}) has no state_dict()/load_state_dict(); pass objects that "
                "do (an LR scheduler, a GradScaler, a model), or plain values in extra=."
            )
    return state


_SAID: set[int] = set()  # schedulers save_checkpoint said it keeps (once each)


def _with_schedulers(optimizer: Any, objects: dict[str, Any], say: bool = False) -> dict[str, Any]:
    """The ``state=`` objects and the LR schedulers that hold ``optimizer`` (engine/schedulers.py), each of
    those by its variable name on the rank, else its class's name; ``say``: one line on rank 0 per new one."""
    found = schedulers.bound(optimizer, objects.values())
    if not found:
        return objects
    names = _names({str(i): s for i, s in enumerate(found)})
    out = dict(objects)
    for i, sched in enumerate(found):
        key = names.get(str(i)) or type(sched).__name__
        while key in out:
            key += "_"
        out[key] = sched
        if say and id(sched) not in _SAID:
            _SAID.add(id(sched))
            if _rank() == 0:
                print(
                    f"nbdist: save_checkpoint keeps {key} ({type(sched).__name__}) too: it holds this optimizer, and "
                    f"a run resumed without it would take other steps (state={{{key!r}: {key}}} says so yourself)",
                    flush=True,
                )
    return out


def _remember(
    path: str, model: Any, optimizer: Any, loader: Any, objects: dict[str, Any], extra: dict | None, keep: int | None
) -> None:
    """The last save: preemption saves again the same way (``extra`` as it is then); the notebook learns
    the variable names (so that after a restart and the setup cells' replay it can load into the new objects,
    ``extra``'s dict included)."""
    preempt.DEFAULT[:] = [
        lambda step: save_checkpoint(
            path, model, optimizer, step or 0, extra=extra, loader=loader, state=objects, keep=keep
        )
    ]
    preempt.install()
    names: dict[str, Any] = _names({"model": model, "optimizer": optimizer, "loader": loader, "extra": extra})
    if objects:
        names["state"] = {key: name for key, obj in objects.items() if (name := _names({"x": obj}).get("x"))}
    metrics.publish(KEY, {"path": os.path.abspath(path), "names": names})
    peer.saved(names)  # a live peer gives the state= objects and extra= too (parallel/peer.py)


def _names(objects: dict[str, Any]) -> dict[str, str]:
    """The notebook-level variable names on this rank that hold these objects."""
    try:
        from IPython import get_ipython

        ns = get_ipython().user_ns  # type: ignore[union-attr]
    except Exception:
        return {}
    out = {}
    for role, obj in objects.items():
        if obj is None:
            continue
        for name, value in ns.items():
            if value is obj and not name.startswith("_"):
                out[role] = name
                break
    return out


def restore_latest(path: str, names: dict[str, Any], saved_as: int | None = None) -> int | None:
    """After a restart: load the latest checkpoint under ``path`` into the namespace's objects
    named in ``names`` (model, optimizer, loader, the state objects); the step, or None when there is none yet.
    ``saved_as``: this rank's number when it saved (load_checkpoint)."""
    if latest_step(path) is None:
        return None
    from IPython import get_ipython

    ns = get_ipython().user_ns  # type: ignore[union-attr]
    wanted = [names.get("model"), names.get("optimizer"), *names.get("state", {}).values()]
    missing = [n for n in wanted if n is None or n not in ns]
    if missing:
        raise ConfigError(
            f"cannot restore {path!r}: no variable {missing[0] or 'model/optimizer'!r} after the setup cells "
            "ran again; build the model, optimizer and the objects passed as state= in a %%distributed --setup cell."
        )
    loader = ns.get(names["loader"]) if "loader" in names else None
    extra = ns.get(names["extra"]) if "extra" in names else None
    state = {key: ns[name] for key, name in names.get("state", {}).items()}
    model, optimizer = ns[names["model"]], ns[names["optimizer"]]
    return load_checkpoint(path, model, optimizer, loader=loader, state=state, extra=extra, saved_as=saved_as)


def load_checkpoint(
    path: str,
    model: torch.nn.Module,
    optimizer: Any,
    step: int | None = None,
    loader: Any = None,
    state: dict[str, Any] | None = None,
    extra: dict | None = None,
    per_rank: bool = True,
    saved_as: int | None = None,
) -> int:
    """Load the given (default: latest complete) step into the model, the optimizer, the ``state=``
    objects, this rank's RNG states, buffers and loader position, and ``extra`` (a dict, updated);
    return the step. ``per_rank=False`` skips the per-rank part (RNG, loader, buffers), which a
    world of another size cannot use; ``saved_as=r`` loads the one rank r saved (a world that went on
    with fewer ranks: each rank's own part, saved under its old number; the loader splits the rest of
    the epoch over the ranks now)."""
    objects = _stateful(state)
    wait_for_saves()
    if step is None:
        step = latest_step(path)
        if step is None:
            raise ConfigError(f"no complete checkpoint under {path!r}; save one with save_checkpoint first.")
    directory = _step_dir(path, step)
    if not os.path.isdir(directory):
        raise ConfigError(f"checkpoint step {step} is not under {path!r}; complete steps: {complete_steps(path)}.")
    others = [s for s in complete_steps(path) if s != step]
    try:
        saved = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    except (Exception, CheckpointException) as exc:
        raise ConfigError(
            f"{directory} has no readable .metadata ({type(exc).__name__}): that checkpoint is damaged or was never "
            f"completed; load another step{f' ({others})' if others else ''}."
        ) from None
    try:
        own, problem = (
            ckpt_rank.load(
                directory, _rank(), dist.get_world_size() if dist.is_initialized() else 1, per_rank, saved_as
            ),
            "",
        )
    except ConfigError as exc:
        own, problem = None, str(exc)
    if dist.is_initialized():  # every rank says the same before DCP's collectives, not one rank alone
        problems: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        problem = next((p for p in problems if p), "")
    if problem:
        raise ConfigError(problem)
    found = _with_schedulers(optimizer, objects)  # the schedulers save_checkpoint kept by itself, where saved
    objects.update(
        {k: o for k, o in found.items() if k not in objects and any(n.startswith(f"state.{k}.") for n in saved)}
    )
    try:
        payload = _payload(model, optimizer, objects)
        dcp.load(payload, checkpoint_id=directory)
        set_state_dict(model, optimizer, model_state_dict=payload["model"], optim_state_dict=payload["optim"])
    except (Exception, CheckpointException) as exc:
        raise ConfigError(
            f"{directory} does not load into this model, optimizer and state ({_reason(exc)}): "
            f"load it into what saved it{f', or another step ({others})' if others else ''}."
        ) from None
    for key, obj in objects.items():
        obj.load_state_dict(payload["state"][key])
    if own is not None:
        ckpt_rank.put_back_own(own, model, loader)
        if extra is not None:
            extra.update(own.get("extra") or {})
    return step


def _reason(exc: BaseException) -> str:
    """One line: the exception's type and first line; for DCP's, those of the first rank's failure."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))  # (exception, its traceback)
        exc = inner[0] if isinstance(inner, tuple) else inner
    first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
    return f"{type(exc).__name__}: {first[:300]}"
