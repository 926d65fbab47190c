"""The Ray launcher's world, in its driver process (ray.py's ``main``): the ranks' actors on the Ray nodes, in
groups (the first engine set's, and each later one's: ``%dist_restart``, recovery, ``%dist_grow``), and one warm
process per node.

A group is placed all at once or not at all (a placement group, ``PACK``: ranks of a node together), ordered node
by node, and started as one actor per rank in its own bundle of the placement group. The world holds its placement
groups until it ends: no other job takes the CPUs between the placement and the actors, and a rank whose engine
ended leaves its bundle to the world (``free``), where a later group (``%dist_restart``, recovery, ``%dist_grow``)
is placed first, on the same node, before any new placement group is asked for. A node that leaves while a group
is placed or started on it (NodeLeft) fails that start in one line, once Ray calls the node dead.

Warm starts: on each node that holds CPU ranks, a node actor (no CPU of its own) runs nbdist's warm process
(``python -m nbdist.engine.warm``, as the local launcher's pool does), which imports torch once and forks each
rank's engine in milliseconds (the actors' code: rayactors.py). A rank's actor asks it for a fork; the engine watches that actor (it ends with it,
as a child started cold ends with its actor through PDEATHSIG). The node's warm process lives as long as the
world's driver, so a rank replaced later on the same node (a restart, a recovery, a grown world) is a fork: no
interpreter, no torch import. The first group's ranks start cold, each importing torch in its own process, and the
node actors are made once the kernel says the world formed (``warm_up``): made before, each was one more Ray worker
to boot (``import ray``: 3 s of a core) and one more torch import between the placement and the first fork, on the
start's path; on the two 2-CPU test nodes a first start took 37-46 s that way, against 23-34 s cold and raw Ray's
26-28 s in the same hour. GPU ranks start cold: a process forked from one that looked at CUDA may not use it, and
the warm process is not theirs to vouch for. ``NBDIST_WARM=0`` starts every rank cold.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable
from typing import Any

from .rayactors import Engine, NodeWarm

RANK_VAR = "NBDIST_LAUNCH_RANK"
MISSES = 3  # polls in a row an actor may leave unanswered (30 s each) before it is taken for gone


class NodeLeft(RuntimeError):
    """A Ray node left while ranks were placed or started on it: the whole line to say (no rank of the group runs)."""


def warm_enabled() -> bool:
    """``NBDIST_WARM=0`` turns warm starts off: every rank starts cold (a fresh interpreter in its actor)."""
    return os.environ.get("NBDIST_WARM", "1").strip().lower() not in ("0", "false", "no", "off")


def gone(error: BaseException, misses: int, node_alive: bool) -> bool:
    """Whether a rank's actor whose poll failed with ``error`` (its ``misses``-th failure in a row) is gone: Ray says
    it died, or its node left, or it failed MISSES polls in a row. A slow answer (GetTimeoutError, from a loaded
    node) or a failed Ray Client call is asked again at the next poll: letting the actor go ends a living engine."""
    from ray.exceptions import ActorDiedError

    return isinstance(error, ActorDiedError) or not node_alive or misses >= MISSES


def missing(need: dict[str, float], total: dict[str, float]) -> str:
    """What the cluster lacks for ``need`` at all (its whole size, not what is free now), in words; ''."""
    short = [
        f"{need[k] - total.get(k, 0):g} {k} (it has {total.get(k, 0):g} of the {need[k]:g} asked)"
        for k in need
        if need[k] and total.get(k, 0) < need[k]
    ]
    return ", ".join(short)


class World:
    """The driver's actors: groups of ranks, and the nodes' warm processes (see the module's docstring)."""

    def __init__(self, ray: Any, cpus: float, gpus: float, env: dict[str, str]) -> None:
        self.ray, self.cpus, self.gpus, self.env = ray, cpus, gpus, env
        self.lock = threading.Lock()
        self.groups: dict[int, dict[int, Any]] = {}  # group -> rank -> its actor, while it lives
        self.worst: dict[int, int] = {}  # group -> the worst exit code of its engines so far
        self.warm: dict[str, Any] = {}  # node id -> its warm actor
        self.python = ""  # the engines' Python (the first group's command), for warm_up
        self.warm_asked = threading.Event()  # the kernel's world formed: poll makes the warm actors (warm_up)
        self.logs = Logs()  # the engines' output, relayed to this process's own
        self.actors: list[Any] = []  # every rank's actor made, for clean_up
        self.pending: list[Any] = []  # the placement groups this world holds, removed at clean_up
        self.bundle: dict[int, Slot] = {}  # id(actor) -> the bundle it was placed in
        self.free: list[Slot] = []  # bundles the world holds whose rank's engine ended
        self.misses: dict[int, int] = {}  # id(actor) -> its polls left unanswered in a row (see gone())
        self.starting: set[int] = set()  # groups not yet started (poll leaves them be)
        self.next_group = 0
        self.closed = False  # no placement may wait any longer
        self.cleaned = False

    def cannot_hold(self, n: int) -> str:
        """'' when the cluster has the CPUs and GPUs for ``n`` ranks at all (if not all free now), else the line
        that says what it lacks and what to do."""
        short = missing({"CPU": self.cpus * n, "GPU": self.gpus * n}, self.ray.cluster_resources())
        if not short:
            return ""
        return (
            f"the Ray cluster cannot hold {n} rank(s) of {self.cpus:g} CPU"
            + (f" and {self.gpus:g} GPU" if self.gpus else "")
            + f" each: it lacks {short}. Start fewer ranks (-n), add Ray nodes"
            + (", or ask fewer CPUs per rank (--threads)." if self.cpus > 1 else ".")
        )

    def start(
        self,
        n: int,
        command: list[str],
        say: Callable[[str], None],
        waiting: Callable[[str], None],
        placed: Callable[[], None] = lambda: None,
        gone: Callable[[], bool] = lambda: False,
        env: dict[str, str] | None = None,
    ) -> int:
        """Place ``n`` ranks, start their engines (``command``), and return the group's id. ``waiting`` hears
        what the placement waits for; ``gone()`` true abandons a placement that waits (its caller left). ``env``: what
        the engine set that asked passes its engines (default: the first one's)."""
        with self.lock:
            gid, self.next_group = self.next_group, self.next_group + 1
            self.groups[gid], self.worst[gid] = {}, 0
            self.starting.add(gid)
        try:
            self._start(gid, n, command, say, waiting, placed, gone, self.env if env is None else env)
        except BaseException:
            self.stop_group(gid)
            raise
        finally:
            with self.lock:
                self.starting.discard(gid)
        return gid

    def _start(
        self,
        gid: int,
        n: int,
        command: list[str],
        say: Callable[[str], None],
        waiting: Callable[[str], None],
        placed: Callable[[], None],
        gone: Callable[[], bool],
        env: dict[str, str],
    ) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self.ray
        slots = self._take_free(n)
        try:
            while len(slots) < n:  # a placement that waits gives way to bundles the world gets back meanwhile
                slots += self._place(n - len(slots), waiting, gone) or self._take_free(n - len(slots))
        except BaseException:
            with self.lock:
                self.free += slots  # still the world's
            raise
        placed()
        ip = {
            node["NodeID"]: tuple(int(p) for p in node["NodeManagerAddress"].split(".") if p.isdigit())
            for node in ray.nodes()
        }
        slots.sort(key=lambda slot: ip.get(slot.node, ()))  # a node's ranks together, nodes by address
        self.python = self.python or command[0]
        # the first group starts cold: its nodes' warm processes come after the world formed (warm_up)
        warm = {slot.node: self._warm_on(slot.node, command[0]) if gid else None for slot in slots}
        engine = ray.remote(Engine)
        actors = []
        for slot in slots:
            where = PlacementGroupSchedulingStrategy(placement_group=slot.group, placement_group_bundle_index=slot.index)
            actor = engine.options(num_cpus=self.cpus, num_gpus=self.gpus, scheduling_strategy=where).remote()
            self.bundle[id(actor)] = slot
            actors.append(actor)
        self.actors += actors
        with self.lock:
            self.groups[gid] = dict(enumerate(actors))
        logs = [self.logs.add(env, f"ray-engine-{gid}-{r}.log") for r in range(n)]
        calls = [
            a.start.remote(command, {**env, RANK_VAR: str(r)}, warm[slot.node], logs[r])
            for r, (slot, a) in enumerate(zip(slots, actors, strict=True))
        ]
        used, waiting_on = {slot.node for slot in slots}, list(calls)
        while waiting_on:  # an actor whose bundle's node left would wait for it forever
            waiting_on = ray.wait(waiting_on, num_returns=len(waiting_on), timeout=0.5)[1]
            if waiting_on:
                self._check_nodes(n, used, "started")
        try:
            started = ray.get(calls)
        except Exception:  # an actor that died with its node
            self._check_nodes(n, used, "started")
            raise
        for rank, (host, pid, forked) in enumerate(started):
            say(f"nbdist: launch rank {rank} on {host}, pid {pid}" + (" (forked warm)" if forked else ""))

    def _place(self, n: int, waiting: Callable[[str], None], gone: Callable[[], bool]) -> list[Slot]:
        """A new placement group of ``n`` bundles, all placed or none (it waits while Ray cannot); its bundles, or []
        when, while it waited, a rank's engine ended and gave the world back a bundle (the group is removed: the
        ranks just replaced, by %dist_restart for one, hold the CPUs it waits for)."""
        from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

        ray = self.ray
        bundle = {"CPU": self.cpus, **({"GPU": self.gpus} if self.gpus else {})}
        group = placement_group([bundle] * n, strategy="PACK")
        self.pending.append(group)
        alive = {node["NodeID"] for node in ray.nodes() if node.get("Alive")}  # the nodes it may be placed on
        while not ray.wait([group.ready()], timeout=0.5)[0]:
            if gone() or self.closed:
                raise RuntimeError("the placement was abandoned")
            self._check_nodes(n, alive, "placed")
            if self._prune_free():
                remove_placement_group(group)
                self.pending.remove(group)
                return []
            free = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
            waiting(f"Ray has not placed the {n} rank(s) yet ({bundle} each; free now: {free})")
        waiting("")
        nodes = placement_group_table(group)["bundles_to_node_id"]
        return [Slot(group, i, nodes[i]) for i in range(n)]

    def _check_nodes(self, n: int, used: set[str], doing: str) -> None:
        """NodeLeft when a node of ``used`` left while ``n`` ranks were being ``doing`` (placed: once the rest can't)."""
        nodes = self.ray.nodes()
        left = sorted(node["NodeID"] for node in nodes if not node.get("Alive") and node["NodeID"] in used)
        short = self.cannot_hold(n) if left else ""
        if not left or (doing == "placed" and not short):
            return
        what = short.replace("the Ray cluster", "The Ray cluster now", 1) if short else (
            "The nodes left could hold them: start them again once Ray has the CPUs free (`ray status` shows them)."
        )
        gone = ", ".join(f"{x['NodeManagerHostname']} ({x['NodeManagerAddress']})" for x in nodes if x["NodeID"] in left)
        raise NodeLeft(f"Ray node {gone} left the cluster while {n} rank(s) were being {doing}; none started. {what}")

    def _take_free(self, n: int) -> list[Slot]:
        """Up to ``n`` of the world's free bundles."""
        self._prune_free()
        with self.lock:
            taken, self.free = self.free[:n], self.free[n:]
        return taken

    def _prune_free(self) -> int:
        """Forget the free bundles of nodes that left (Ray places them again elsewhere, when it can: a new placement
        group is asked for instead); how many are left."""
        alive = {node["NodeID"] for node in self.ray.nodes() if node.get("Alive")}
        with self.lock:
            self.free = [slot for slot in self.free if slot.node in alive]
            return len(self.free)

    def warm_up(self) -> None:
        """Make the warm actor of each node that holds a rank of the world (the kernel asks once the world formed),
        so that a rank started there later is a fork; nothing where ranks start cold. Safe to call again."""
        with self.lock:
            nodes = sorted({slot.node for slot in self.bundle.values()})
        for node in nodes:
            if not self.closed and self.python:
                self._warm_on(node, self.python)

    def _warm_on(self, node: str, python: str) -> Any:
        """The node's warm actor (made on first use), or None where ranks start cold."""
        if self.gpus or not warm_enabled():
            return None
        with self.lock:
            if node not in self.warm:
                from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

                actor = self.ray.remote(NodeWarm).options(
                    num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
                )
                self.warm[node] = actor.remote(python, self.env)
            return self.warm[node]

    def poll(self, say: Callable[[str], None]) -> list[tuple[int, int]]:
        """Let go of the actors whose engine ended (its CPUs and GPUs are free at once for a replacement);
        return the groups that have no live rank left, each with its worst exit code."""
        ray = self.ray
        if self.warm_asked.is_set():  # here, in the loop that polls, not in the thread that heard the kernel
            self.warm_asked.clear()
            self.warm_up()
        with self.lock:
            live = [(gid, rank, actor) for gid, ranks in self.groups.items() for rank, actor in ranks.items()]
        refs = [actor.poll.remote() for _, _, actor in live]
        for (gid, rank, actor), ref in zip(live, refs, strict=True):
            try:
                code = ray.get(ref, timeout=30)
                self.misses.pop(id(actor), None)
            except Exception as error:  # the actor or its node may be gone, or only slow to answer
                misses = self.misses[id(actor)] = self.misses.get(id(actor), 0) + 1
                code = -1 if gone(error, misses, self._node_alive(actor)) else None
                if code is None:
                    say(f"nbdist: launch rank {rank}'s actor did not answer ({type(error).__name__}); asked again")
            if code is not None:
                self.misses.pop(id(actor), None)
                say(f"nbdist: launch rank {rank}'s engine ended ({code}); its actor is let go, its bundle kept")
                _forget(ray, actor)
                self._bundle_back(actor)
                with self.lock:  # a group whose start failed meanwhile was ended by stop_group, in another thread
                    self.groups.get(gid, {}).pop(rank, None)
                    self.worst[gid] = max(self.worst.get(gid, 0), abs(code))
        self.logs.relay(say)  # after the polls: what an engine wrote before it ended is said before its end is
        with self.lock:
            ended = [(g, self.worst[g]) for g, ranks in self.groups.items() if not ranks and g not in self.starting]
            for g, _ in ended:
                del self.groups[g]
        return ended

    def _node_alive(self, actor: Any) -> bool:
        """Whether Ray still calls the node of this rank's bundle alive (True where it cannot say)."""
        slot = self.bundle.get(id(actor))
        try:
            return slot is None or any(n["NodeID"] == slot.node and n.get("Alive") for n in self.ray.nodes())
        except Exception:
            return True

    def stop_group(self, gid: int) -> None:
        """End a group's engines and actors (its caller left)."""
        with self.lock:
            ranks = self.groups.pop(gid, {})
        for actor in ranks.values():
            _stop(self.ray, actor)
            self._bundle_back(actor)

    def _bundle_back(self, actor: Any) -> None:
        """An actor that ended leaves its bundle to the world (``free``), for the next rank placed."""
        with self.lock:
            if id(actor) in self.bundle:
                self.free.append(self.bundle.pop(id(actor)))

    def busy(self) -> bool:
        with self.lock:
            return bool(self.groups)

    def clean_up(self) -> None:
        """End every engine and actor this driver made and remove its placement groups; safe to call twice."""
        from ray.util.placement_group import remove_placement_group

        if self.cleaned:
            return
        self.cleaned = self.closed = True
        for actor in self.actors:
            _stop(self.ray, actor)
        for actor in self.warm.values():  # the warm processes end with their actors (PDEATHSIG)
            _forget(self.ray, actor)
        for group in list(self.pending):
            try:
                remove_placement_group(group)
            except Exception:
                pass


class Logs:
    """The engines' output files, in the cluster's private directory (the nodes see it, as they see its connection
    file), relayed line by line to the driver's own output, where the kernel reads an engine's last lines when it
    did not start. Ray's own relay of its workers' output (``ray.init(log_to_driver=True)``) is not used: through
    Ray Client it cost 2-3 s of every connection (8.1-8.9 s against 5.3-6.1 s, alternated, on the test nodes)."""

    def __init__(self) -> None:
        self.read: dict[str, int] = {}  # a file -> how much of it was relayed
        self.lock = threading.Lock()

    def add(self, env: dict[str, str], name: str) -> str:
        """The file for one engine's output ('' without a cluster directory: the engine writes to its actor's)."""
        where = env.get("NBDIST_CLUSTER_DIR", "")
        if not where:
            return ""
        path = os.path.join(where, name)
        with self.lock:
            self.read.setdefault(path, 0)
        return path

    def relay(self, say: Callable[[str], None]) -> None:
        """Say each whole line written since the last call."""
        with self.lock:
            for path, done in self.read.items():
                try:
                    with open(path, "rb") as fh:
                        fh.seek(done)
                        new = fh.read()
                except OSError:
                    continue
                whole = new[: new.rfind(b"\n") + 1]
                self.read[path] = done + len(whole)
                for line in whole.decode(errors="replace").splitlines():
                    say(line)


@dataclasses.dataclass(frozen=True)
class Slot:
    """One bundle (a rank's CPUs and GPUs) of a placement group the world holds, and the node it is on."""

    group: Any
    index: int
    node: str


def _stop(ray: Any, actor: Any) -> None:
    try:
        ray.get(actor.stop.remote(), timeout=5)
    except Exception:  # gone already (let go), or its node is
        pass
    _forget(ray, actor)


def _forget(ray: Any, actor: Any) -> None:
    try:
        ray.kill(actor)
    except Exception:
        pass
