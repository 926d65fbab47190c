"""Values every part reads the same way: rank specs, durations, threads per rank, one plain line, the nearest name."""

from __future__ import annotations

import difflib
import os
import re

from ..errors import ConfigError

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


def format_cpus(cpus: list[int] | None) -> str:
    """'0', '0-3' or 'all' for the status table."""
    if not cpus:
        return "all"
    if cpus == list(range(cpus[0], cpus[-1] + 1)) and len(cpus) > 1:
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(map(str, cpus))
