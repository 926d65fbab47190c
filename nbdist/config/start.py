"""What ``nbdist.start`` builds, in sections, each owned by what reads it: the world (ranks, backend, threads,
timeouts), recovery (what happens when a rank dies), and the launcher's own options (declared by the launcher:
launchers.py). Every bad value raises ConfigError naming the value and the fix."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..errors import ConfigError
from .launchers import LauncherOptions, all_options, options_of, spec_of
from .values import default_threads, did_you_mean, parse_duration

BACKENDS = ("gloo", "nccl")
RECOVER_FROM = ("peer", "checkpoint")
Own = TypeVar("Own", bound=LauncherOptions)


@dataclass(kw_only=True, slots=True)
class WorldConfig:
    """The world: how many ranks, on what, and how long its parts may take."""

    n: int = 2  # number of ranks
    backend: str | None = None  # "gloo" or "nccl"; None: nccl when every rank has a GPU of its own
    timeout: float = 45.0  # seconds for engines to register and for the world to form
    oversubscribe: bool = False  # allow more ranks than cores
    heartbeat_ms: int = 100  # the controller's heartbeat: how fast a dead engine is noticed
    pg_timeout: float = 1800.0  # torch's process-group timeout (nbdist releases hung ranks long before)
    debug_collectives: bool = False  # torch checks each collective across ranks (TORCH_DISTRIBUTED_DEBUG=DETAIL)
    threads: int | None = None  # threads per rank (OMP_NUM_THREADS); None: the cores one host has // its ranks
    cores: int | None = None  # cores to plan for; None: this machine's
    pin: bool = True  # give each rank its own cores (when there are enough)
    # The world outlives the kernel for at most this long idle (no cell, no client): seconds, or "30m", "2h".
    # None: it ends with the kernel. %dist_attach in a new kernel reconnects (world/kept.py).
    keep: float | str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int):
            raise ConfigError(f"n ({self.n!r}) must be a whole number of ranks, such as -n 2.")
        if self.n < 1:
            raise ConfigError(f"n ({self.n}) must be at least 1; use -n 2 for two ranks.")
        if self.backend is not None and self.backend not in BACKENDS:
            raise ConfigError(f"backend {self.backend!r} is not known; {did_you_mean(self.backend, BACKENDS)}")
        if not self.timeout or self.timeout <= 0:
            raise ConfigError(f"timeout ({self.timeout!r}) must be a positive number of seconds, such as 45.")
        if self.keep is not None:
            self.keep = parse_duration(self.keep)
        if self.heartbeat_ms < 10:
            raise ConfigError(f"heartbeat_ms ({self.heartbeat_ms}) is too small; use 100 or more.")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"threads ({self.threads}) must be at least 1.")


@dataclass(kw_only=True, slots=True)
class RecoveryConfig:
    """What happens when a rank dies or hangs."""

    watchdog: float | None = 60.0  # seconds a rank may wait in a collective after others finished; None: off
    grace: float = 1.0  # seconds the other ranks get to finish after one failed, before they are released
    auto_restart: bool = False  # restart ranks that died during a cell at once (else: %dist_restart)
    max_restarts: int = 0  # recover from this many rank deaths by itself: restart, replay setup, resume, re-run
    recover_from: str = "peer"  # what a recovery resumes from: "peer" (living ranks' memory, else the checkpoint)
    min_ranks: int | None = None  # a lost rank whose replacement cannot start: go on without it, down to this many

    def __post_init__(self) -> None:
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ConfigError(
                f"max_restarts ({self.max_restarts!r}) must be a whole number, 0 or more, such as --max-restarts 1."
            )
        if self.recover_from not in RECOVER_FROM:
            raise ConfigError(
                f"recover_from ({self.recover_from!r}) must be one of {', '.join(RECOVER_FROM)}: 'peer' rebuilds a lost "
                "rank from the living ranks' memory (the last checkpoint where it cannot), 'checkpoint' always loads it."
            )
        if self.watchdog is not None and self.watchdog <= 0:
            raise ConfigError(f"watchdog ({self.watchdog!r}) must be positive seconds, or None to turn it off.")

    def check(self, n: int) -> None:
        """--min-ranks: a whole number from 1 to -n, and only with --max-restarts (a shrink is a recovery)."""
        if self.min_ranks is None:
            return
        if isinstance(self.min_ranks, bool) or not isinstance(self.min_ranks, int) or not 1 <= self.min_ranks <= n:
            raise ConfigError(
                f"min_ranks ({self.min_ranks!r}) must be a whole number from 1 to n ({n}): the fewest ranks the "
                f"world goes on with when lost ranks cannot be replaced, such as --min-ranks {max(1, n // 2)}."
            )
        if self.max_restarts < 1:
            raise ConfigError(
                f"min_ranks ({self.min_ranks}) needs max_restarts: going on with fewer ranks is an automatic recovery "
                f"and spends one; add --max-restarts {max(1, n - self.min_ranks)}."
            )


WORLD = tuple(f.name for f in dataclasses.fields(WorldConfig))
RECOVERY = tuple(f.name for f in dataclasses.fields(RecoveryConfig))


@dataclass(kw_only=True, slots=True)
class StartConfig:
    """What ``nbdist.start`` builds: the world, recovery, and the launcher with its own options.
    ``StartConfig.of(n=4, launcher="slurm", nodes=2)`` sorts flat keywords into the sections."""

    world: WorldConfig = field(default_factory=WorldConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    launcher: str = "local"  # how engines start: a launcher's name (config/launchers.py)
    options: LauncherOptions = field(default_factory=LauncherOptions)  # the launcher's own; left out: its defaults

    def __post_init__(self) -> None:
        spec = spec_of(self.launcher)
        if type(self.options) is LauncherOptions:  # left out
            self.options = spec.options()
        if type(self.options) is not spec.options:
            raise ConfigError(
                f"the options {type(self.options).__qualname__} are not launcher {self.launcher!r}'s; "
                f"give {spec.options.__qualname__}, or pass them as keywords to StartConfig.of."
            )
        world = self.world
        cores = world.cores or os.cpu_count() or 1
        if not spec.multi_host and world.n > cores and not world.oversubscribe:
            raise ConfigError(
                f"n ({world.n}) is more than this machine's {cores} cores; use -n {cores}, or pass --oversubscribe."
            )
        self.options.check(world.n)
        self.recovery.check(world.n)
        if world.threads is None:
            world.threads = default_threads(self.options.ranks_per_host(world.n), cores)

    @classmethod
    def of(cls, *, launcher: str | None = "local", **values: Any) -> StartConfig:
        """A StartConfig from flat keywords (``nbdist.start``'s, the magic's, a kept world's record): each goes
        to the section that declares it. Another launcher's option, when set, is an error naming that launcher;
        a keyword no section declares is an error naming the nearest."""
        name = launcher or "local"
        spec = spec_of(name)
        world = {k: values.pop(k) for k in WORLD if k in values}
        recovery = {k: values.pop(k) for k in RECOVERY if k in values}
        own = {o.name for o in options_of(spec.options)}
        mine = {k: values.pop(k) for k in list(values) if k in own}
        everyone = all_options()
        for key, value in values.items():
            if key not in everyone:
                names = sorted({*WORLD, *RECOVERY, *everyone, "launcher"})
                raise ConfigError(f"{key!r} is not an option of nbdist.start; {did_you_mean(key, names)}")
            opt, takers = everyone[key]
            if not opt.unset(value):
                which = " or ".join(f"--launcher {s.name} ({s.summary})" for s in takers)
                raise ConfigError(f"{opt.flag} {value!r} needs {which}; this is {name!r}.")
        return cls(
            world=WorldConfig(**world), recovery=RecoveryConfig(**recovery), launcher=name, options=spec.options(**mine)
        )

    def options_as(self, cls: type[Own]) -> Own:
        """The launcher's options as the class that launcher declared (a launcher reads its own this way)."""
        if not isinstance(self.options, cls):
            raise ConfigError(f"launcher {self.launcher!r} has no {cls.__qualname__}; this is a StartConfig for it.")
        return self.options

    def flat(self) -> dict[str, Any]:
        """Every value by its keyword: what ``of`` takes back (a kept world's record)."""
        return {
            **dataclasses.asdict(self.world),
            **dataclasses.asdict(self.recovery),
            "launcher": self.launcher,
            **dataclasses.asdict(self.options),
        }


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """How one cell runs: on which ranks, for how long, blocking or not."""

    ranks: list[int]
    timeout: float | None = None
    block: bool = True
    quiet: bool = False
    each: bool = False  # every rank's lines as they are, not folded across ranks
    expect: dict[int, dict[str, Any]] | None = None  # what %%dist_fit forecast, by world size (the dashboard's lines)

    def __post_init__(self) -> None:
        if self.timeout is not None and self.timeout <= 0:
            raise ConfigError(f"timeout ({self.timeout!r}) must be a positive number of seconds, such as --timeout 30.")
