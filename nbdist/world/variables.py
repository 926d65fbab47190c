"""Variables between the notebook and the ranks' namespaces: ``%dist_push`` and ``%dist_pull``.

A value that cannot travel is named before anything is sent, with its type and what to send instead
(docs/faults.md, row 8); a value that cannot come back is named with its rank, type and device.
"""

from __future__ import annotations

import pickle
from typing import Any

from ..errors import ClusterError
from ..results import remote_error
from .engineset import EngineSet


def push(engines: EngineSet, mapping: dict[str, Any], ranks: list[int]) -> None:
    """Send variables to these ranks' namespaces (docs/faults.md, row 8: unpicklable values named)."""
    for name, value in mapping.items():
        _check_picklable(name, value)
    engines.call(ranks, _set, mapping, timeout=engines.config.world.timeout).ordered("sending variables", ranks)


def pull(engines: EngineSet, name: str, ranks: list[int]) -> list[Any]:
    """A variable's value on each of these ranks, in rank order."""
    got = engines.call(ranks, _get, name, timeout=engines.config.world.timeout)
    for rank, exc in sorted(got.errors.items()):
        raise _pull_error(engines, name, rank, engines.ranks[rank].engine_id, exc)
    return got.ordered(f"fetching {name!r}", ranks)


def _pull_error(engines: EngineSet, name: str, rank: int, eid: int, exc: BaseException) -> ClusterError:
    err = remote_error(exc)
    if err["ename"] == "NameError":
        return ClusterError(
            f"rank {rank} has no variable {name!r}; define it in a %%distributed cell first."
        )
    asked = engines.call([rank], _type_name, name, timeout=engines.config.world.timeout)
    kind = str(asked.values.get(rank, "unknown"))
    hint = " Move it to the CPU first (.cpu())." if "cuda" in kind.lower() else ""
    return ClusterError(
        f"cannot fetch {name!r} (type {kind}) from rank {rank}: {err['ename']}: "
        f"{err['evalue']}. Convert it to a picklable value (a number, list, numpy array or CPU tensor)"
        f" on the ranks first.{hint}"
    )


def _check_picklable(name: str, value: Any) -> None:
    try:
        import cloudpickle as pickler  # what ipyparallel uses for functions and closures
    except ImportError:  # pragma: no cover
        pickler = pickle  # type: ignore[no-redef]
    try:
        pickler.dumps(value)
    except Exception as exc:
        raise ClusterError(
            f"cannot send {name!r} (type {type(value).__module__}.{type(value).__qualname__}) to the ranks: "
            f"{type(exc).__name__}: {exc}. Send a simpler value (numbers, lists, dicts, numpy arrays, "
            "CPU tensors: use .cpu()), or build it inside a %%distributed cell."
        ) from exc


def _type_name(name: str) -> str:
    """On an engine: the type (and device) of a variable in its namespace."""
    value = _get(name)
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    device = getattr(value, "device", None)
    return f"{kind} on {device}" if device is not None else kind


def _set(mapping: dict[str, Any]) -> None:
    """On an engine: these variables into its namespace."""
    from IPython import get_ipython

    get_ipython().user_ns.update(mapping)  # type: ignore[union-attr]


def _get(name: str) -> Any:
    """On an engine: a variable (or an expression of them) of its namespace; NameError when it has none."""
    from IPython import get_ipython

    return eval(name, get_ipython().user_ns)  # type: ignore[union-attr]
