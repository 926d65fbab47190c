"""Configs that check themselves: every bad value raises ConfigError naming the value and the fix."""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
from dataclasses import dataclass, field

from .errors import ConfigError

BACKENDS = ("gloo", "nccl")
RECOVER_FROM = ("peer", "checkpoint")


@dataclass(frozen=True, slots=True)
class LauncherSpec:
    """A launcher as the options see it. ``LAUNCHERS`` is the one list: each launcher class (launch/) takes
    its entry (``Launcher.spec``), and the magic's help, the checks below and ``launcher_for`` read it."""

    name: str
    summary: str  # what it starts, for help texts and errors
    multi_host: bool = True  # engines may run on other hosts
    options: tuple[str, ...] = ()  # the StartConfig fields that only launchers listing them accept


LAUNCHERS = {
    spec.name: spec
    for spec in (
        LauncherSpec("local", "every rank on this machine, on 127.0.0.1", multi_host=False),
        LauncherSpec(
            "slurm",
            "sbatch a job",
            options=("nodes", "partition", "time", "account", "gpus_per_node", "sbatch_args"),
        ),
        LauncherSpec("srun", "srun --overlap inside an allocation", options=("nodes", "ranks_per_node")),
        LauncherSpec("mpi", "mpiexec", options=("mpi_args",)),
    )
}
# Values that reach an sbatch script: Slurm's own syntax, nothing a script line or a shell reads more in.
SLURM_VALUES = {
    "--partition": (
        re.compile(r"[A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+)*"),
        "a partition name (several: comma-separated)",
        "gpu",
    ),
    "--account": (re.compile(r"[A-Za-z0-9_.-]+"), "an account name", "myproject"),
    "--time": (
        re.compile(r"(\d+-)?\d+(:\d+){0,2}|UNLIMITED|unlimited|INFINITE|infinite"),
        "a Slurm time limit (minutes, H:MM:SS or D-HH)",
        "1:00:00",
    ),
}
LINE_BREAKS = re.compile(r"[\n\r\x00]")


def check_plain_value(flag: str, value: str, example: str) -> None:
    """ConfigError when a value that goes into a script line or an argv holds a line break or a NUL."""
    if LINE_BREAKS.search(value):
        raise ConfigError(
            f"{flag} {value!r} holds a line break or a NUL, which would change the script it goes into; "
            f"give one value on one line, e.g. {flag} {example}."
        )


def did_you_mean(value: str, choices: tuple[str, ...] | list[str]) -> str:
    """'did you mean 'x'?' for the nearest choice, or the list of choices."""
    close = difflib.get_close_matches(str(value), list(choices), n=1, cutoff=0.5)
    if close:
        return f"did you mean {close[0]!r}?"
    return "choose one of " + ", ".join(repr(c) for c in choices) + "."


# Which ranks: one (0), several ('0,2', [0, 2], range(2)), a span ('1-3'), or None for every rank.
RankSpec = str | int | list[int] | tuple[int, ...] | range | None


def parse_ranks(spec: RankSpec, world_size: int) -> list[int]:
    """Turn a rank spec into a sorted list of ranks.

    Accepts None (every rank), an int, an iterable of ints, or a string such as
    ``"0"``, ``"0,2"``, ``"1-3"``, ``"0,2-3"`` or ``"all"``.
    """
    if spec is None:
        return list(range(world_size))
    if isinstance(spec, bool):
        raise ConfigError(f"ranks ({spec!r}) must be a rank spec such as 0, '0,2' or '1-3'.")
    if isinstance(spec, int):
        items: list[int] = [spec]
    elif isinstance(spec, str):
        text = spec.strip()
        if text in ("all", "*", ""):
            return list(range(world_size))
        items = []
        for part in text.split(","):
            part = part.strip()
            lo, sep, hi = part.partition("-")
            try:
                first, last = (int(lo), int(hi)) if sep else (int(part), int(part))
            except ValueError:
                raise ConfigError(f"ranks {spec!r} is not a rank spec; write ranks like 0, '0,2' or '1-3'.") from None
            if last < first:
                raise ConfigError(f"rank range {part!r} runs backwards; write it as '{last}-{first}'.")
            items.extend(range(first, last + 1))
    else:
        try:
            items = [int(r) for r in spec]
        except (TypeError, ValueError):
            raise ConfigError(f"ranks {spec!r} is not a rank spec; write ranks like 0, '0,2' or '1-3'.") from None
    bad = sorted({r for r in items if r < 0 or r >= world_size})
    if bad:
        raise ConfigError(f"rank {bad[0]} is outside this world of {world_size} rank(s); use ranks 0-{world_size - 1}.")
    if not items:
        raise ConfigError(f"ranks {spec!r} names no rank; write ranks like 0, '0,2' or '1-3'.")
    return sorted(set(items))


DURATION = re.compile(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?")
KEEP_MAX_S = 7 * 24 * 3600.0  # a kept world's longest idle time: a week


def parse_duration(value: str | float, flag: str = "--keep") -> float:
    """'90', '90s', '30m', '2h', '1h30m' (or a number of seconds) -> seconds, positive and at most a week."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    else:
        text = str(value).strip().lower()
        match = DURATION.fullmatch(text)
        if not text or match is None or not any(match.groups()):
            raise ConfigError(f"{flag} {value!r} is not a duration; write e.g. {flag} 30m (s, m or h: 90s, 2h, 1h30m).")
        h, m, sec = (float(g) if g else 0.0 for g in match.groups())
        seconds = h * 3600 + m * 60 + sec
    if not 0 < seconds <= KEEP_MAX_S:
        raise ConfigError(f"{flag} {value!r} must be more than 0 and at most a week; e.g. {flag} 30m.")
    return seconds


def default_threads(n: int, cores: int | None = None) -> int:
    """Threads per rank so that n ranks share the machine's cores: max(1, cores // n)."""
    cores = cores or os.cpu_count() or 1
    return max(1, cores // max(1, n))


@dataclass(kw_only=True, slots=True)
class StartConfig:
    """What ``nbdist.start`` builds."""

    n: int = 2  # number of ranks
    backend: str | None = None  # "gloo" or "nccl"; None: nccl when every rank has a GPU of its own
    launcher: str = "local"  # how engines start: a name in LAUNCHERS
    timeout: float = 45.0  # seconds for engines to register and for the world to form
    oversubscribe: bool = False  # allow more ranks than cores
    heartbeat_ms: int = 100  # the controller's heartbeat: how fast a dead engine is noticed
    pg_timeout: float = 1800.0  # torch's process-group timeout (nbdist releases hung ranks long before)
    watchdog: float | None = 60.0  # seconds a rank may wait in a collective after others finished; None: off
    grace: float = 1.0  # seconds the other ranks get to finish after one failed, before they are released
    auto_restart: bool = False  # restart ranks that died during a cell at once (else: %dist_restart)
    max_restarts: int = 0  # recover from this many rank deaths by itself: restart, replay setup, resume, re-run
    recover_from: str = "peer"  # what a recovery resumes from: "peer" (living ranks' memory, else the checkpoint)
    min_ranks: int | None = None  # a lost rank whose replacement cannot start: go on without it, down to this many
    debug_collectives: bool = False  # torch checks each collective across ranks (TORCH_DISTRIBUTED_DEBUG=DETAIL)
    threads: int | None = None  # threads per rank (OMP_NUM_THREADS); None: cores // n
    cores: int | None = field(default=None)  # cores to plan for; None: this machine's
    pin: bool = True  # give each rank its own cores (when there are enough)
    # Several hosts (launchers slurm, srun, mpi):
    ip: str | None = None  # the address the controller listens on; None: the interface that routes to the nodes
    nodes: int | None = None  # nodes to spread the ranks over (sbatch/srun --nodes)
    ranks_per_node: int | None = None  # srun --ntasks-per-node, e.g. one rank per GPU of each node
    partition: str | None = None  # sbatch --partition
    time: str | None = None  # sbatch --time, e.g. "30" or "1:00:00"
    account: str | None = None  # sbatch --account
    gpus_per_node: int | None = None  # sbatch --gpus-per-node
    sbatch_args: list[str] = field(default_factory=list)  # more sbatch options, e.g. ["--mem=8G"]
    mpi_args: list[str] = field(default_factory=list)  # more mpiexec options, e.g. ["--hostfile", "hosts"]
    address: str | None = None  # the Ray cluster (launcher ray): "ray://HEAD:10001"; None: RAY_ADDRESS or this node
    gpus_per_rank: float | None = None  # GPUs Ray gives each rank (launcher ray)
    # The world outlives the kernel for at most this long idle (no cell, no client): seconds, or "30m", "2h".
    # None: it ends with the kernel. %dist_attach in a new kernel reconnects (world/kept.py).
    keep: float | str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int):
            raise ConfigError(f"n ({self.n!r}) must be a whole number of ranks, such as -n 2.")
        if self.n < 1:
            raise ConfigError(f"n ({self.n}) must be at least 1; use -n 2 for two ranks.")
        if self.launcher not in LAUNCHERS:
            raise ConfigError(f"launcher {self.launcher!r} is not known; {did_you_mean(self.launcher, tuple(LAUNCHERS))}")
        cores = self.cores or os.cpu_count() or 1
        if not LAUNCHERS[self.launcher].multi_host and self.n > cores and not self.oversubscribe:
            raise ConfigError(
                f"n ({self.n}) is more than this machine's {cores} cores; use -n {cores}, or pass --oversubscribe."
            )
        if self.backend is not None and self.backend not in BACKENDS:
            raise ConfigError(f"backend {self.backend!r} is not known; {did_you_mean(self.backend, BACKENDS)}")
        self._check_hosts()
        if not self.timeout or self.timeout <= 0:
            raise ConfigError(f"timeout ({self.timeout!r}) must be a positive number of seconds, such as 45.")
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ConfigError(
                f"max_restarts ({self.max_restarts!r}) must be a whole number, 0 or more, such as --max-restarts 1."
            )
        if self.recover_from not in RECOVER_FROM:
            raise ConfigError(
                f"recover_from ({self.recover_from!r}) must be one of {', '.join(RECOVER_FROM)}: 'peer' rebuilds a lost "
                "rank from the living ranks' memory (the last checkpoint where it cannot), 'checkpoint' always loads it."
            )
        self._check_min_ranks()
        if self.keep is not None:
            self.keep = parse_duration(self.keep)
        if self.heartbeat_ms < 10:
            raise ConfigError(f"heartbeat_ms ({self.heartbeat_ms}) is too small; use 100 or more.")
        if self.watchdog is not None and self.watchdog <= 0:
            raise ConfigError(f"watchdog ({self.watchdog!r}) must be positive seconds, or None to turn it off.")
        if self.threads is None:
            per_host = self.ranks_per_node or (-(-self.n // self.nodes) if self.nodes else self.n)
            self.threads = default_threads(per_host if LAUNCHERS[self.launcher].multi_host else self.n, cores)
        elif self.threads < 1:
            raise ConfigError(f"threads ({self.threads}) must be at least 1.")

    def _check_min_ranks(self) -> None:
        """--min-ranks: a whole number from 1 to -n, and only with --max-restarts (a shrink is a recovery)."""
        if self.min_ranks is None:
            return
        if isinstance(self.min_ranks, bool) or not isinstance(self.min_ranks, int) or not 1 <= self.min_ranks <= self.n:
            raise ConfigError(
                f"min_ranks ({self.min_ranks!r}) must be a whole number from 1 to n ({self.n}): the fewest ranks the "
                f"world goes on with when lost ranks cannot be replaced, such as --min-ranks {max(1, self.n // 2)}."
            )
        if self.max_restarts < 1:
            raise ConfigError(
                f"min_ranks ({self.min_ranks}) needs max_restarts: going on with fewer ranks is an automatic recovery "
                f"and spends one; add --max-restarts {max(1, self.n - self.min_ranks)}."
            )

    def _check_slurm_values(self) -> None:
        """Values that go into the sbatch script or an argv: Slurm's syntax, one line each, before any is used."""
        given = {"--partition": self.partition, "--account": self.account, "--time": self.time}
        for flag, value in given.items():
            pattern, what, example = SLURM_VALUES[flag]
            if value is not None and not pattern.fullmatch(str(value)):
                raise ConfigError(
                    f"{flag} {value!r} is not {what}: Slurm's syntax only, no spaces, line breaks or shell "
                    f"characters; e.g. {flag} {example}."
                )
        for flag, values, example in (
            ("--sbatch-arg", self.sbatch_args, "--mem=8G"),
            ("--mpi-arg", self.mpi_args, "--bind-to=none"),
        ):
            for value in values:
                check_plain_value(flag, str(value), example)
        for value in self.sbatch_args:
            if not str(value).startswith("-"):
                raise ConfigError(
                    f"--sbatch-arg {value!r} is not an sbatch option; give one option, e.g. --sbatch-arg --mem=8G."
                )

    def _check_hosts(self) -> None:
        """Options for several hosts: each belongs to a launcher; name the launcher when misplaced."""
        if self.ip is not None:
            try:
                ipaddress.ip_address(self.ip)
            except ValueError:
                raise ConfigError(
                    f"--ip {self.ip!r} is not an address; name one of this host's, e.g. --ip 10.0.0.5."
                ) from None
        if not LAUNCHERS[self.launcher].multi_host and self.ip not in (None, "127.0.0.1"):
            several = ", ".join(name for name, spec in LAUNCHERS.items() if spec.multi_host)
            raise ConfigError(
                f"--ip {self.ip} is for launchers on several hosts; the {self.launcher} launcher listens on 127.0.0.1 "
                f"only. Use --launcher {several}, or leave --ip out."
            )
        for name in sorted({option for spec in LAUNCHERS.values() for option in spec.options}):
            value = getattr(self, name)
            takers = [spec for spec in LAUNCHERS.values() if name in spec.options]
            if value not in (None, []) and self.launcher not in [spec.name for spec in takers]:
                flag = "--" + name.removesuffix("s" if name.endswith("_args") else "").replace("_", "-")
                which = " or ".join(f"--launcher {spec.name} ({spec.summary})" for spec in takers)
                raise ConfigError(f"{flag} {value!r} needs {which}; this is {self.launcher!r}.")
        self._check_slurm_values()
        if self.nodes is not None:
            if not 1 <= self.nodes <= self.n:
                raise ConfigError(f"--nodes {self.nodes} must be between 1 and the number of ranks ({self.n}).")
        if self.ranks_per_node is not None:
            if not 1 <= self.ranks_per_node <= self.n:
                raise ConfigError(
                    f"--ranks-per-node {self.ranks_per_node} must be between 1 and the number of ranks ({self.n})."
                )
        if self.gpus_per_node is not None and self.gpus_per_node < 0:
            raise ConfigError(f"--gpus-per-node ({self.gpus_per_node}) must be 0 or more.")
        if self.gpus_per_rank is not None and not 0 <= self.gpus_per_rank <= 8:
            raise ConfigError(f"--gpus-per-rank ({self.gpus_per_rank}) must be from 0 to 8, e.g. 1 (or 0.5 to share).")


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """How one cell runs: on which ranks, for how long, blocking or not."""

    ranks: list[int]
    timeout: float | None = None
    block: bool = True
    quiet: bool = False
    each: bool = False  # every rank's lines as they are, not folded across ranks

    def __post_init__(self) -> None:
        if self.timeout is not None and self.timeout <= 0:
            raise ConfigError(f"timeout ({self.timeout!r}) must be a positive number of seconds, such as --timeout 30.")


def format_cpus(cpus: list[int] | None) -> str:
    """'0', '0-3' or 'all' for the status table."""
    if not cpus:
        return "all"
    if cpus == list(range(cpus[0], cpus[-1] + 1)) and len(cpus) > 1:
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(map(str, cpus))
