"""A world kept past its kernel (``%dist_start --keep``) and found again (``%dist_attach``).

The ranks and the controller outlive the kernel for at most ``keep`` seconds of idleness: each process
waits until the cluster's lease file has gone untouched that long (``engine/parentwatch.py``). The
attached kernel touches the lease every ``TOUCH_S`` (``Keeper``), and an engine touches it while it runs
a cell, so the timer runs in the world, not in the kernel.

The record of a kept world is one JSON file, 0600, in this user's ``kept_dir()`` (0700): where the
controller's connection file is (0600 beside it, HMAC keys unchanged), the ranks, the world, the
processes by pid and start time, and when it will end. ``find`` reads it in a new kernel, checks that it
is this user's and not past its time, and ``reconnect`` proves the world alive by asking every rank's
engine for its rank and pid now (not by trusting the file). Nothing new listens anywhere.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import pwd
import socket
import threading
import time
from typing import Any

from .. import compat, wire
from ..config import StartConfig
from ..engine import parentwatch, state
from ..errors import ClusterError, ConfigError
from ..launch.launchers import Launcher
from .engineset import EngineSet, RankInfo
from .rendezvous import World

TOUCH_S = 2.0  # how often an attached kernel marks the world as in use
PROVE_S = 10.0  # every rank must answer within this when a kernel attaches


def kept_dir() -> str:
    """Where this user's kept worlds are recorded (NBDIST_KEPT_DIR, else ~/.nbdist/kept), made 0700."""
    path = os.environ.get("NBDIST_KEPT_DIR") or os.path.join(os.path.expanduser("~"), ".nbdist", "kept")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


@dataclasses.dataclass
class Record:
    """What a new kernel needs to reach a kept world, and when that world ends."""

    name: str
    uid: int
    host: str
    started: float
    keep_s: float
    workdir: str
    connection: str
    config: dict[str, Any]
    world: dict[str, Any]
    ranks: list[dict[str, Any]]
    procs: list[list[float]]  # [pid, start time] of the controller and what it started
    jobs: list[str]
    restarts: int

    @property
    def path(self) -> str:
        return os.path.join(kept_dir(), f"{self.name}.json")

    @property
    def lease(self) -> str:
        return os.path.join(self.workdir, wire.LEASE)

    def ends_at(self) -> tuple[float, bool]:
        """When it ends (or ended) if nobody attaches, and whether its lease is still there. The attached
        kernel touches the record beside the lease: once the world is gone with its directory, the record
        still says when it was last attached."""
        for path, there in ((self.lease, True), (self.path, False)):
            try:
                return os.stat(path).st_mtime + self.keep_s, there
            except OSError:
                continue
        return self.started + self.keep_s, False


class Keeper:
    """In the kernel that holds a kept world: writes its record and keeps its lease fresh."""

    def __init__(self, workdir: str, keep_s: float) -> None:
        self.workdir, self.keep_s = workdir, keep_s
        self.record: Record | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def of(cls, record: Record) -> Keeper:
        """The keeper of a world kept before (``attach``): its start time stays the world's."""
        keeper = cls(record.workdir, record.keep_s)
        keeper.record = record
        return keeper

    def save(self, config: StartConfig, world: World, engines: EngineSet, restarts: int) -> Record:
        """Write (again: after a restart the pids change) the record; start touching the lease."""
        ranks = {r.pid for r in engines.ranks}
        found = glob.glob(os.path.join(self.workdir, "profile", "security", "ipcontroller-*client.json"))
        self.record = Record(
            name=os.path.basename(self.workdir),
            uid=os.getuid(),
            host=socket.gethostname(),
            started=self.record.started if self.record else time.time(),
            keep_s=self.keep_s,
            workdir=self.workdir,
            connection=found[0] if found else "",
            config=config.flat(),
            world=dataclasses.asdict(world),
            ranks=[dataclasses.asdict(r) for r in engines.ranks],
            procs=[
                [pid, born]
                for pid in engines.pids()
                if pid not in ranks and (born := parentwatch.start_time(pid)) is not None
            ],
            jobs=engines.job_ids(),
            restarts=restarts,
        )
        every = [r.rank for r in engines.ranks]
        told = engines.call(every, parentwatch.keep_world, self.workdir, self.keep_s, timeout=engines.config.world.timeout)
        told.ordered("keeping the world", every)
        wire.write_private(self.record.path, json.dumps(dataclasses.asdict(self.record), indent=1))
        self.touch()
        if self._thread is None:
            self._thread = threading.Thread(target=self._beat, name="nbdist-keep", daemon=True)
            self._thread.start()
        return self.record

    def touch(self) -> None:
        parentwatch.touch(os.path.join(self.workdir, wire.LEASE))
        if self.record is not None:
            try:  # a sign of life on the record, never a new (empty) record once the world's is gone
                os.utime(self.record.path)
            except OSError:
                pass

    def _beat(self) -> None:
        while not self._stop.wait(TOUCH_S):
            self.touch()

    def describe(self) -> str:
        """One line for %dist_status: the world's age, its idle limit, where it is recorded."""
        rec = self.record
        if rec is None:
            return ""
        return (
            f"kept world {rec.name}: {_span(time.time() - rec.started)} old; it outlives this kernel by at most "
            f"{_span(rec.keep_s)} idle (no cell running, no kernel attached), then ends by itself. "
            f"Recorded in {rec.path}; %dist_attach in a new kernel reconnects."
        )

    def forget(self) -> None:
        """The world is being stopped: no more beats, no record."""
        self._stop.set()
        if self.record is not None:
            try:
                os.unlink(self.record.path)
            except FileNotFoundError:
                pass


def find(name: str | None = None) -> Record:
    """This user's kept world on this host (the newest, or the one named), alive and within its time."""
    directory = kept_dir()
    paths = sorted(glob.glob(os.path.join(directory, "*.json")), key=os.path.getmtime, reverse=True)
    if name:
        paths = [p for p in paths if os.path.basename(p) in (name, f"{name}.json")]
    if not paths:
        what = f"no world named {name!r} is kept" if name else "no world is kept"
        raise ConfigError(
            f"{what} in {directory}; start one with %dist_start -n 2 --keep 30m, then restart the kernel."
        )
    ended: list[str] = []
    for path in paths:
        owner = os.stat(path).st_uid
        if owner != os.getuid():
            raise ConfigError(
                f"the kept world in {path} belongs to user {_user(owner)}, not to you ({_user(os.getuid())}); "
                "only the user who started a world can attach to it. Start your own with %dist_start --keep 30m."
            )
        try:
            with open(path) as fh:
                record = Record(**json.load(fh))
        except (OSError, ValueError, TypeError):
            continue  # not a whole record (gone meanwhile, or left empty by a process killed while writing it)
        if record.host != socket.gethostname():
            continue  # a shared home: a world kept on another host is not reachable from here
        ends, there = record.ends_at()
        if not there or ends < time.time() or not any(_alive(pid, born) for pid, born in record.procs):
            ended.append(f"{record.name} (ended {_clock(min(ends, time.time()))})")
            os.unlink(path)  # its processes left by themselves; the record goes with them
            continue
        return record
    raise ConfigError(
        f"the kept world {', '.join(ended)} ran out of time: idle past its --keep, its processes ended by "
        "themselves. Start a new one with %dist_start -n 2 --keep 30m."
        if ended
        else f"no world kept in {directory} runs on this host ({socket.gethostname()})."
    )


def reconnect(record: Record, config: StartConfig, launcher: Launcher) -> EngineSet:
    """Connect a new client to the kept world and prove every rank alive: it answers with its rank and pid."""
    from ipyparallel import Client

    try:
        client = Client(record.connection)
    except Exception as exc:
        raise ClusterError(f"cannot reach the kept world {record.name} ({type(exc).__name__}: {exc}).") from exc
    compat.drop_unreadable_messages(client)
    compat.fast_iso_dates()
    ranks = [RankInfo(**r) for r in record.ranks]
    missing = [r.rank for r in ranks if r.engine_id not in client.ids]
    engines = EngineSet(config, launcher, record.workdir)
    cluster_id = os.path.basename(record.connection).removeprefix("ipcontroller-").removesuffix("-client.json")
    pids = [int(pid) for pid, born in record.procs if _alive(pid, born)]
    engines.adopt(client, ranks, cluster_id, pids, list(record.jobs))  # %dist_restart starts engines from here
    try:
        if missing:
            raise ClusterError(f"rank(s) {missing} of the kept world {record.name} are gone from its controller")
        every = [r.rank for r in ranks]
        answers = engines.call(every, state.whoami, timeout=PROVE_S).ordered("whoami", every)
    except Exception as exc:
        client.close(linger=0)
        raise ClusterError(
            f"the kept world {record.name} did not answer as recorded ({exc}); stop it by starting a new one "
            "(%dist_start), or wait for its idle time to end it."
        ) from None
    for info, (rank, pid) in zip(ranks, answers, strict=True):
        if rank != info.rank or (info.local and pid != info.pid):
            client.close(linger=0)
            raise ClusterError(
                f"engine {info.engine_id} of the kept world answered as rank {rank} (pid {pid}), not as rank "
                f"{info.rank} (pid {info.pid}); it is not the world that was kept."
            )
    return engines


def keep(
    keeper: Keeper | None,
    config: StartConfig,
    workdir: str,
    world: World | None,
    engines: EngineSet | None,
    restarts: int,
) -> Keeper | None:
    """--keep: write (again, after a restart) what %dist_attach needs and keep the lease fresh; the Keeper (None
    when the world is not kept)."""
    if config.world.keep is None or engines is None or world is None:
        return keeper
    keeper = keeper or Keeper(workdir, float(config.world.keep))
    keeper.save(config, world, engines, restarts)
    return keeper


def _alive(pid: float, born: float) -> bool:
    """The process recorded is still there: the same pid and start time (a reused pid is not it)."""
    return parentwatch.start_time(int(pid)) == born


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _span(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def _clock(at: float) -> str:
    return time.strftime("at %H:%M:%S", time.localtime(at))
