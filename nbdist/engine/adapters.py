"""Libraries that would start processes of their own run on the world nbdist built instead.

A rank already looks launched (engine/launched.py): Lightning's ``strategy="ddp"``, Accelerate,
the HF Trainer and DeepSpeed find torchrun's variables and an initialised process group, and use
them as they do under torchrun. A few entry points exist only to *start* processes, from a
notebook; on a rank they would fork N processes from every rank, whose copies of the process
group's sockets hang the first collective. Under torchrun they would do the same. Each is
adjusted right after its module is imported (an import hook, so nothing is imported early and
a rank that never uses a library pays nothing):

- Lightning (``lightning.fabric``, ``lightning.pytorch`` and their twins ``lightning_fabric``,
  ``pytorch_lightning``): a DDP strategy that would fork or spawn (``"ddp_notebook"``,
  ``"ddp_fork"``, ``"ddp_spawn"`` and their variants) gets Lightning's own script launcher, which
  under torchrun's variables starts nothing and runs on this world (one line on rank 0 says so);
  ``devices``/``num_nodes`` that do not multiply to the world's size, and a
  ``process_group_backend`` the world does not run, fail at once in one line naming the fix;
- Accelerate: ``notebook_launcher`` and ``debug_launcher`` refuse in one line (the cell already
  runs on every rank);
- DeepSpeed: ``init_distributed(dist_backend=...)`` with a backend the world does not run fails in
  one line (it would otherwise keep the world silently);
- tqdm: ``tqdm.auto`` (and ``tqdm.autonotebook``) picks the console bar on a rank, as under torchrun.
  A rank runs inside an IPython kernel of its own, so tqdm would draw a notebook widget per rank,
  which only the rank's kernel could update; the console bar's text reaches the notebook, which
  keeps one live bar per rank (or one for the world) and prints each bar's last state.

Nothing changes while the world is down (after ``%dist_stop``'s teardown, say): the originals run.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from .. import compat
from . import hosted
from .state import STATE

MARK = "_nbdist_adapted"


def world_up() -> bool:
    """True while this rank is in the world nbdist built."""
    import torch.distributed as dist

    return STATE.backend is not None and dist.is_available() and dist.is_initialized()


def say(line: str) -> None:
    """One line from rank 0, tagged as nbdist's."""
    if STATE.rank == 0:
        print(f"nbdist: {line}", flush=True)


# --------------------------------------------------------------------------- Lightning


def lightning_ddp(module: ModuleType) -> None:
    """DDPStrategy: fork/spawn start methods run on the world; a backend it lacks fails."""
    script_launcher = compat.lightning_script_launcher(module)

    def wrap(original: Callable[[Any], None]) -> Callable[[Any], None]:
        def _configure_launcher(self: Any) -> None:
            original(self)
            if not world_up():
                return
            method, wanted = compat.lightning_launch_settings(self)
            if wanted:
                hosted.check_backend(
                    wanted, f"{type(self).__name__}(process_group_backend={wanted!r})", "process_group_backend"
                )
            if method != "popen":
                say(
                    f"Lightning's DDP strategy with start_method={method!r} would start "
                    f"{self.num_processes} processes on every rank; it runs on the world nbdist built instead "
                    f"({os.environ.get('WORLD_SIZE')} ranks), as strategy='ddp' does"
                )
                launcher = script_launcher(self.cluster_environment, self.num_processes, self.num_nodes)
                compat.lightning_set_launcher(self, launcher)

        return _configure_launcher

    compat.lightning_wrap_configure_launcher(module.DDPStrategy, wrap)


def lightning_torchelastic(module: ModuleType) -> None:
    """TorchElasticEnvironment.validate_settings: a size mismatch names the world and the fix."""
    cls = module.TorchElasticEnvironment
    original = cls.validate_settings

    def validate_settings(self: Any, num_devices: int, num_nodes: int) -> None:
        world = int(os.environ.get("WORLD_SIZE", "0") or 0)
        if world_up() and num_devices * num_nodes != world:
            local = int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)
            nodes = max(1, world // max(1, local))
            raise ValueError(
                f"Lightning was given devices={num_devices}, num_nodes={num_nodes} ({num_devices * num_nodes} "
                f"processes), but nbdist's world has {world} ranks ({local} on each of {nodes} node(s)): pass "
                f"devices={local}, num_nodes={nodes}, or start {num_devices * num_nodes} ranks with "
                f"%dist_start -n {num_devices * num_nodes}."
            )
        original(self, num_devices, num_nodes)

    validate_settings.__wrapped__ = original  # type: ignore[attr-defined]
    cls.validate_settings = validate_settings


# --------------------------------------------------------------------------- Accelerate


def accelerate_launchers(module: ModuleType) -> None:
    """notebook_launcher / debug_launcher: one line saying why they are not needed on a rank."""
    for name in ("notebook_launcher", "debug_launcher"):
        original = getattr(module, name, None)
        if original is None:
            continue
        replacement = _refusing_launcher(name, original)
        setattr(module, name, replacement)
        launchers = sys.modules.get("accelerate.launchers")
        if launchers is not None and getattr(launchers, name, None) is original:
            setattr(launchers, name, replacement)


def _refusing_launcher(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def launcher(function: Callable[..., Any], args: tuple = (), *rest: Any, **kwargs: Any) -> Any:
        if not world_up():
            return original(function, args, *rest, **kwargs)
        fn = getattr(function, "__name__", "function")
        raise RuntimeError(
            f"accelerate.{name} starts processes of its own, but this cell already runs on each of nbdist's "
            f"{os.environ.get('WORLD_SIZE')} ranks: call {fn}(*args) directly (Accelerator() uses the world)."
        )

    launcher.__wrapped__ = original  # type: ignore[attr-defined]
    launcher.__name__ = name
    return launcher


# --------------------------------------------------------------------------- DeepSpeed


def deepspeed_comm(module: ModuleType) -> None:
    """init_distributed(dist_backend=...) with a backend this world lacks fails naming it."""
    original = module.init_distributed

    def init_distributed(dist_backend: Any = None, *args: Any, **kwargs: Any) -> Any:
        if dist_backend and world_up():
            hosted.check_backend(
                dist_backend, f"deepspeed.init_distributed(dist_backend={dist_backend!r})", "dist_backend"
            )
        return original(dist_backend, *args, **kwargs)

    init_distributed.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(module, "init_distributed", init_distributed)  # noqa: B010 - the module's own name


def tqdm_console(module: ModuleType) -> None:
    """tqdm.autonotebook / tqdm.auto: the console bar (tqdm.std; tqdm.asyncio's for tqdm.auto)."""
    from tqdm import std
    from tqdm.asyncio import tqdm_asyncio

    bar = tqdm_asyncio if module.__name__ == "tqdm.auto" else std.tqdm

    def trange(*args: Any, **kwargs: Any) -> Any:
        return bar(range(*args), **kwargs)

    module.tqdm = bar  # type: ignore[attr-defined]
    module.trange = trange  # type: ignore[attr-defined]


ADJUST: dict[str, Callable[[ModuleType], None]] = {
    "tqdm.autonotebook": tqdm_console,
    "tqdm.auto": tqdm_console,
    "lightning.fabric.strategies.ddp": lightning_ddp,
    "lightning_fabric.strategies.ddp": lightning_ddp,
    "lightning.pytorch.strategies.ddp": lightning_ddp,
    "pytorch_lightning.strategies.ddp": lightning_ddp,
    "lightning.fabric.plugins.environments.torchelastic": lightning_torchelastic,
    "lightning_fabric.plugins.environments.torchelastic": lightning_torchelastic,
    "accelerate": accelerate_launchers,
    "deepspeed.comm.comm": deepspeed_comm,
}


# --------------------------------------------------------------------------- the import hook


def adjust(module: ModuleType) -> None:
    """Apply this module's adjustment once; a library that moved a name loses only the adjustment."""
    fix = ADJUST.get(module.__name__)
    if fix is None or getattr(module, MARK, False):
        return
    try:
        fix(module)
    except Exception as exc:  # an upgrade moved what we adjust: the library still works as itself
        say(f"could not adapt {module.__name__} to the world ({type(exc).__name__}: {exc}); it runs unchanged")
    setattr(module, MARK, True)


class _AdjustingLoader(importlib.abc.Loader):
    """The module's own loader, then ``adjust``; anything else is the original loader's."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        adjust(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for the modules in ADJUST it wraps the loader the other finders found."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in ADJUST:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _AdjustingLoader(spec.loader)
                return spec
        return None


def install() -> None:
    """Put the hook first on sys.meta_path (once) and adjust what is already imported."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    for name in ADJUST:
        module = sys.modules.get(name)
        if module is not None:
            adjust(module)
