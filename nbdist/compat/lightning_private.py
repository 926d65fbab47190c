"""Lightning's private names nbdist relies on (a DDPStrategy's launcher and start method)."""

from __future__ import annotations

from typing import Any


def lightning_script_launcher(module: Any) -> Any:
    """Lightning's ``_SubprocessScriptLauncher`` as the strategy module ``module`` imported it."""
    return module._SubprocessScriptLauncher


def lightning_wrap_configure_launcher(cls: Any, wrap: Any) -> None:
    """Replace ``cls._configure_launcher`` (a DDPStrategy's) by ``wrap(original)``; the original stays reachable as
    ``__wrapped__``."""
    original = cls._configure_launcher
    wrapped = wrap(original)
    wrapped.__wrapped__ = original
    cls._configure_launcher = wrapped


def lightning_launch_settings(strategy: Any) -> tuple[str, str | None]:
    """A DDPStrategy's start method ("popen", "fork", "spawn", ...) and the backend it was asked for, if any."""
    return strategy._start_method, getattr(strategy, "_process_group_backend", None)


def lightning_set_launcher(strategy: Any, launcher: Any) -> None:
    """Make ``launcher`` the one the DDPStrategy launches with."""
    strategy._launcher = launcher
