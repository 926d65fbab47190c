"""What a forecast (``nbdist.fit``, ``%%dist_fit``) is asked: the strategies, the world sizes, the memory each rank
has. Every bad value raises ConfigError naming the value and the fix."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import ConfigError
from .values import did_you_mean

STRATEGIES = ("ddp", "fsdp", "tp", "pp", "fsdp+tp")  # fsdp+tp: a 2-D mesh, TP over pairs of ranks, FSDP across them
TP_DEGREE = 2  # the ranks a 2-D mix's tensor parallelism spans (the GPUs of a node that share a fast link)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_DEVICE = re.compile(r"cpu|cuda(:\d+)?")
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*")


def parse_bytes(value: str | int | float, flag: str = "--memory") -> int:
    """``16GiB``, ``80GB``, ``512MiB`` or a number of bytes, as bytes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        size = float(value)
    else:
        match = _SIZE.fullmatch(str(value).lower())
        if not match or match.group(2) not in _UNITS:
            raise ConfigError(f"{flag} {value!r} is not a size; write it as 16GiB, 80GB or 512MiB.")
        size = float(match.group(1)) * _UNITS[match.group(2)]
    if size <= 0:
        raise ConfigError(f"{flag} {value!r} is not a size above zero; write it as 16GiB, 80GB or 512MiB.")
    return int(size)


@dataclass(kw_only=True, slots=True)
class FitConfig:
    """A forecast's question: each strategy at each world size, and (optionally) the memory one rank has."""

    strategies: tuple[str, ...] = STRATEGIES[:4]  # the 2-D mix when asked
    world_sizes: tuple[int, ...] = (2, 4, 8)
    memory: int | None = None  # bytes one rank may hold; None: forecast only
    microbatches: int = 4  # a pipeline's micro-batches per step
    timeout: float = 120.0  # seconds the forecast's process may take
    device: str = "cpu"  # where each rank's tensors live: cpu, cuda or cuda:N (then --memory defaults to the GPU's)

    def __post_init__(self) -> None:
        if isinstance(self.strategies, str):
            self.strategies = tuple(s for s in self.strategies.split(",") if s)
        for name in self.strategies:
            if "+".join(sorted(name.split("+"))) not in STRATEGIES:
                raise ConfigError(f"strategy {name!r} is not known; {did_you_mean(name, STRATEGIES)}")
        self.strategies = tuple("+".join(sorted(s.split("+"))) for s in self.strategies)  # tp+fsdp: the same mix
        if not self.strategies:
            raise ConfigError(f"name at least one strategy: {', '.join(STRATEGIES)}.")
        if isinstance(self.world_sizes, str):
            try:
                self.world_sizes = tuple(int(w) for w in self.world_sizes.split(",") if w)
            except ValueError:
                raise ConfigError(f"-n {self.world_sizes!r} is not a list of world sizes; write -n 2,4,8.") from None
        for n in self.world_sizes:
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 4096:
                raise ConfigError(f"world size {n!r} is not a number of ranks from 1 to 4096; write -n 2,4,8.")
        if not self.world_sizes:
            raise ConfigError("name at least one world size: -n 2,4,8.")
        if self.memory is not None:
            self.memory = parse_bytes(self.memory)
        self.device = str(self.device).strip().lower()
        if not _DEVICE.fullmatch(self.device):
            raise ConfigError(
                f"--device {self.device!r} is not a device a forecast knows; write cpu, cuda or cuda:N (cuda:1)."
            )
        if isinstance(self.microbatches, bool) or not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ConfigError(
                f"microbatches {self.microbatches!r} is not a whole number from 1; write --microbatches 4."
            )
