"""The launchers by name, and the options each declares.

A launcher is one class (launch/, or a package's) with a ``spec``: its name, a summary, whether its engines may
run on other hosts, and ``options``, a dataclass of ``LauncherOptions`` whose fields are made with ``option()``
(name, type, default, help). ``StartConfig`` takes a launcher's options from that class, and ``%dist_start``
makes one flag of each, so a launcher installed as a plug-in brings its own. nbdist's launchers are named here
by import path, a package's through the ``nbdist.launchers`` entry point group::

    [project.entry-points."nbdist.launchers"]
    ray = "nbdist_ray:RayLauncher"

Both are loaded the first time any launcher is looked up (``known()``), whatever was imported before: no
import order matters; a name not known yet, and ``%dist_start``'s flags, look again. A package that fails to load is said in one warning and left out; the others work.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import logging
import typing
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from .values import did_you_mean

GROUP = "nbdist.launchers"
# nbdist's own launchers, by import path (loaded like a package's: launch/ is below this module).
BUILTIN = {
    "local": "nbdist.launch.launchers:LocalLauncher",
    "slurm": "nbdist.launch.hosts:SlurmLauncher",
    "srun": "nbdist.launch.hosts:SrunLauncher",
    "mpi": "nbdist.launch.hosts:MpiLauncher",
    "ray": "nbdist.launch.ray:RayLauncher",
}
log = logging.getLogger("nbdist")


def option(default: Any = None, *, help: str, metavar: str = "X", flag: str = "") -> Any:
    """A field of a launcher's options: its default, its help, the flag's metavar, and the flag when it is not
    ``--`` plus the field's name with dashes (a list option's flag is given once per value)."""
    meta = {"help": help, "metavar": metavar, "flag": flag}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(kw_only=True)
class LauncherOptions:
    """A launcher's own options (the launcher section of a StartConfig). A subclass declares its fields with
    ``option()`` and checks them in ``check``, which sees the number of ranks."""

    def check(self, n: int) -> None:
        """ConfigError naming the value and the fix, for a value this launcher cannot use."""

    def ranks_per_host(self, n: int) -> int:
        """The most ranks one host runs (its cores are shared among them): all n unless the options spread them."""
        return n


@dataclass(frozen=True, slots=True)
class Option:
    """One launcher option as the magics and the checks see it."""

    name: str  # the keyword of nbdist.start and the options' field
    kind: type  # int, float, str or bool; a list option holds str
    many: bool  # a list: each flag adds one value
    default: Any
    help: str
    metavar: str
    flag: str

    def unset(self, value: Any) -> bool:
        return value is None or value == self.default


@dataclass(frozen=True, slots=True)
class LauncherSpec:
    """A launcher as the options see it: each launcher class carries its own."""

    name: str
    summary: str  # what it starts, for help texts and errors
    multi_host: bool = True  # engines may run on other hosts
    options: type[LauncherOptions] = LauncherOptions


def options_of(cls: type[LauncherOptions]) -> list[Option]:
    """The options a LauncherOptions class declares, read from its fields and their types."""
    hints = typing.get_type_hints(cls)
    found = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        many = typing.get_origin(hint) is list
        kinds = [a for a in (typing.get_args(hint) or (hint,)) if a is not type(None)]
        kind = str if many else kinds[0]
        if kind not in (int, float, str, bool):
            raise ConfigError(
                f"option {f.name!r} of {cls.__qualname__} is a {hint}; an option is an int, float, str, "
                "bool or list[str]."
            )
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        meta = f.metadata
        flag = meta.get("flag") or "--" + f.name.replace("_", "-")
        found.append(Option(f.name, kind, many, default, meta.get("help", ""), meta.get("metavar", "X"), flag))
    return found


_SPECS: dict[str, LauncherSpec] = {}
_CLASSES: dict[str, type] = {}
_LOADED = False


def register(cls: Any) -> Any:
    """Make ``cls`` the launcher of its ``spec.name``; ConfigError when another class has that name or an option
    it shares with another launcher has another type."""
    spec = getattr(cls, "spec", None)
    if not isinstance(cls, type) or not isinstance(spec, LauncherSpec) or not callable(getattr(cls, "cluster", None)):
        raise ConfigError(f"{cls!r} is not a launcher: subclass nbdist.launch.launchers.Launcher and give it a spec.")
    taken = _CLASSES.get(spec.name)
    if taken is not None and taken is not cls:
        raise ConfigError(
            f"two launchers are named {spec.name!r} ({taken.__module__}.{taken.__qualname__} and "
            f"{cls.__module__}.{cls.__qualname__}); give the new one another name."
        )
    others = {o.name: (o, name) for name, s in _SPECS.items() if name != spec.name for o in options_of(s.options)}
    for opt in options_of(spec.options):
        if opt.name in others and (others[opt.name][0].kind, others[opt.name][0].many) != (opt.kind, opt.many):
            raise ConfigError(
                f"launcher {spec.name!r} declares option {opt.name!r} as {opt.kind.__name__}, but launcher "
                f"{others[opt.name][1]!r} has it as {others[opt.name][0].kind.__name__}; give it another name."
            )
    _SPECS[spec.name] = spec
    _CLASSES[spec.name] = cls
    return cls


def forget(name: str) -> None:
    """Leave a launcher out again (a test's own)."""
    _SPECS.pop(name, None)
    _CLASSES.pop(name, None)


def load() -> None:
    """Register nbdist's launchers, then those of the installed packages' entry points (again: a package
    installed since is found)."""
    global _LOADED
    _LOADED = True
    for path in BUILTIN.values():
        module, _, name = path.partition(":")
        register(getattr(importlib.import_module(module), name))
    for entry in importlib.metadata.entry_points(group=GROUP):
        try:
            register(entry.load())
        except Exception as exc:
            log.warning(
                "nbdist: the launcher %r (%s) was not loaded: %s: %s", entry.name, entry.value, type(exc).__name__, exc
            )


def known() -> dict[str, LauncherSpec]:
    """Every launcher's spec, by name (loaded on the first call)."""
    if not _LOADED:
        load()
    return dict(_SPECS)


def spec_of(name: str) -> LauncherSpec:
    """The spec of launcher ``name`` (a package installed since the last look is looked for); ConfigError naming
    the nearest when it is not known."""
    specs = known()
    if name not in specs:
        load()
        specs = known()
    if name not in specs:
        raise ConfigError(f"launcher {name!r} is not known; {did_you_mean(name, tuple(specs))}")
    return specs[name]


def launcher_class(name: str) -> type:
    spec_of(name)
    return _CLASSES[name]


def all_options() -> dict[str, tuple[Option, list[LauncherSpec]]]:
    """Every launcher option by name, with the launchers that take it (in the order they were registered)."""
    found: dict[str, tuple[Option, list[LauncherSpec]]] = {}
    for spec in known().values():
        for opt in options_of(spec.options):
            found.setdefault(opt.name, (opt, []))[1].append(spec)
    return found
