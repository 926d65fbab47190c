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
import time
from collections.abc import Callable
from typing import Any, Protocol

from ..config import StartConfig
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


def wait_for_engines(engines: Registering, n: int, known: set[int], old_launchers: set[int]) -> list[int]:
    """Wait until n new engines registered; name the missing ranks if they don't (docs/faults.md, row 7).

    ``known`` are engine ids that existed before, ``old_launchers`` the ids of
    launcher objects that existed before this start (their exits are not news).
    While a batch job waits in the queue the timeout does not run; the wait is
    reported through ``progress`` and Ctrl-C ends it (the caller cancels the job).
    """
    started = time.monotonic()
    deadline = started + engines.config.timeout
    said, said_at, asked_at = "", 0.0, 0.0
    finished: list[Any] = []
    while True:
        new = sorted(set(engines.client.ids) - known)
        if len(new) >= n:
            return new[:n]
        launchers = [el for el in engines.launchers() if id(el) not in old_launchers]
        check_preflight(engines)
        now = time.monotonic()
        if engines.launcher.multi_host and now - asked_at >= 1.0:
            asked_at = now
            waiting, finished = engines.launcher.queue(launchers)
            if waiting:
                deadline = max(deadline, now + engines.config.timeout)
                if now - started >= 2 and (waiting != said or now - said_at >= 15):
                    engines.progress(f"{waiting}; waited {now - started:.0f} s (Ctrl-C cancels it)")
                    said, said_at = waiting, now
        exited = [el for el in launchers if procs.exited(el) or el in finished]
        # An engine that exited will never register; report once the others have. One launcher
        # of several hosts (mpiexec, srun, a job) carries every engine: its exit ends the wait.
        enough = engines.launcher.multi_host or len(new) >= n - len(exited)
        if (exited and enough) or time.monotonic() > deadline:
            check_preflight(engines)  # written just before those engines exited
            missing = n - len(new)
            first_missing = len(engines.ranks) if known else len(new)
            names = ", ".join(str(first_missing + i) for i in range(missing))
            why = (
                f"{len(exited)} engine process(es) exited while starting"
                if exited
                else f"they did not register within {engines.config.timeout:.0f} s"
            )
            logs = exited or (launchers if engines.launcher.multi_host else [])
            tail = _log_tail(getattr(logs[0], "output_file", "")) if logs else ""
            raise ClusterError(
                f"{missing} of {n} engine(s) did not start, so rank(s) {names} have no engine: {why}."
                + (f" Engine log: {tail}" if tail else "")
                + " Check memory and the engine log, then try again (a larger --timeout helps on a busy machine)."
            )
        time.sleep(0.02)


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
        timeout=engines.config.timeout,
        by_engine=True,
    )
    ranks = answers.ordered("the engines' launch ranks", ids, who="engine")
    order = sorted(range(len(ids)), key=lambda i: (ranks[i] is None, ranks[i] or 0, i))
    return [ids[i] for i in order]
