"""Recovery from a live peer, the giving side on a rank (parallel/peer.py keeps the parts as training goes):
``hold`` keeps this rank's state when a rank died (or the world grows) and says what it can give (a typed
``wire.Holding``); ``give`` gives it to the rebuilt world."""

from __future__ import annotations

import copy
import hashlib
import os
from typing import Any

import torch
import torch.distributed as dist

from ..engine import schedulers
from ..engine.state import STATE
from ..wire import Holding, Names
from . import ckpt_rank, peer_part
from .data import ShardedLoader
from .peer import AFTER_S, KEPT, Held, find, finish, name_of, namespace, own_part


def hold(now: bool = False) -> Holding:
    """Run on each living rank after a rank died, before anything else: keep this rank's state (the objects
    will be replaced when the setup cells run again) and say what it can give (``wire.Holding``): the optimizer
    steps it completed, a checksum of what every rank holds alike, its own parts and the parts it keeps for others
    (each by steps completed); ``why`` when it can give nothing. ``now``: between cells, before the world grows:
    the state as it is, of the optimizers, their models and the loaders in the namespace (step index 0)."""
    if now:
        ns = namespace()
        KEPT.optimizers, KEPT.models, KEPT.lacking = find(ns)
        KEPT.loaders = {k: v for k, v in ns.items() if isinstance(v, ShardedLoader) and not k.startswith("_")}
        if KEPT.loader is None or not any(v is KEPT.loader for v in KEPT.loaders.values()):
            KEPT.loader = next(iter(KEPT.loaders.values())) if len(KEPT.loaders) == 1 else None
        KEPT.new_loop()
        if KEPT.optimizers and KEPT.models and KEPT.loader is not None:
            KEPT.parts = {0: (True, own_part(with_extra=True))}
    else:
        last = KEPT.last_sent
        if last is not None:
            last.wait(AFTER_S)  # the sender thread is done with what it had
        finish(wait=False)
        KEPT.generation += 1  # what the sender thread still waits for in the broken world: let it go
    optimizers, models, loader = KEPT.optimizers, KEPT.models, KEPT.loader
    rank = STATE.rank if STATE.rank is not None else int(os.environ.get("RANK", "0"))
    if KEPT.lacking:
        return Holding(rank, why=KEPT.lacking)
    if not optimizers or not models or loader is None:
        return Holding(
            rank,
            why="the namespace holds no optimizer with its model and one loader of nbdist.parallel.shard" if now
            else "no optimizer stepped in a loop over a loader of nbdist.parallel.shard on this rank",
        )
    sharded = next((m for m in models.values() if _sharded(m)), None)
    if sharded is not None:
        return Holding(rank, why="the model is sharded (FSDP): each rank holds only its own shard, which died with it")
    if KEPT.begun != KEPT.done:
        return Holding(rank, why=f"rank {rank} was stopped inside optimizer.step(): its parameters are half updated")
    if KEPT.done != KEPT.at and not KEPT.complete():
        KEPT.roll_back()  # between two optimizers' steps of one batch: back to where it began
    done = KEPT.done
    ns = namespace()
    shared = {
        "models": [m.state_dict() for m in models.values()],
        "optimizers": [o.state_dict() for o in optimizers],
        "schedulers": [[s.state_dict() for s in schedulers.bound(o)] for o in optimizers],
        "state": {key: ns[name].state_dict() for key, name in KEPT.saved_state.items() if name in ns},
    }
    parts = dict(KEPT.parts)
    if done in parts and not parts[done][0]:  # past its step, not at the next boundary: extra= as it is now
        extra = ns.get(KEPT.saved_extra or "")
        parts[done] = (
            True,
            peer_part.with_extra(parts[done][1], copy.deepcopy(extra) if isinstance(extra, dict) else None),
        )
    KEPT.held = Held(shared=shared, parts=parts, mirrors=dict(KEPT.mirrors))
    params = [p for m in models.values() for p in m.parameters()]
    return Holding(
        rank,
        done=done,
        steps={index: peer_part.step_of(data)[0] for index, (_, data) in parts.items()},
        passes={index: peer_part.step_of(data)[1] for index, (_, data) in parts.items()},
        checksum=checksum({"parameters": params, "optimizers": shared["optimizers"]}),  # not buffers
        keeps={index: (source, exact) for index, (source, exact, _) in KEPT.mirrors.items()},
        names=Names(
            models=tuple(models),
            optimizers=tuple(name_of(o) for o in optimizers),
            loader=name_of(loader),
            extra=KEPT.saved_extra or "",
            state=dict(KEPT.saved_state),
        ),
    )


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


def give(
    done: int, source: int, names: Names, parts_from: dict[int, int], joined: int = 0, ahead: tuple[int, ...] = ()
) -> int:
    """Run on every rank of the rebuilt world, after the setup cells ran again: the world goes on after
    ``done`` optimizer steps. What every rank holds alike goes from ``source`` (which completed exactly those)
    only to the ranks without it: the restarted ones (``parts_from``'s), the last ``joined`` (new to a world that
    grew) and those ``ahead`` (a step past it); the other living ranks hold the same, bit for bit (their
    checksums agreed), and take their own. Each rank takes its own part for that point (a restarted rank, from
    the rank in ``parts_from`` that kept it; a joined rank: the source's, but for the RNG states its setup cells
    gave it); the objects named in ``names`` get it all. Point to point, then one barrier, so that every rank
    fails if one died in it: an all-gather of the kept parts was 0.7 s of a 64-rank recovery on 2 cores, and a
    broadcast of the model sent it to every rank. Returns the step the loop goes on from."""
    rank, size = dist.get_rank(), dist.get_world_size()
    held = KEPT.held or Held(shared={}, parts={}, mirrors={})
    new = {*parts_from, *range(size - joined, size)}
    needs = sorted((new | set(ahead)) - {source})
    shared: dict[str, Any] = held.shared
    source_part: Any = None  # a joined rank's: the source's own part
    if rank == source:
        for r in needs:
            dist.send_object_list([held.shared, held.parts[done][1] if r >= size - joined else None], dst=r)
    elif rank in needs:
        box: list[Any] = [None, None]
        dist.recv_object_list(box, src=source)
        shared, source_part = box
    kept_here = {r: data for index, (r, _, data) in held.mirrors.items() if index == done and parts_from.get(r) == rank}
    for r in sorted(kept_here):
        dist.send_object_list([kept_here[r]], dst=r)
    mirrored: list[Any] = [None]
    if rank in parts_from:
        dist.recv_object_list(mirrored, src=parts_from[rank])
    dist.barrier()
    if rank >= size - joined:
        mine = {**peer_part.decode(source_part), "rng": None}
    else:
        mine = peer_part.decode(held.parts[done][1] if rank not in parts_from else mirrored[0])
    ns = namespace()
    assert names.complete()  # decide() gives no plan without them
    models, optimizers = [ns[n] for n in names.models if n], [ns[n] for n in names.optimizers if n]
    assert shared
    for model, state in zip(models, shared["models"], strict=True):
        model.load_state_dict(state)
    for optimizer, state, scheds in zip(optimizers, shared["optimizers"], shared["schedulers"], strict=True):
        optimizer.load_state_dict(state)
        for sched, sched_state in zip(schedulers.bound(optimizer), scheds, strict=False):
            sched.load_state_dict(sched_state)
    for key, name in names.state.items():
        if key in shared["state"] and name in ns:
            ns[name].load_state_dict(shared["state"][key])
    if names.extra and isinstance(ns.get(names.extra), dict) and mine.get("extra") is not None:
        ns[names.extra].clear()
        ns[names.extra].update(mine["extra"])  # into the dict the setup cells made, as load_checkpoint(extra=)
    _put_back_own(mine, dict(zip(names.models, models, strict=True)), ns)
    KEPT.held = None
    KEPT.new_loop()
    return int(mine["step"])


def _put_back_own(mine: dict[str, Any], models: dict[str | None, Any], ns: dict[str, Any]) -> None:
    """This rank's own part back: RNG states (but on a rank new to a grown world), each model's buffers, each
    loader's position (those of the setup cells, by name)."""
    if mine.get("rng") is not None:
        ckpt_rank.set_rng_states(mine["rng"])
    with torch.no_grad():
        for key, model in models.items():
            buffers = mine["buffers"].get(key, {})
            for name, buffer in model.named_buffers():
                if name in buffers:
                    buffer.copy_(buffers[name])
    for name, position in mine["loaders"].items():
        if isinstance(ns.get(name), ShardedLoader):
            ns[name].load_state_dict(position)
