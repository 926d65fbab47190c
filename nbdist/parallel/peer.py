"""Recovery from a live peer, on a rank: a dead rank of a data-parallel world is rebuilt from the state
the living ranks hold, so no file is read and no finished step is computed again (recovery.py decides).

What a checkpoint would hold comes in two parts, kept as training goes:

- **what every rank holds alike** (the models' parameters, the optimizers, their LR schedulers, the
  ``state=`` objects and ``extra=`` of the last ``save_checkpoint``): the living ranks have it in
  memory. Parameters change only in ``optimizer.step()``; hooks count the steps begun and completed,
  so a rank knows it sits after its k-th step, or that the world broke inside one (then it gives nothing).
- **what each rank holds alone** (its RNG states, its loaders' positions, its buffers): a living rank
  takes its own at the step boundaries of any loop over a ``shard`` loader (``boundary``: before a batch
  is read, where an optimizer stepped since the last one, and as each pass begins). A dead rank's must have left
  its process in time: at every ``optimizer.step()`` each rank sends it to its *buddy* (``buddy``: a rank of
  another host where there is one) over a gloo group of the two ranks alone (``control.pair_groups("peer")``, never
  a GPU), which keeps the last one received; a rank takes the step once its part has left and its source's part
  for the step has come, so no living rank is ever a step past a part it lacks. It is taken just
  before the step, when the batch is read and the backward done: what the next step begins with, as long
  as nothing draws random numbers between ``optimizer.step()`` and the next batch.

Several optimizers (a GAN's two) step in turn within one batch: only the batch's last step sends a part (the
optimizers that stepped in the batch before tell which is last). Before each earlier one the optimizer, its
parameters and its schedulers are copied (``Undo``), so a world that breaks between two steps of one batch
goes back to the batch's beginning on the living ranks, where every rank kept its part.

Only with ``--max-restarts`` (and not ``--recover-from checkpoint``: ``wire.PEER_ENV``) and more than one rank. The objects are
found, as a pass over a loader begins (``watch``), in the rank's namespace: every optimizer there, the module
whose parameters each holds, the LR schedulers bound to them (engine/schedulers.py), every ``shard`` loader; and the
``state=`` and ``extra=`` names the last ``save_checkpoint`` remembered (``saved``).
"""

from __future__ import annotations

import copy
import datetime
import os
import queue
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .. import wire
from ..engine import atomic, control
from ..engine.state import STATE
from . import peer_part
from .peer_undo import Undo

AFTER_S = 0.2  # seconds a living rank waits, after a death, for a part already on its way
WAIT_STEP_S = 0.5  # seconds between looks, while waiting for an exchange, at whether its world was replaced
SEND_WAIT_S = 30.0  # seconds a step waits for its part to leave (a bound: a broken world fails the send at once)
HEADER = 24  # bytes: the part's length, the steps completed it belongs to, whether it was taken at a boundary
SLACK = 4096  # bytes of room in each mirror buffer beyond the largest part seen at the first step
KEEP = 3  # parts kept, own and mirrored: the living ranks may have stopped one step apart


@dataclass(slots=True)
class Held:
    """What ``hold`` took when a rank died, before the setup cells replaced the objects (peer_give.give gives it)."""

    shared: dict[str, Any]  # what every rank holds alike: model, optimizer, schedulers, state=
    parts: dict[int, tuple[bool, bytes]]  # this rank's own parts by steps completed: (exact, part)
    mirrors: dict[int, tuple[int, bool, bytes]]  # the parts it keeps for others: (rank it came from, exact, part)


@dataclass(slots=True)
class Kept:
    """A rank's side of recovery from a live peer, kept as training goes (one per process: ``KEPT``)."""

    loader: Any = None  # the loader in whose pass an optimizer last stepped: its step is the loop's step
    passing: Any = None  # the loader whose pass began last
    loaders: dict[str, Any] = field(default_factory=dict)  # every shard loader of the namespace, by name, at that
    hooked: weakref.WeakSet = field(default_factory=weakref.WeakSet)  # optimizers whose hooks are on (not by id)
    optimizers: list[Any] = field(default_factory=list)  # every optimizer of the namespace, as the last pass began
    models: dict[str, Any] = field(default_factory=dict)  # the module whose parameters each holds, by name (each once)
    lacking: str = ""  # an optimizer whose parameters no module of the namespace holds: why nothing can be given
    begun: int = 0  # optimizer steps begun / completed since the hooks went on
    done: int = 0
    at: int = 0  # steps completed at the last exact part
    ended: bool = False  # a pass over a loader ended since the last exact part
    part_cell: int = -1  # the cell (engine/state.py's count) the last exact part was taken in
    stepped: list[Any] = field(default_factory=list)  # optimizers that stepped since the last exact part
    looped: list[Any] = field(default_factory=list)  # those that stepped between the two exact parts before
    undo: list[Undo] = field(default_factory=list)  # the optimizers as they were at the last exact part
    # This rank's own part by the optimizer steps completed when the loop is at it: (exact, part); exact at a
    # step boundary, taken just before the step otherwise (what the next boundary will be, but for extra=).
    parts: dict[int, tuple[bool, bytes]] = field(default_factory=dict)
    mirrors: dict[int, tuple[int, bool, bytes]] = field(default_factory=dict)  # kept for another: (whose, exact, part)
    saved_state: dict[str, str] = field(default_factory=dict)  # the last save_checkpoint's state= names: key -> name
    saved_extra: str | None = None  # and its extra= dict's name
    exchange: tuple[Any, int, Any, int] | None = None  # in flight: (receive, from, the send not waited for, generation)
    group: Any = None  # the pair groups of the last exchange (control.pair_groups)
    capacity_of: Any = None  # the group the buffers below were agreed in
    out: torch.Tensor | None = None
    into: torch.Tensor | None = None
    held: Held | None = None  # what recovery took before the setup cells replaced the objects
    queue: queue.Queue = field(default_factory=queue.Queue)  # exchanges for the sender thread (``_send``)
    sender: threading.Thread | None = None
    failed: threading.Event | None = None  # the exchange that raised (the world broke), and why
    why: str = ""
    last_sent: threading.Event | None = None
    generation: int = 0  # a rebuilt world or a new loop's optimizer: exchanges of an older one are dropped

    def new_loop(self) -> None:
        """Nothing kept so far counts: a new optimizer's loop, a world that grows, or a restore that was made."""
        self.begun, self.done, self.at, self.parts, self.mirrors, self.exchange = 0, 0, 0, {}, {}, None
        self.stepped, self.looped, self.undo, self.ended, self.part_cell = [], [], [], False, -1
        self.generation += 1

    def complete(self, also: Any = None) -> bool:
        """Every optimizer of the batch before stepped in this one (``also``: counting one about to step): a step
        now is past the batch's last (or, with ``also``, is its last)."""
        stepped = [*self.stepped, also] if also is not None else self.stepped
        return bool(self.looped) and all(_among(o, stepped) for o in self.looped)

    def roll_back(self) -> None:
        """Between two steps of one batch (a GAN's): the optimizers that stepped go back to the last exact part."""
        for undo in reversed(self.undo):
            undo.put_back()
        self.begun = self.done = self.at
        self.stepped, self.undo = [], []


KEPT = Kept()


def _among(obj: Any, objs: list[Any]) -> bool:
    return any(o is obj for o in objs)


def enabled() -> bool:
    return (
        os.environ.get(wire.PEER_ENV) == "1"
        and dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size() > 1
    )


def watch(loader: Any) -> None:
    """A pass over a ``shard`` loader begins: find the optimizers, their models and the loaders in the namespace,
    hook the optimizers not hooked yet."""
    if not enabled():
        return
    ns = namespace()
    optimizers, models, lacking = find(ns)
    KEPT.optimizers, KEPT.models, KEPT.lacking = optimizers, models, lacking
    KEPT.loaders = {k: v for k, v in ns.items() if isinstance(v, type(loader)) and not k.startswith("_")}
    KEPT.passing = loader
    fresh = [o for o in optimizers if o not in KEPT.hooked]
    if fresh:
        KEPT.new_loop()
    for optimizer in fresh:
        KEPT.hooked.add(optimizer)
        optimizer.register_step_pre_hook(_before_step)
        optimizer.register_step_post_hook(_after_step)


def find(ns: dict[str, Any]) -> tuple[list[Any], dict[str, Any], str]:
    """Every optimizer in the namespace, the modules whose parameters they hold by their names (for each the
    smallest: not a wrapper around more; each module once), and why not, in a few words, when one's module is
    not there."""
    optimizers = [v for k, v in ns.items() if isinstance(v, torch.optim.Optimizer) and not k.startswith("_")]
    optimizers = list({id(o): o for o in optimizers}.values())
    modules = [(k, v) for k, v in ns.items() if isinstance(v, torch.nn.Module) and not k.startswith("_")]
    models: dict[str, Any] = {}
    for optimizer in optimizers:
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        holding = [(k, m) for k, m in modules if params <= {id(p) for p in m.parameters()}]
        if not holding:
            return optimizers, {}, f"no module of the namespace holds the parameters of {name_of(optimizer)}"
        name, model = min(holding, key=lambda km: len(list(km[1].parameters())))
        if not _among(model, list(models.values())):
            models[name] = model
    return optimizers, models, ""


def boundary(loader: Any, first: bool = False) -> None:
    """A step boundary of a pass over ``loader`` (before its next batch is read; ``first``: before the pass reads
    anything): keep this rank's own part, exact, and send it to the buddy without waiting (it has the whole step to
    arrive). Only where an optimizer stepped since the last one, or a pass begins: between two steps of gradient
    accumulation the gradients summed so far are in no part."""
    if not KEPT.optimizers or not enabled() or not (first or KEPT.stepped):
        return
    if first and not KEPT.stepped and KEPT.ended and KEPT.part_cell == STATE.cell:
        # A pass begins where the last one ended in this cell, no step between: that place has its part, taken at
        # the end of that pass. A second, at the same step count but another loader position, could leave a buddy
        # holding the first and the living ranks the second: a restarted rank would then read one batch fewer
        # (an empty pass) and pair its exchanges off by one.
        return
    KEPT.looped = KEPT.stepped or KEPT.looped
    KEPT.ended, KEPT.part_cell = False, STATE.cell
    KEPT.stepped, KEPT.undo, KEPT.at = [], [], KEPT.done
    data = own_part(with_extra=True)
    _keep(KEPT.parts, KEPT.done, (True, data))
    _send(KEPT.done, True, data, wait=False)


def pass_over() -> None:
    """A pass over a loader ended (its last batch was read)."""
    KEPT.ended = True


def saved(names: dict[str, Any]) -> None:
    """``save_checkpoint`` names its ``state=`` objects and ``extra=`` dict: a peer gives them too."""
    KEPT.saved_state, KEPT.saved_extra = dict(names.get("state") or {}), names.get("extra")


def _before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """Just before the batch's last step: this rank's part as the next boundary will be (``extra=`` not yet updated
    for this step, so left out), sent to the buddy; the step waits until it has left and the source's part for the
    step has come, and is not taken when either failed: a rank that took its step left its part behind and holds its
    source's, and a rank whose buddy or source died stays with the dead rank, at the step whose boundary part it
    sent (one that waited for its send alone could step past a source killed before its own part left). Before an
    earlier step of the batch (or any step of the loop's first batch): the optimizer as it is, to go back to."""
    if not _among(optimizer, KEPT.optimizers) or not enabled():
        return
    after = KEPT.begun + 1
    if not KEPT.complete(also=optimizer):
        if not any(u.optimizer is optimizer for u in KEPT.undo):
            KEPT.undo.append(Undo.take(optimizer))
        atomic.hold()  # until _after_step: a release's KeyboardInterrupt never leaves the parameters half updated
        KEPT.begun = after
        return
    data = own_part(with_extra=False)
    sent = _send(after, False, data, wait=True)
    if not sent.wait(SEND_WAIT_S) or KEPT.failed is sent:
        raise RuntimeError(
            f"nbdist: rank {dist.get_rank()} could not trade parts with its buddy and source ({KEPT.why or 'no answer'})"
        )
    atomic.hold()
    KEPT.begun = after
    if after not in KEPT.parts:
        _keep(KEPT.parts, after, (False, data))


def _after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    if _among(optimizer, KEPT.optimizers):
        KEPT.done += 1
        if not _among(optimizer, KEPT.stepped):
            KEPT.stepped.append(optimizer)
        if KEPT.passing is not None:
            KEPT.loader = KEPT.passing
    atomic.let_go()  # the step is whole: a SIGINT that came during it raises KeyboardInterrupt now


def _send(index: int, exact: bool, data: bytes, wait: bool) -> threading.Event:
    """Hand an exchange to this rank's sender thread: gloo's point-to-point calls take about 1.5 ms each on
    the 2-core CI machine beside a training step (benchmarks/recovery.py), and the boundary's need not be
    waited for. The groups are taken here, on the training thread: new ones are made by every rank at once."""
    sender = KEPT.sender
    if sender is None or not sender.is_alive():
        sender = threading.Thread(target=_sender, args=(KEPT.queue,), name="nbdist-peer", daemon=True)
        KEPT.sender = sender
        sender.start()
    rank, size = dist.get_rank(), dist.get_world_size()
    pairs = control.pair_groups("peer", buddy(rank, size), source_of(rank, size))
    if pairs is not KEPT.group:  # a world rebuilt since the last exchange (a release, a restart)
        KEPT.group, KEPT.generation, KEPT.exchange = pairs, KEPT.generation + 1, None
    done = threading.Event()
    KEPT.queue.put((KEPT.generation, pairs, index, exact, data, wait, done))
    KEPT.last_sent = done
    return done


def _sender(items: queue.Queue) -> None:
    while True:
        generation, pairs, index, exact, data, wait, done = items.get()
        try:
            if generation != KEPT.generation:  # of a world or loop since replaced: dropped
                raise RuntimeError("an exchange of a world since rebuilt")
            _exchange(pairs, generation, index, exact, data, wait)
        except Exception as exc:  # the world broke: what was in flight stays as it is for hold()
            KEPT.failed, KEPT.why = (
                done,
                f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}",
            )
        finally:
            done.set()


def _keep(kept: dict[int, Any], index: int, value: Any) -> None:
    kept[index] = value
    for old in sorted(kept)[:-KEEP]:
        del kept[old]


def own_part(with_extra: bool) -> bytes:
    """What this rank alone holds, as the next step will begin with it (peer_part.py)."""
    extra = namespace().get(KEPT.saved_extra or "") if with_extra else None
    main = KEPT.loader if KEPT.loader is not None else KEPT.passing
    at = (main.step, main.passes()) if main is not None else (0, 0)
    return peer_part.take(KEPT.loaders, KEPT.models, copy.deepcopy(extra) if isinstance(extra, dict) else None, *at)


def buddy(rank: int, size: int) -> int:
    """The rank that keeps ``rank``'s part: one of another host where ranks are placed host by host
    (LOCAL_WORLD_SIZE apart), so a lost host does not take its ranks' parts along; else the next rank."""
    return (rank + _offset(size)) % size


def source_of(rank: int, size: int) -> int:
    """The rank whose part ``rank`` keeps (``rank`` is its buddy)."""
    return (rank - _offset(size)) % size


def _offset(size: int) -> int:
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return local if 0 < local < size else 1


def _exchange(
    pairs: tuple[control.Pair, control.Pair], generation: int, index: int, exact: bool, data: bytes, wait: bool
) -> None:
    """Finish the last exchange (keep the part it brought), then send this one to the buddy; ``wait`` until it
    has left and the source's has come. Every rank sends at the same points (each boundary, each step), so they pair.
    One buffer each way per world, agreed in size at the first exchange by the two ranks of each pair (``pairs``:
    this rank and its buddy, its source and this rank): a header (length, index, exact) and the part."""
    rank, size = dist.get_rank(), dist.get_world_size()
    to, came = pairs
    finish(wait=True)
    if generation != KEPT.generation:
        raise RuntimeError("an exchange of a world since rebuilt")
    if KEPT.capacity_of is not pairs:  # first exchange in this world: agree on sizes
        out_room, in_room = (most * 2 + SLACK for most in control.pair_max(pairs, len(data) + HEADER))
        KEPT.capacity_of = pairs
        KEPT.out, KEPT.into = torch.zeros(out_room, dtype=torch.uint8), torch.zeros(in_room, dtype=torch.uint8)
    out, into = KEPT.out, KEPT.into
    assert out is not None and into is not None
    fits = len(data) + HEADER <= out.numel()  # else the buddy learns that it holds nothing for this point
    out[:HEADER].view(torch.int64).copy_(torch.tensor([len(data) if fits else -1, index, int(exact)]))
    if fits:
        out.numpy()[HEADER : HEADER + len(data)] = np.frombuffer(data, dtype=np.uint8)
    sent = to.group.send([out], to.other, 0)  # the group's own numbers for the ranks
    got = came.group.recv([into], came.other, 0)
    source = source_of(rank, size)
    if not wait:
        KEPT.exchange = (got, source, sent, generation)
    elif _waited(generation, sent, got):  # both, before the step (_before_step); each gloo work waited for once only
        KEPT.exchange = (None, source, None, generation)
        finish(wait=True)  # keep what came
    else:
        raise RuntimeError("the world was rebuilt while this rank's part was leaving")


def _waited(generation: int, *works: Any) -> bool:
    """Wait for sends and receives until they complete (True) or their world is replaced (False); a broken
    world raises. Looked at in bounded steps: an exchange between two living ranks of a broken world never
    completes, and must not hold the sender thread when the rebuilt world needs it. The wait itself is
    gloo's untimed one, on a thread of its own (control.aside): a gloo wait given a timeout closes every connection of the
    group when it times out ("Application timeout caused pair closure"), so with 0.5 s waits a part that
    took longer to leave (a loaded machine, a large part) broke the world, and the next step failed with
    "could not leave its part with its buddy" (32 ranks on 2 cores, twice in 30 recoveries)."""
    done, failed = control.aside(*works)
    while not done.wait(WAIT_STEP_S):
        if generation != KEPT.generation:
            return False  # the thread waits on until the old world's connections break or its timeout
    if failed:
        raise failed[0]
    return True


def finish(wait: bool) -> None:
    """Keep the part the receive in flight brought (``wait``: it must come; otherwise only if it came)."""
    pending, KEPT.exchange = KEPT.exchange, None
    if pending is None:
        return
    got, source, sent, generation = pending
    if generation != KEPT.generation:
        return
    try:
        if wait and got is not None:  # (None: waited for already, _exchange)
            if not _waited(generation, *[w for w in (sent, got) if w is not None]):
                return
        elif got is not None:  # the world is broken: what arrived has arrived (gloo says so only when waited on)
            got.wait(timeout=datetime.timedelta(seconds=AFTER_S))
    except Exception:
        return
    into = KEPT.into
    if into is None:
        return
    length, index, exact = into[:HEADER].view(torch.int64).tolist()
    if length >= 0 and (exact or index not in KEPT.mirrors):
        _keep(KEPT.mirrors, index, (source, bool(exact), into.numpy()[HEADER : HEADER + length].tobytes()))


def namespace() -> dict[str, Any]:
    try:
        from IPython import get_ipython

        return get_ipython().user_ns  # type: ignore[union-attr,no-any-return]
    except Exception:
        return {}


def name_of(obj: Any) -> str | None:
    return next((k for k, v in namespace().items() if v is obj and not k.startswith("_")), None)
