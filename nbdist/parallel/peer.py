"""Recovery from a live peer, on a rank: a dead rank of a data-parallel world is rebuilt from the state
the living ranks hold, so no file is read and no finished step is computed again (recovery.py decides).

What a checkpoint would hold comes in two parts, kept as training goes:

- **what every rank holds alike** (the model's parameters, the optimizer, its LR schedulers): the living
  ranks have it in memory. It changes only in ``optimizer.step()``, so a rank's model is exactly at a
  step boundary unless the world broke inside that call; a step post-hook counts the completed steps,
  a pre-hook the begun ones, and a rank whose counts differ says it cannot give its state.
- **what each rank holds alone** (its RNG states, its loader's position, its buffers): taken at every
  ``optimizer.step()`` of a ``loader.steps()`` loop, just before the step (the batch is read, the
  backward is done: what the next step begins with) and sent without waiting to the rank ``OFFSET``
  places on (``control.control_group("peer")``, nbdist's own gloo group, never a GPU): the *buddy*, which
  keeps the last one it received. A rank that dies leaves its part with its buddy.

Only with ``--max-restarts`` (TORCHELASTIC_MAX_RESTARTS > 0) and more than one rank. The objects are
found, when ``loader.steps()`` begins, in the rank's namespace: the one optimizer there, the module
whose parameters it holds, the LR schedulers bound to it (engine/schedulers.py), and the loader.
"""

from __future__ import annotations

import datetime
import hashlib
import io
import os
from typing import Any

import torch
import torch.distributed as dist

from ..engine import control, schedulers
from ..engine.state import STATE
from . import ckpt_rank

AFTER_S = 0.2  # seconds a living rank waits, after a death, for a part already on its way
SLACK = 4096  # bytes of room in each mirror buffer beyond the largest part seen at the first step
KEPT: dict[str, Any] = {
    "loader": None,  # the ShardedLoader of the loop that runs
    "optimizer": None,
    "model": None,
    "hooked": set(),  # ids of optimizers whose hooks are on
    "begun": 0,  # optimizer steps begun / completed since the hooks went on
    "done": 0,
    "own": None,  # this rank's part at its last optimizer step: (begun, bytes)
    "mirror": None,  # the buddy's part: (rank it came from, bytes), the last complete one
    "exchange": None,  # the send and receive in flight: (group, send work, recv work, recv buffer, from)
    "capacity": 0,
    "held": None,  # what recovery took before the setup cells replaced the objects
}


def enabled() -> bool:
    return (
        int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0
        and dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size() > 1
    )


def watch(loader: Any) -> None:
    """``loader.steps()`` begins: find the optimizer and its model in the namespace, hook the optimizer."""
    if not enabled():
        return
    ns = _namespace()
    optimizers = [v for k, v in ns.items() if isinstance(v, torch.optim.Optimizer) and not k.startswith("_")]
    optimizers = list({id(o): o for o in optimizers}.values())
    KEPT.update(loader=loader, optimizer=None, model=None)
    if len(optimizers) != 1:
        return  # none, or several: recovery says which and falls back to the checkpoint
    optimizer = optimizers[0]
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    models = [v for v in ns.values() if isinstance(v, torch.nn.Module) and params <= {id(p) for p in v.parameters()}]
    KEPT.update(optimizer=optimizer, model=min(models, key=lambda m: len(list(m.parameters())), default=None))
    if id(optimizer) not in KEPT["hooked"]:
        KEPT["hooked"].add(id(optimizer))
        KEPT.update(begun=0, done=0, own=None, mirror=None, exchange=None)
        optimizer.register_step_pre_hook(_before_step)
        optimizer.register_step_post_hook(_after_step)


def _before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    if optimizer is not KEPT["optimizer"] or not enabled():
        return
    KEPT["begun"] += 1
    part = _serialise(_own_part())
    KEPT["own"] = (KEPT["begun"], part)
    _exchange(part)


def _after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    if optimizer is KEPT["optimizer"]:
        KEPT["done"] += 1


def _own_part() -> dict[str, Any]:
    """What this rank alone holds, as the next step will begin with it."""
    loader, model = KEPT["loader"], KEPT["model"]
    return {
        "rank": dist.get_rank(),
        "rng": ckpt_rank.rng_states(),
        "loader": loader.state_dict() if loader is not None else None,
        "buffers": {n: b.detach().to("cpu", copy=True) for n, b in model.named_buffers()} if model is not None else {},
    }


def buddy(rank: int, size: int) -> int:
    """The rank that keeps ``rank``'s part: OFFSET places on, a rank of another host where ranks are
    placed host by host (LOCAL_WORLD_SIZE apart), so a lost host does not take its ranks' parts along."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    offset = local if 0 < local < size else 1
    return (rank + offset) % size


def _exchange(part: bytes) -> None:
    """Finish the last exchange (keep the part it brought), then send this one to the buddy."""
    group, rank, size = control.control_group("peer"), dist.get_rank(), dist.get_world_size()
    _finish(wait=True)
    if not KEPT["capacity"] or KEPT.get("capacity_of") is not group:  # first step in this world: agree on a size
        need = torch.tensor([len(part) + 8], dtype=torch.int64)
        dist.all_reduce(need, op=dist.ReduceOp.MAX, group=group)
        KEPT.update(capacity=int(need.item()) * 2 + SLACK, capacity_of=group)
    out = torch.zeros(KEPT["capacity"], dtype=torch.uint8)
    if len(part) + 8 <= KEPT["capacity"]:
        out[:8] = torch.tensor([len(part)], dtype=torch.int64).view(torch.uint8)
        out[8 : 8 + len(part)] = torch.frombuffer(bytearray(part), dtype=torch.uint8)
    else:  # grown past the room agreed: the buddy learns that it holds nothing for this step
        out[:8] = torch.tensor([-1], dtype=torch.int64).view(torch.uint8)
    into = torch.empty(KEPT["capacity"], dtype=torch.uint8)
    source = next(r for r in range(size) if buddy(r, size) == rank)
    sent = dist.isend(out, dst=buddy(rank, size), group=group)
    got = dist.irecv(into, src=source, group=group)
    KEPT["exchange"] = (group, sent, got, into, source, out)


def _finish(wait: bool) -> None:
    """Take the part the exchange in flight brought, if it came (``wait``: it must; otherwise only if done)."""
    pending, KEPT["exchange"] = KEPT["exchange"], None
    if pending is None:
        return
    group, sent, got, into, source, _ = pending
    try:
        if wait:
            sent.wait()
            got.wait()
        else:  # the world is broken: what arrived has arrived (gloo says so only when waited on)
            got.wait(timeout=datetime.timedelta(seconds=AFTER_S))
    except Exception:
        return
    length = int(into[:8].view(torch.int64).item())
    KEPT["mirror"] = (source, bytes(into[8 : 8 + length].numpy())) if length >= 0 else None


def _serialise(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _load(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _namespace() -> dict[str, Any]:
    try:
        from IPython import get_ipython

        return get_ipython().user_ns  # type: ignore[union-attr,no-any-return]
    except Exception:
        return {}


def _name_of(obj: Any) -> str | None:
    return next((k for k, v in _namespace().items() if v is obj and not k.startswith("_")), None)


# --------------------------------------------------------------------------- recovery's side


def hold() -> dict[str, Any]:
    """Run on each living rank after a rank died, before anything else: keep this rank's state (the objects
    will be replaced when the setup cells run again) and say what it can give: the step it is at, a checksum
    of what every rank should hold alike, and whose part it keeps. ``why`` when it can give nothing."""
    _finish(wait=False)
    optimizer, model, loader = KEPT["optimizer"], KEPT["model"], KEPT["loader"]
    rank = STATE.rank if STATE.rank is not None else int(os.environ.get("RANK", "0"))
    out: dict[str, Any] = {"rank": rank, "why": ""}
    if optimizer is None or model is None or loader is None:
        out["why"] = "no loader.steps() loop with one optimizer and its model ran on this rank"
        return out
    if KEPT["begun"] != KEPT["done"]:
        out["why"] = f"rank {rank} was stopped inside optimizer.step(): its parameters are half updated"
        return out
    if KEPT["own"] is None or KEPT["own"][0] != KEPT["done"]:
        out["why"] = "no optimizer step was taken in this loop yet"
        return out
    scheds = schedulers.bound(optimizer)
    shared = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "schedulers": [s.state_dict() for s in scheds],
    }
    own = _load(KEPT["own"][1])
    KEPT["held"] = {"shared": shared, "own": own, "mirror": KEPT["mirror"]}
    names = {"model": _name_of(model), "optimizer": _name_of(optimizer), "loader": _name_of(loader)}
    out.update(
        step=int(own["loader"]["step"]),
        checksum=checksum(shared),
        keeps=KEPT["mirror"][0] if KEPT["mirror"] else None,
        keeps_step=int(_load(KEPT["mirror"][1])["loader"]["step"]) if KEPT["mirror"] else None,
        names=names,
    )
    return out


def checksum(shared: dict[str, Any]) -> str:
    """Of the parameters and the optimizer's tensors, bit for bit."""
    digest = hashlib.sha1()
    for value in _tensors(shared):
        digest.update(value.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value.reshape(-1)]
    if isinstance(value, dict):
        return [t for k in sorted(value, key=str) for t in _tensors(value[k])]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def restore(source: int, names: dict[str, str], parts_from: dict[int, int]) -> int:
    """Run on every rank of the rebuilt world, after the setup cells ran again: ``source`` sends what every
    rank holds alike; each rank takes its own part (a restarted rank, from the rank in ``parts_from``
    that kept it); the objects named in ``names`` get it all. Returns the step the loop goes on from."""
    rank = dist.get_rank()
    held = KEPT["held"] or {}
    box = [held.get("shared") if rank == source else None]
    dist.broadcast_object_list(box, src=source)
    kept = {held["mirror"][0]: held["mirror"][1]} if held.get("mirror") else {}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {r: data for r, data in kept.items() if parts_from.get(r) == rank})
    mine: dict[str, Any] = held["own"] if rank not in parts_from else _load(everyone[parts_from[rank]][rank])
    ns = _namespace()
    model, optimizer, loader = ns[names["model"]], ns[names["optimizer"]], ns[names["loader"]]
    shared: dict[str, Any] = box[0]  # type: ignore[assignment]
    model.load_state_dict(shared["model"])
    optimizer.load_state_dict(shared["optimizer"])
    for sched, state in zip(schedulers.bound(optimizer), shared["schedulers"], strict=False):
        sched.load_state_dict(state)
    ckpt_rank.restore(mine, model, loader)
    KEPT.update(held=None, own=None, mirror=None, exchange=None, begun=0, done=0)
    return int(mine["loader"]["step"])
