"""What every magic shares: the usage lines, argument parsing, and API errors as one-line UsageErrors."""

from __future__ import annotations

import shlex
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic_arguments import parse_argstring

from ..config import did_you_mean
from ..errors import ClusterError, ConfigError, NbdistError, RankError

USAGE = {
    "dist_start": (
        "%dist_start [-n N] [--backend gloo|nccl] [--launcher local|slurm|srun|mpi] [--timeout S] [--nodes K] [--ranks-per-node R] "
        "[--partition P] [--time T] [--account A] [--gpus-per-node G] [--sbatch-arg ARG] [--mpi-arg ARG] [--ip ADDR] "
        "[--max-restarts N] [--debug-collectives]"
    ),
    "distributed": "%%distributed [--ranks SPEC] [--timeout S] [--noblock] [--quiet] [--setup]",
    "rank": "%%rank SPEC [--timeout S] [--noblock] [--quiet]   (SPEC: 0, 0,2 or 1-3)",
    "dist_restart": "%dist_restart [--ranks SPEC]",
    "dist_mode": "%dist_mode on|off",
    "dist_push": "%dist_push NAME [NAME ...] [--ranks SPEC]",
    "dist_pull": "%dist_pull NAME [--ranks SPEC]",
    "dist_run": "%dist_run [--ranks SPEC] [--timeout S] [--noblock] [--quiet] script.py [script args ...]",
    "dist_export": "%dist_export train.py [--cells 1-3,5] [--force] | %dist_export --list",
}


def parse(func: Any, line: str, name: str) -> Any:
    try:
        return parse_argstring(func, line)
    except UsageError as exc:
        text = str(exc).replace("\n", " ").strip()
        raise UsageError(f"{text}; type {USAGE[name]}") from None


def check_choice(value: str | None, choices: tuple[str, ...], what: str) -> None:
    if value is not None and value not in choices:
        raise UsageError(f"{what} {value!r} is not known; {did_you_mean(value, choices)}")


def names_and_ranks(line: str, magic: str) -> tuple[list[str], str | None]:
    words = shlex.split(line)
    ranks = None
    if "--ranks" in words:
        i = words.index("--ranks")
        if i + 1 >= len(words):
            raise UsageError(f"--ranks needs a value; type {USAGE[magic]}")
        ranks = words[i + 1]
        del words[i : i + 2]
    bad = [w for w in words if not w.isidentifier()]
    if bad or not words:
        raise UsageError(f"{(bad or [''])[0]!r} is not a variable name; type {USAGE[magic]}")
    return words, ranks


def call(fn: Any) -> Any:
    """Run an API call; turn configuration and cluster errors into one-line UsageErrors."""
    try:
        return fn()
    except RankError:
        raise
    except (ConfigError, ClusterError) as exc:
        raise UsageError(str(exc)) from None
    except NbdistError as exc:  # pragma: no cover - any other nbdist error
        raise UsageError(str(exc)) from None


def show(result: Any, block: bool) -> Any:
    """What a magic that ran code on the ranks ends with: the error raised, or the notes printed."""
    if not block:
        print("running in the background; collect with nbdist.current().last.wait()")
        return result
    result.raise_for_error()
    for note in result.notes:
        print(note)
    return None
