"""Recovery from a live peer, on a rank: a dead rank of a data-parallel world is rebuilt from the state
the living ranks hold, so no file is read and no finished step is computed again (recovery.py decides).

What a checkpoint would hold comes in two parts, kept as training goes:

- **what every rank holds alike** (the model's parameters, the optimizer, its LR schedulers, the
  ``state=`` objects and ``extra=`` of the last ``save_checkpoint``): the living ranks have it in
  memory. Parameters change only in ``optimizer.step()``; hooks count the steps begun and completed,
  so a rank knows it sits after its k-th step, or that the world broke inside one (then it gives nothing).
- **what each rank holds alone** (its RNG states, its loader's position, its buffers): a living rank
  takes its own at each step boundary of ``loader.steps()`` (``boundary``). A dead rank's must have left
  its process in time: at every ``optimizer.step()`` each rank sends it, without waiting, to its *buddy*
  (``buddy``: a rank of another host where there is one) over nbdist's own gloo group
  (``control.control_group("peer")``, never a GPU), which keeps the last one received. It is taken just
  before the step, when the batch is read and the backward done: what the next step begins with, as long
  as nothing draws random numbers between ``optimizer.step()`` and the next batch.

Only with ``--max-restarts`` (and not ``--recover-from checkpoint``: ``wire.PEER_ENV``) and more than one rank. The objects are
found, when ``loader.steps()`` begins, in the rank's namespace: the one optimizer there, the module
whose parameters it holds, the LR schedulers bound to it (engine/schedulers.py), the loader; and the
``state=`` and ``extra=`` names the last ``save_checkpoint`` remembered (``saved``).
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import os
import queue
import threading
import weakref
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .. import wire
from ..engine import control, schedulers
from ..engine.state import STATE
from . import ckpt_rank, peer_part

AFTER_S = 0.2  # seconds a living rank waits, after a death, for a part already on its way
WAIT_STEP_S = 0.5  # seconds between looks, while waiting for an exchange, at whether its world was replaced
SEND_WAIT_S = 30.0  # seconds a step waits for its part to leave (a bound: a broken world fails the send at once)
HEADER = 24  # bytes: the part's length, the steps completed it belongs to, whether it was taken at a boundary
SLACK = 4096  # bytes of room in each mirror buffer beyond the largest part seen at the first step
KEEP = 3  # parts kept, own and mirrored: the living ranks may have stopped one step apart
KEPT: dict[str, Any] = {
    "loader": None,  # the ShardedLoader of the loop that runs
    "hooked": weakref.WeakSet(),  # optimizers whose hooks are on (not by id: one is reused once freed)
    "optimizer": None,
    "model": None,
    "begun": 0,  # optimizer steps begun / completed since the hooks went on
    "done": 0,
    # This rank's own part by the optimizer steps completed when the loop is at it: (exact, part); exact at a
    # step boundary, taken just before the step otherwise (what the next boundary will be, but for extra=).
    "parts": {},
    "mirrors": {},  # the parts this rank keeps for another, the same way: (rank it came from, exact, bytes)
    "saved": {},  # the names the last save_checkpoint remembered: {"state": {key: name}, "extra": name}
    "exchange": None,  # the exchange in flight: (receive, from, the send not waited for yet)
    "capacity_of": None,  # the group the buffers below were agreed in
    "out": None,
    "into": None,
    "held": None,  # what recovery took before the setup cells replaced the objects
    "queue": queue.Queue(),  # exchanges for the sender thread (``_send``)
    "sender": None,
    "failed": None,  # the exchange that raised (the world broke)
    "last_sent": None,
    "generation": 0,  # a rebuilt world or a new loop's optimizer: exchanges of an older one are dropped
}


def enabled() -> bool:
    return (
        os.environ.get(wire.PEER_ENV) == "1"
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
        return  # none, or several: hold() says so and recovery falls back to the checkpoint
    optimizer = optimizers[0]
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    models = [v for v in ns.values() if isinstance(v, torch.nn.Module) and params <= {id(p) for p in v.parameters()}]
    KEPT.update(optimizer=optimizer, model=min(models, key=lambda m: len(list(m.parameters())), default=None))
    if optimizer not in KEPT["hooked"]:
        KEPT["hooked"].add(optimizer)
        KEPT.update(begun=0, done=0, parts={}, mirrors={}, exchange=None, generation=KEPT["generation"] + 1)
        optimizer.register_step_pre_hook(_before_step)
        optimizer.register_step_post_hook(_after_step)


def boundary() -> None:
    """A step boundary of ``loader.steps()`` (before the next batch is read): keep this rank's own part, exact,
    and send it to the buddy without waiting (it has the whole step to arrive)."""
    if KEPT["optimizer"] is None or not enabled():
        return
    data = _own_part(with_extra=True)
    _keep(KEPT["parts"], KEPT["done"], (True, data))
    _send(KEPT["done"], True, data, wait=False)


def saved(names: dict[str, Any]) -> None:
    """``save_checkpoint`` names its ``state=`` objects and ``extra=`` dict: a peer gives them too."""
    KEPT["saved"] = {"state": dict(names.get("state") or {}), "extra": names.get("extra")}


def _before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """Just before the step: this rank's part as the next boundary will be (``extra=`` not yet updated for
    this step, so left out), sent to the buddy; the step waits until it has left, and is not taken when it
    could not leave (the buddy died): a rank that took its step left its part behind, and a rank whose
    buddy died stays with the dead rank, at the step whose boundary part it sent."""
    if optimizer is not KEPT["optimizer"] or not enabled():
        return
    after = KEPT["begun"] + 1
    data = _own_part(with_extra=False)
    sent = _send(after, False, data, wait=True)
    if not sent.wait(SEND_WAIT_S) or KEPT.get("failed") is sent:
        raise RuntimeError(
            f"nbdist: rank {dist.get_rank()} could not leave its part with its buddy ({KEPT.get('why') or 'no answer'})"
        )
    KEPT["begun"] = after
    if after not in KEPT["parts"]:
        _keep(KEPT["parts"], after, (False, data))


def _after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    if optimizer is KEPT["optimizer"]:
        KEPT["done"] += 1


def _send(index: int, exact: bool, data: bytes, wait: bool) -> threading.Event:
    """Hand an exchange to this rank's sender thread: gloo's point-to-point calls take about 1.5 ms each on
    the 2-core CI machine beside a training step (benchmarks/recovery.py), and the boundary's need not be
    waited for. The group is taken here, on the training thread: a new one is a collective of every rank."""
    sender = KEPT.get("sender")
    if sender is None or not sender.is_alive():
        sender = threading.Thread(target=_sender, args=(KEPT["queue"],), name="nbdist-peer", daemon=True)
        KEPT["sender"] = sender
        sender.start()
    group = control.control_group("peer")
    if group is not KEPT.get("group"):  # a world rebuilt since the last exchange (a release, a restart)
        KEPT.update(group=group, generation=KEPT["generation"] + 1, exchange=None)
    done = threading.Event()
    KEPT["queue"].put((KEPT["generation"], group, index, exact, data, wait, done))
    KEPT["last_sent"] = done
    return done


def _sender(items: queue.Queue) -> None:
    while True:
        generation, group, index, exact, data, wait, done = items.get()
        try:
            if generation != KEPT["generation"]:  # of a world or loop since replaced: dropped
                raise RuntimeError("an exchange of a world since rebuilt")
            _exchange(group, generation, index, exact, data, wait)
        except Exception as exc:  # the world broke: what was in flight stays as it is for hold()
            KEPT["failed"], KEPT["why"] = (
                done,
                f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}",
            )
        finally:
            done.set()


def _keep(kept: dict[int, Any], index: int, value: Any) -> None:
    kept[index] = value
    for old in sorted(kept)[:-KEEP]:
        del kept[old]


def _own_part(with_extra: bool) -> bytes:
    """What this rank alone holds, as the next step will begin with it (peer_part.py)."""
    extra = _namespace().get(KEPT["saved"].get("extra") or "") if with_extra else None
    return peer_part.take(KEPT["loader"], KEPT["model"], copy.deepcopy(extra) if isinstance(extra, dict) else None)


def buddy(rank: int, size: int) -> int:
    """The rank that keeps ``rank``'s part: one of another host where ranks are placed host by host
    (LOCAL_WORLD_SIZE apart), so a lost host does not take its ranks' parts along; else the next rank."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    offset = local if 0 < local < size else 1
    return (rank + offset) % size


def _exchange(group: Any, generation: int, index: int, exact: bool, data: bytes, wait: bool) -> None:
    """Finish the last exchange (keep the part it brought), then send this one to the buddy; ``wait`` until
    it has left. Every rank sends at the same points (each boundary, each step), so sends and receives pair.
    One buffer each way per world, agreed in size at the first exchange: a header (length, index, exact)
    and the part."""
    rank, size = dist.get_rank(), dist.get_world_size()
    _finish(wait=True)
    if generation != KEPT["generation"]:
        raise RuntimeError("an exchange of a world since rebuilt")
    if KEPT["capacity_of"] is not group:  # first exchange in this world: agree on a size
        need = torch.tensor([len(data) + HEADER], dtype=torch.int64)
        dist.all_reduce(need, op=dist.ReduceOp.MAX, group=group)
        room = int(need.item()) * 2 + SLACK
        KEPT.update(
            capacity_of=group,
            out=torch.zeros(room, dtype=torch.uint8),
            into=torch.zeros(room, dtype=torch.uint8),
        )
    out, into = KEPT["out"], KEPT["into"]
    fits = len(data) + HEADER <= out.numel()  # else the buddy learns that it holds nothing for this point
    out[:HEADER].view(torch.int64).copy_(torch.tensor([len(data) if fits else -1, index, int(exact)]))
    if fits:
        out.numpy()[HEADER : HEADER + len(data)] = np.frombuffer(data, dtype=np.uint8)
    source = next(r for r in range(size) if buddy(r, size) == rank)
    sent = group.send([out], buddy(rank, size), 0)  # the group's own ranks: every rank is in it
    got = group.recv([into], source, 0)
    if wait and sent is not None and not _waited(sent, generation):  # a gloo send is waited for once only
        raise RuntimeError("the world was rebuilt while this rank's part was leaving")
    KEPT["exchange"] = (got, source, None if wait else sent, generation)


def _waited(work: Any, generation: int) -> bool:
    """Wait for a send or receive until it completes (True) or its world is replaced (False); a broken
    world raises. Bounded steps: an exchange between two living ranks of a broken world never completes,
    and must not hold the sender thread when the rebuilt world needs it."""
    while True:
        try:
            work.wait(timeout=datetime.timedelta(seconds=WAIT_STEP_S))
            return True
        except Exception as exc:
            if generation != KEPT["generation"]:
                return False
            if "timed out" not in str(exc).lower() and "timeout" not in str(exc).lower():
                raise


def _finish(wait: bool) -> None:
    """Keep the part the receive in flight brought (``wait``: it must come; otherwise only if it came)."""
    pending, KEPT["exchange"] = KEPT["exchange"], None
    if pending is None:
        return
    got, source, sent, generation = pending
    if generation != KEPT["generation"]:
        return
    try:
        if wait:
            if (sent is not None and not _waited(sent, generation)) or not _waited(got, generation):
                return
        else:  # the world is broken: what arrived has arrived (gloo says so only when waited on)
            got.wait(timeout=datetime.timedelta(seconds=AFTER_S))
    except Exception:
        return
    into = KEPT["into"]
    length, index, exact = into[:HEADER].view(torch.int64).tolist()
    if length >= 0 and (exact or index not in KEPT["mirrors"]):
        _keep(KEPT["mirrors"], index, (source, bool(exact), into.numpy()[HEADER : HEADER + length].tobytes()))


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
    will be replaced when the setup cells run again) and say what it can give: the optimizer steps it
    completed, a checksum of what every rank holds alike, its own parts and the parts it keeps for others
    (each by steps completed). ``why`` when it can give nothing."""
    last = KEPT.get("last_sent")
    if last is not None:
        last.wait(AFTER_S)  # the sender thread is done with what it had
    _finish(wait=False)
    KEPT["generation"] += 1  # what the sender thread still waits for in the broken world: let it go
    optimizer, model, loader = KEPT["optimizer"], KEPT["model"], KEPT["loader"]
    rank = STATE.rank if STATE.rank is not None else int(os.environ.get("RANK", "0"))
    out: dict[str, Any] = {"rank": rank, "why": ""}
    if optimizer is None or model is None or loader is None:
        out["why"] = "no loader.steps() loop with one optimizer and its model ran on this rank"
        return out
    if _sharded(model):
        out["why"] = "the model is sharded (FSDP): each rank holds only its own shard, which died with it"
        return out
    done = KEPT["done"]
    if KEPT["begun"] != done:
        out["why"] = f"rank {rank} was stopped inside optimizer.step(): its parameters are half updated"
        return out
    ns, names = _namespace(), KEPT["saved"]
    shared = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "schedulers": [s.state_dict() for s in schedulers.bound(optimizer)],
        "state": {key: ns[name].state_dict() for key, name in names.get("state", {}).items() if name in ns},
    }
    parts = dict(KEPT["parts"])
    if done in parts and not parts[done][0]:  # past its step, not at the next boundary: extra= as it is now
        extra = ns.get(names.get("extra") or "")
        parts[done] = (
            True,
            peer_part.with_extra(parts[done][1], copy.deepcopy(extra) if isinstance(extra, dict) else None),
        )
    KEPT["held"] = {"shared": shared, "parts": parts, "mirrors": dict(KEPT["mirrors"])}
    out.update(
        done=done,
        steps={index: peer_part.step_of(data) for index, (_, data) in parts.items()},
        checksum=checksum({"parameters": list(model.parameters()), "optimizer": shared["optimizer"]}),  # not buffers
        keeps={index: [source, exact] for index, (source, exact, _) in KEPT["mirrors"].items()},
        names={
            "model": _name_of(model),
            "optimizer": _name_of(optimizer),
            "loader": _name_of(loader),
            "extra": names.get("extra") or "",
            "state": names.get("state", {}),
        },
    )
    return out


def _sharded(model: Any) -> bool:
    """FSDP (either API): a parameter is a DTensor shard, or the module is FSDP's wrapper."""
    if type(model).__name__ in ("FullyShardedDataParallel", "FSDPModule") or hasattr(model, "_fsdp_wrapped_module"):
        return True
    return any(
        type(p).__name__ == "DTensor" or type(getattr(p, "data", None)).__name__ == "DTensor"
        for p in model.parameters()
    )


def checksum(shared: dict[str, Any]) -> str:
    """Of what every rank holds alike (the parameters and the optimizer's tensors; buffers are each rank's
    own), bit for bit."""
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


def restore(done: int, source: int, names: dict[str, Any], parts_from: dict[int, int]) -> int:
    """Run on every rank of the rebuilt world, after the setup cells ran again: the world goes on after
    ``done`` optimizer steps. ``source`` (which completed exactly those) sends what every rank holds alike;
    each rank takes its own part for that point (a restarted rank, from the rank in ``parts_from`` that kept
    it); the objects named in ``names`` get it all. Returns the step the loop goes on from."""
    rank = dist.get_rank()
    held = KEPT["held"] or {"parts": {}, "mirrors": {}}
    box = [held["shared"] if rank == source else None]
    dist.broadcast_object_list(box, src=source)
    given = {r: data for index, (r, _, data) in held["mirrors"].items() if index == done and parts_from.get(r) == rank}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, given)
    mine = peer_part.decode(held["parts"][done][1] if rank not in parts_from else everyone[parts_from[rank]][rank])
    ns = _namespace()
    model, optimizer, loader = ns[names["model"]], ns[names["optimizer"]], ns[names["loader"]]
    shared = box[0]
    assert shared is not None
    model.load_state_dict(shared["model"])
    optimizer.load_state_dict(shared["optimizer"])
    for sched, state in zip(schedulers.bound(optimizer), shared["schedulers"], strict=False):
        sched.load_state_dict(state)
    for key, name in names.get("state", {}).items():
        if key in shared["state"] and name in ns:
            ns[name].load_state_dict(shared["state"][key])
    if names.get("extra") and isinstance(ns.get(names["extra"]), dict) and mine.get("extra") is not None:
        ns[names["extra"]].clear()
        ns[names["extra"]].update(mine["extra"])  # into the dict the setup cells made, as load_checkpoint(extra=)
    ckpt_rank.restore(mine, model, loader)
    KEPT.update(held=None, parts={}, mirrors={}, exchange=None, begun=0, done=0, generation=KEPT["generation"] + 1)
    return int(mine["loader"]["step"])
