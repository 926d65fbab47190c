"""What ranks answered one call through the door to the ranks (``EngineSet.call``): each rank's value or error,
and the ranks that did not answer in time, said in one line."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from concurrent.futures import wait
from dataclasses import dataclass, field
from typing import Any

from ..errors import ClusterError
from ..results import remote_error

Call = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]  # a function, its args and kwargs, for one rank


@dataclass(slots=True)
class Answers:
    """What ranks answered one call (``EngineSet.call``): values and errors by rank, and the ranks that did not
    answer within ``timeout``."""

    timeout: float
    values: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, BaseException] = field(default_factory=dict)
    late: list[int] = field(default_factory=list)

    def ordered(self, what: str, keys: list[int], who: str = "rank") -> list[Any]:
        """The values of ``keys`` in that order; ClusterError naming every rank that failed or did not answer."""
        if self.errors or self.late:
            raise ClusterError(self.problem(what, who))
        return [self.values[k] for k in keys]

    def problem(self, what: str, who: str = "rank") -> str:
        """One line: which ranks did not answer ``what`` in time, and which raised what."""
        parts = []
        if self.late:
            parts.append(
                f"{who}(s) {', '.join(map(str, sorted(self.late)))} did not answer within {self.timeout:.0f} s (the "
                "engine, or the controller that routes to it, is stopped or stuck)"
            )
        for key, exc in sorted(self.errors.items()):
            err = remote_error(exc)
            last = (err["evalue"].strip().splitlines() or [""])[-1]
            parts.append(f"{who} {key} raised {err['ename']}: {last}"[:300])
        return f"{what}: {'; '.join(parts)}"


def wait_releasing(
    futures: dict[int, Any],
    called: Collection[int],
    deadline: float,
    dead: Callable[[], list[int]],
    interrupt: Callable[[list[int]], None],
) -> None:
    """Wait for these calls (by rank) until all are done or ``deadline``; while one of the ``called`` ranks is dead
    (before its call was sent, or since), interrupt the others still running, every 0.5 s: a rank waiting for the
    dead one at a rendezvous (engine/group.py, ``arrive``) is released at once rather than at its timeout. Again and
    again, since an interrupt that reaches a rank before its call does is ignored (an idle engine ignores SIGINT).
    A look for the dead every 0.2 s."""
    last = 0.0
    while time.monotonic() < deadline:
        pending = [key for key, fut in futures.items() if not fut.done()]
        if not pending:
            return
        gone = set(dead()) & set(called)
        if gone and time.monotonic() - last >= 0.5:
            interrupt([key for key in pending if key not in gone])
            last = time.monotonic()
        wait([futures[key] for key in pending], timeout=min(0.2, max(0.0, deadline - time.monotonic())))
