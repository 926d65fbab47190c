"""What ranks answered one call through the door to the ranks (``EngineSet.call``): each rank's value or error,
and the ranks that did not answer in time, said in one line."""

from __future__ import annotations

from collections.abc import Callable
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
