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
rank's engine in milliseconds. A rank's actor asks it for a fork; the engine watches that actor (it ends with it,
as a child started cold ends with its actor through PDEATHSIG). The node's warm process lives as long as the
world's driver, so a rank replaced later on the same node (a restart, a recovery, a grown world) is a fork too:
no interpreter, no torch import. GPU ranks start cold: a process forked from one that looked at CUDA may not use
it, and the warm process is not theirs to vouch for. ``NBDIST_WARM=0`` starts every rank cold.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from . import procs

RANK_VAR = "NBDIST_LAUNCH_RANK"
ENGINE = ["-m", "nbdist.engine"]  # the engine's command is [python, *ENGINE, args...]
FORK_S = 120.0  # the first fork waits while the node's warm process imports torch


class NodeLeft(RuntimeError):
    """A Ray node left while ranks were placed or started on it: the whole line to say (no rank of the group runs)."""


def warm_enabled() -> bool:
    """``NBDIST_WARM=0`` turns warm starts off: every rank starts cold (a fresh interpreter in its actor)."""
    return os.environ.get("NBDIST_WARM", "1").strip().lower() not in ("0", "false", "no", "off")


def missing(need: dict[str, float], total: dict[str, float]) -> str:
    """What the cluster lacks for ``need`` at all (its whole size, not what is free now), in words; ''."""
    short = [
        f"{need[k] - total.get(k, 0):g} {k} (it has {total.get(k, 0):g} of the {need[k]:g} asked)"
        for k in need
        if need[k] and total.get(k, 0) < need[k]
    ]
    return ", ".join(short)


class _Engine:
    """A Ray actor holding one rank's CPUs and GPUs and its engine: a child started cold, or a fork of the node's
    warm process."""

    def start(self, cmd: list[str], env: dict[str, str], warm: Any = None) -> tuple[str, int, bool]:
        import socket
        import subprocess

        self.proc: Any = None
        self.pid = 0
        if warm is not None and cmd[1:3] == ENGINE:
            import ray

            job = {
                "args": cmd[3:],
                "env": {**os.environ, **env, "NBDIST_PARENT_PID": str(os.getpid())},  # the engine ends with us
                "cwd": os.getcwd(),
                "output": f"/proc/{os.getpid()}/fd/1",  # this actor's own log, which Ray forwards to the driver
            }
            pid = ray.get(warm.fork.remote(job), timeout=FORK_S)
            if pid:
                self.pid = pid
                return socket.gethostname(), pid, True
        self.proc = subprocess.Popen(cmd, env={**os.environ, **env}, preexec_fn=_die_with_parent)
        self.pid = self.proc.pid
        return socket.gethostname(), self.pid, False

    def poll(self) -> int | None:
        if self.proc is not None:
            return self.proc.poll()
        return None if procs.alive(self.pid) else 0  # the warm process's child: its status is not ours to read

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        elif procs.alive(self.pid):
            os.kill(self.pid, signal.SIGKILL)


class _NodeWarm:
    """A Ray actor (no CPU of its own) on one node: its child is nbdist's warm process, which forks engines."""

    def __init__(self, python: str, env: dict[str, str]) -> None:
        import subprocess

        self.lock = threading.Lock()
        self.proc = subprocess.Popen(
            [python, "-m", "nbdist.engine.warm"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **env},
            preexec_fn=_die_with_parent,
        )

    def fork(self, job: dict[str, Any]) -> int:
        """The forked engine's pid; 0 when the warm process cannot (the rank then starts cold)."""
        with self.lock:
            if self.proc.poll() is not None:
                return 0
            try:
                return max(procs.ask_fork(self.proc, job, FORK_S), 0)
            except (OSError, TimeoutError, EOFError, procs.ForkRefused):  # refused: it stays unsafe
                self.proc.kill()
                return 0


def _die_with_parent() -> None:
    """In the child, before it runs: end with the actor that started it (prctl PR_SET_PDEATHSIG), and take
    signals as a process of its own would: a Ray worker ignores SIGINT, and an ignored signal stays ignored
    across exec, so the engine would never see an interrupt (Python installs its SIGINT handler only where the
    signal is at its default)."""
    import ctypes

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


class World:
    """The driver's actors: groups of ranks, and the nodes' warm processes (see the module's docstring)."""

    def __init__(self, ray: Any, cpus: float, gpus: float, env: dict[str, str]) -> None:
        self.ray, self.cpus, self.gpus, self.env = ray, cpus, gpus, env
        self.lock = threading.Lock()
        self.groups: dict[int, dict[int, Any]] = {}  # group -> rank -> its actor, while it lives
        self.worst: dict[int, int] = {}  # group -> the worst exit code of its engines so far
        self.warm: dict[str, Any] = {}  # node id -> its warm actor
        self.actors: list[Any] = []  # every rank's actor made, for clean_up
        self.pending: list[Any] = []  # the placement groups this world holds, removed at clean_up
        self.bundle: dict[int, Slot] = {}  # id(actor) -> the bundle it was placed in
        self.free: list[Slot] = []  # bundles the world holds whose rank's engine ended
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
        warm = {slot.node: self._warm_on(slot.node, command[0]) for slot in slots}
        engine = ray.remote(_Engine)
        actors = []
        for slot in slots:
            where = PlacementGroupSchedulingStrategy(placement_group=slot.group, placement_group_bundle_index=slot.index)
            actor = engine.options(num_cpus=self.cpus, num_gpus=self.gpus, scheduling_strategy=where).remote()
            self.bundle[id(actor)] = slot
            actors.append(actor)
        self.actors += actors
        with self.lock:
            self.groups[gid] = dict(enumerate(actors))
        calls = [
            a.start.remote(command, {**env, RANK_VAR: str(r)}, warm[slot.node])
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

    def _warm_on(self, node: str, python: str) -> Any:
        """The node's warm actor (made on first use), or None where ranks start cold."""
        if self.gpus or not warm_enabled():
            return None
        if node not in self.warm:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            actor = self.ray.remote(_NodeWarm).options(
                num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
            )
            self.warm[node] = actor.remote(python, self.env)
        return self.warm[node]

    def poll(self, say: Callable[[str], None]) -> list[tuple[int, int]]:
        """Let go of the actors whose engine ended (its CPUs and GPUs are free at once for a replacement);
        return the groups that have no live rank left, each with its worst exit code."""
        ray = self.ray
        with self.lock:
            live = [(gid, rank, actor) for gid, ranks in self.groups.items() for rank, actor in ranks.items()]
        refs = [actor.poll.remote() for _, _, actor in live]
        for (gid, rank, actor), ref in zip(live, refs, strict=True):
            try:
                code = ray.get(ref, timeout=30)
            except Exception:  # the actor or its node is gone
                code = -1
            if code is not None:
                say(f"nbdist: launch rank {rank}'s engine ended ({code}); its actor is let go, its bundle kept")
                _forget(ray, actor)
                self._bundle_back(actor)
                with self.lock:
                    self.groups[gid].pop(rank, None)
                    self.worst[gid] = max(self.worst[gid], abs(code))
        with self.lock:
            ended = [(g, self.worst[g]) for g, ranks in self.groups.items() if not ranks and g not in self.starting]
            for g, _ in ended:
                del self.groups[g]
        return ended

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
