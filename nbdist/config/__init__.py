"""Configs that check themselves, in sections (start.py), the launchers and the options each declares
(launchers.py), and the values every part reads the same way (values.py)."""

from .fit import STRATEGIES, TP_DEGREE, FitConfig, parse_bytes
from .launchers import LauncherOptions, LauncherSpec, Option, option
from .start import BACKENDS, RECOVER_FROM, RECOVERY, WORLD, RecoveryConfig, RunConfig, StartConfig, WorldConfig
from .values import (
    RankSpec,
    check_plain_value,
    default_threads,
    did_you_mean,
    format_cpus,
    parse_duration,
    parse_ranks,
)

__all__ = [
    "BACKENDS",
    "RECOVERY",
    "RECOVER_FROM",
    "STRATEGIES",
    "TP_DEGREE",
    "WORLD",
    "FitConfig",
    "LauncherOptions",
    "LauncherSpec",
    "Option",
    "RankSpec",
    "RecoveryConfig",
    "RunConfig",
    "StartConfig",
    "WorldConfig",
    "check_plain_value",
    "default_threads",
    "did_you_mean",
    "format_cpus",
    "option",
    "parse_bytes",
    "parse_duration",
    "parse_ranks",
]
