"""Engines registering with the controller: wait until the asked number did, or say which ranks have none and why.

A start (or a restart of some ranks) has launched engines; this waits until that many new engine ids are
known to the controller. An engine that could not reach the controller left a line behind
(engine/__main__.py's preflight), said at once; one that exited will never register, so once the others
have, the missing ranks are named with the engine log's last lines (docs/faults.md, row 7); a batch job
still in the queue stops the clock and says what it waits for.
"""

from __future__ import annotations

import glob
import os
import socket
import time
from collections.abc import Callable
from typing import Any, Protocol

from .. import compat
from ..config import StartConfig
from ..engine import steps
from ..errors import ClusterError
from ..launch import procs
from ..launch.launchers import Launcher
from .answers import Answers, Call


class Registering(Protocol):
    """What of an engine set the wait reads (world/engineset.py's EngineSet)."""

    client: Any
    config: StartConfig
    launcher: Launcher
    workdir: str
    progress: Callable[[str], None]
    ranks: list[Any]

    def launchers(self) -> list[Any]: ...

    def call_each(self, calls: dict[int, Call], *, timeout: float, by_engine: bool = False) -> Answers: ...


def check_preflight(engines: Registering) -> None:
    """Fail with the first line an engine wrote when it could not reach the controller (engine/__main__.py)."""
    for path in sorted(glob.glob(os.path.join(engines.workdir, "preflight-*.txt"))):
        try:
            with open(path) as fh:
                line = fh.read().strip()
        except OSError:
            continue
        raise ClusterError(f"{line} {engines.launcher.unreachable_hint()}".strip())


class StillQueued(ClusterError):
    """A replacement's batch job still waits in the queue at the bound --min-ranks puts on it (it is kept)."""


def wait_for_engines(
    engines: Registering, n: int, known: set[int], old_launchers: set[int], ranks: list[int] | None = None
) -> list[int]:
    """Wait until n new engines registered; name the missing ranks if they don't (docs/faults.md, row 7).

    ``known`` are engine ids that existed before, ``old_launchers`` the ids of
    launcher objects that existed before this start (their exits are not news); ``ranks``: the
    ranks these engines are for (replacements), as a failure names them.
    While a batch job waits in the queue the timeout does not run (but for a replacement, with
    --min-ranks: the world goes on without it); the wait is
    reported through ``progress`` and Ctrl-C ends it (the caller cancels the job).
    """
    started = time.monotonic()
    deadline = started + engines.config.world.timeout
    said, said_at, asked_at, listed_at = "", 0.0, 0.0, started
    queued = ""  # the batch queue's last word on the jobs waited for ('' when none waits)
    finished: list[Any] = []
    while True:
        new = sorted(set(engines.client.ids) - known)
        if len(new) >= n:
            return new[:n]
        if time.monotonic() - listed_at >= LIST_EVERY_S:
            listed_at = time.monotonic()
            missed(engines.client)
        launchers = [el for el in engines.launchers() if id(el) not in old_launchers]
        check_preflight(engines)
        now = time.monotonic()
        if engines.launcher.multi_host and now - asked_at >= 1.0:
            asked_at = now
            waiting, finished = engines.launcher.queue(launchers)
            # A queued job does not count against the timeout, but for a replacement that the world can go on
            # without (--min-ranks): its node may be gone for good, so the wait is bounded.
            if waiting and not (known and engines.config.recovery.min_ranks):
                deadline = max(deadline, now + engines.config.world.timeout)
            if waiting and now - started >= 2 and (waiting != said or now - said_at >= 15):
                engines.progress(f"{waiting}; waited {now - started:.0f} s (Ctrl-C cancels it)")
                said, said_at = waiting, now
            queued = waiting
        exited = [el for el in launchers if procs.exited(el) or el in finished]
        # An engine that exited will never register; report once the others have. One launcher
        # of several hosts (mpiexec, srun, a job) carries every engine: its exit ends the wait.
        enough = engines.launcher.multi_host or len(new) >= n - len(exited)
        if (exited and enough) or time.monotonic() > deadline:
            check_preflight(engines)  # written just before those engines exited
            missing = n - len(new)
            first_missing = len(engines.ranks) if known else len(new)
            names = ", ".join(map(str, ranks[len(new) :] if ranks else range(first_missing, first_missing + missing)))
            why = (
                f"{len(exited)} engine process(es) exited while starting"
                if exited
                else f"{queued} for {engines.config.world.timeout:.0f} s"
                if queued
                else f"they did not register within {engines.config.world.timeout:.0f} s"
            )
            logs = exited or (launchers if engines.launcher.multi_host else [])
            tail = _log_tail(getattr(logs[0], "output_file", "")) if logs else ""
            raise (StillQueued if queued and not exited else ClusterError)(
                f"{missing} of {n} engine(s) did not start, so rank(s) {names} have no engine: {why}."
                + where_they_wait(engines, set(engines.client.ids))
                + (f" Engine log: {tail}" if tail else "")
                + _advice()
            )
        time.sleep(0.02)


LIST_EVERY_S = 0.5  # while engines are missing, how often the controller's own list is read


def missed(client: Any) -> list[int]:
    """Engines the controller registered that the client never heard of (their notification was published
    before the client subscribed), now added to the client; their ids. Measured at 64 ranks here: 1 to 3 of
    64 engines in 5 of 13 starts, which then waited for good."""
    try:
        listed = compat.controller_engines(client, timeout=2.0)
    except Exception:  # a controller that does not answer now is asked again at the next look
        return []
    unknown = {eid: uuid for eid, uuid in listed.items() if eid not in set(client.ids)}
    if unknown:
        compat.add_engines(client, unknown)
    return sorted(unknown)


def where_they_wait(engines: Registering, registered: set[int]) -> str:
    """' 64 engine processes said where they are: 53 registered, 9 at "registered; starting its kernel" for
    31 s (pids ...), 2 ended.' from the steps the engines wrote (engine/steps.py); '' when none did."""
    said = steps.read(os.path.join(engines.workdir, "steps"))
    if not said:
        return ""
    here = socket.gethostname()
    now = time.time()
    waiting: dict[str, list[dict[str, Any]]] = {}
    ended = taken = 0
    for entry in said.values():
        if entry["step"] == steps.BEATING and entry["engine_id"] in registered:
            taken += 1
        elif entry["host"] == here and not procs.alive(entry["pid"]):
            ended += 1
        else:
            waiting.setdefault(entry["step"], []).append(entry)
    parts = [f"{taken} registered"]
    for step, entries in sorted(waiting.items(), key=lambda kv: -len(kv[1])):
        longest = now - min(e["time"] for e in entries)
        pids = ", ".join(f"{e['pid']}" + ("" if e["host"] == here else f" on {e['host']}") for e in entries[:4])
        more = f" and {len(entries) - 4} more" if len(entries) > 4 else ""
        part = f'{len(entries)} at "{step}" for up to {longest:.0f} s (pid {pids}{more})'
        if step == steps.BEATING:
            ids = sorted(e["engine_id"] for e in entries if e["engine_id"] is not None)
            part += f", engine id(s) {', '.join(map(str, ids[:8]))}{'...' if len(ids) > 8 else ''} this client has not heard of"
        parts.append(part)
    if ended:
        parts.append(f"{ended} ended")
    return f" The {len(said)} engine processes that started say: " + "; ".join(parts) + "."


def _advice() -> str:
    """What to try: memory first when memory is short, else the engine log and a larger --timeout."""
    import psutil

    mem = psutil.virtual_memory()
    if mem.available < min(2 * 2**30, 0.1 * mem.total):
        return f" Memory is short ({mem.available / 2**30:.1f} GiB available): fewer ranks, or free memory, then try again."
    return " Check the engine log, then try again (a larger --timeout helps on a busy machine)."


def _log_tail(path: str) -> str:
    try:
        with open(path, errors="replace") as fh:
            return " | ".join(fh.read().strip().splitlines()[-3:])[-400:]
    except OSError:
        return ""


def in_launch_order(engines: Registering, ids: list[int]) -> list[int]:
    """Engine ids sorted by launch rank (SLURM_PROCID, the MPI rank), when the launcher gives one."""
    if not engines.launcher.rank_vars:
        return ids
    from ..engine.runtime import launch_rank

    answers = engines.call_each(
        {eid: (launch_rank, (list(engines.launcher.rank_vars),), {}) for eid in ids},
        timeout=engines.config.world.timeout,
        by_engine=True,
    )
    ranks = answers.ordered("the engines' launch ranks", ids, who="engine")
    order = sorted(range(len(ids)), key=lambda i: (ranks[i] is None, ranks[i] or 0, i))
    return [ids[i] for i in order]
