"""The launchers by name: nbdist's own, and those a package adds through the ``nbdist.launchers`` entry point group.

A launcher is one class (a ``Launcher``, or a ``ManyHostsLauncher`` for engines on other hosts) whose
``spec`` is a ``config.LauncherSpec``: its name, a summary, whether its engines may run elsewhere and the
StartConfig options it takes. A package adds one by naming the class in its metadata::

    [project.entry-points."nbdist.launchers"]
    ray = "nbdist_ray:RayLauncher"

Loading it enters its spec into ``config.LAUNCHERS`` (what ``StartConfig``, the magics' ``--launcher`` and
their help read), so it is checked like nbdist's own. A package that fails to load is said in one warning
and left out; the others work.
"""

from __future__ import annotations

import importlib.metadata
import logging

from ..config import LAUNCHERS, StartConfig
from ..errors import ConfigError
from .hosts import MpiLauncher, SlurmLauncher, SrunLauncher
from .launchers import Launcher, LocalLauncher
from .ray import RayLauncher

GROUP = "nbdist.launchers"
LAUNCHER_CLASSES: dict[str, type[Launcher]] = {}
log = logging.getLogger("nbdist")


def register(cls: type[Launcher]) -> type[Launcher]:
    """Make ``cls`` the launcher of its ``spec.name``; ConfigError when another class has that name."""
    spec = getattr(cls, "spec", None)
    if not (isinstance(cls, type) and issubclass(cls, Launcher)) or spec is None:
        raise ConfigError(f"{cls!r} is not a launcher: subclass nbdist.launch.launchers.Launcher and give it a spec.")
    taken = LAUNCHER_CLASSES.get(spec.name)
    if taken is not None and taken is not cls:
        raise ConfigError(
            f"two launchers are named {spec.name!r} ({taken.__module__}.{taken.__qualname__} and "
            f"{cls.__module__}.{cls.__qualname__}); give the new one another name."
        )
    LAUNCHERS[spec.name] = spec
    LAUNCHER_CLASSES[spec.name] = cls
    return cls


def load() -> None:
    """Register nbdist's launchers, then those of the installed packages' entry points."""
    for cls in (LocalLauncher, SlurmLauncher, SrunLauncher, MpiLauncher, RayLauncher):
        register(cls)
    for entry in importlib.metadata.entry_points(group=GROUP):
        try:
            register(entry.load())
        except Exception as exc:
            log.warning("nbdist: the launcher %r (%s) was not loaded: %s: %s", entry.name, entry.value, type(exc).__name__, exc)


def launcher_for(config: StartConfig) -> Launcher:
    """The launcher named by ``config.launcher`` (StartConfig checked the name against config.LAUNCHERS)."""
    return LAUNCHER_CLASSES[config.launcher]()


load()
