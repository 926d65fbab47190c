"""The layout's rules, checked on the source: arrows point down, files stay small, privates stay home.

Every import counts, wherever it is written: at the top, inside a function, or under
``if TYPE_CHECKING``. A package's implicit import of its parent ``__init__`` does not.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2] / "nbdist"
MAX_LINES = 400
# The Cluster is a thin face over lifecycle/ (issue 57): what it grows beyond that belongs below it.
ROOMY = {"nbdist.cluster": 260}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _package(name: str) -> str:
    return name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]


def _imports(name: str) -> list[tuple[str, list[str], int]]:
    """(module imported, names taken from it, line) for every import statement in a module."""
    tree = ast.parse(MODULES[name].read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = _package(name).split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            out.append((base, [alias.name for alias in node.names], node.lineno))
    return out


def _edges(name: str) -> set[str]:
    """The nbdist modules this module imports (a name taken from a package that is a submodule counts as it)."""
    edges = set()
    for base, names, _ in _imports(name):
        if not base.startswith("nbdist"):
            continue
        subs = [f"{base}.{n}" for n in names if f"{base}.{n}" in MODULES]
        edges.update(subs or [base])
        if names and len(subs) < len(names) and base in MODULES:
            edges.add(base)
    edges.discard(name)
    return {e for e in edges if e in MODULES}


GRAPH = {name: _edges(name) for name in MODULES}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_checker_sees_function_level_and_relative_imports():
    assert "nbdist.cluster" in GRAPH["nbdist"]  # imported inside nbdist.__getattr__
    assert "nbdist.engine.runtime" in GRAPH["nbdist.world.rendezvous"]  # from .engine import runtime
    assert "nbdist.compat" in GRAPH["nbdist.engine.runtime"]  # from .. import compat
    assert "nbdist.widgets.dashboard" in GRAPH["nbdist.cells.output"]  # imported inside a method


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle_among_nbdist_modules():
    cycle = _cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_core_points_down():
    """magics -> cluster -> run -> engines -> launchers; nothing below imports what is above it."""
    order = ["nbdist.magics", "nbdist.cluster", "nbdist.cells.run", "nbdist.world.rendezvous", "nbdist.world.engineset"]
    for i, upper in enumerate(order):
        for lower in order[i + 1 :]:
            assert upper not in _reach(lower), f"{lower} reaches {upper}"
    for low in ("nbdist.errors", "nbdist.results", "nbdist.cells.release", "nbdist.compat", "nbdist.config"):
        assert not _reach(low) & {"nbdist.cluster", "nbdist.cells.run", "nbdist.world.engineset", "nbdist.magics"}, low
    compat = {n for n in MODULES if n == "nbdist.compat" or n.startswith("nbdist.compat.")}
    assert len(compat) > 4, "compat/ holds one module per project it adapts"
    for name in compat:
        assert GRAPH[name] <= compat, f"compat/ is a leaf: {name} imports {sorted(GRAPH[name] - compat)}"


# The folders and what each may import (docs/architecture.md draws them). SHARED are the words every
# layer uses; they import only each other. A module outside every folder is one of the API's own
# (cluster.py, __init__, demo), which may import any folder below the magics.
SHARED = {"errors", "config", "compat", "wire", "results", "doctor", "equivalence", "stragglers"}  # doctor, equivalence, stragglers: pure verdicts
FOLDERS = {
    "magics": {"tools", "cluster", "cells", "world", "launch", "widgets", "forecast", "tracking"},  # faces: call the API
    "server": {"cells", "world", "widgets"},  # the Jupyter server's side: what the kernel wrote, read from disk
    "tools": {"cluster", "cells", "world", "launch", "engine", "parallel", "compression", "forecast", "tracking"},
    # a world's life: its membership and every change to it, a cell's way through it, recovery, grow; the on-rank
    # halves of recovery live in parallel/ and engine/ and are called there by name
    "lifecycle": {"cells", "world", "launch", "engine", "parallel"},
    "cells": {"world", "launch", "widgets"},  # a cell's path: run, release, output, history
    "world": {"launch", "engine"},  # the engines with ranks, the process group, views of both
    "launch": set(),  # processes on hosts: knows nothing of ranks, cells or torch.distributed
    "engine": {"launch.net", "launch.slurm"},  # the rank side: no helper, widget, magic or kernel-side module
    "parallel": {"engine", "compression"},  # helpers called inside cells, on the ranks
    "compression": set(),  # kernels and hooks: numpy, numba, torch
    "widgets": set(),  # draw what they are given; not even the shared words
    "tutorials": set(),
    # the forecast: a cell run under fake tensors in a process of its own, and the real step it is checked against
    "forecast": {"parallel"},
    # a tracked run: the rows the cell path hands it, written to a tracker from the notebook
    "tracking": set(),
}
# Named exceptions, each with its reason.
EXCEPTIONS = {
    # the warm process's entry point imports what every rank will use, so the forks share it
    ("engine.warm", "parallel"): "preload",
    ("engine.warm", "compression.kernels"): "preload",
    # a recovery's calls on the ranks: a call's function is imported where it runs, and every engine has imported
    # engine/ before a recovery (lifecycle/ it had not: 25 ms of a core on each rank at once, 0.1 s at 8 ranks)
    ("engine.recovering", "parallel"): "the on-rank halves of a recovery",
}


def _folder(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in FOLDERS else ""


def _shared(short: str) -> bool:
    """One of the shared words (compat/ is a package of them: one module per project it adapts)."""
    return short.split(".")[0] in SHARED


def _allowed(name: str, target: str) -> bool:
    short, tshort = name.removeprefix("nbdist."), target.removeprefix("nbdist.")
    folder, tfolder = _folder(name), _folder(target)
    if folder == "widgets":
        return tfolder == "widgets"
    if folder and folder == tfolder:
        return True
    if _shared(tshort):
        return True
    if _shared(short):
        return False
    if not folder:  # the API (cluster, recovery, demo) and the front door, which loads the magics
        return name == "nbdist" or tfolder not in ("magics", "tools")
    if any(short.startswith(m) and tshort.startswith(t) for m, t in EXCEPTIONS):
        return True
    return tfolder in FOLDERS[folder] or tshort in FOLDERS[folder]


def _folder_violations(graph: dict[str, set[str]]) -> list[str]:
    return [f"{a} imports {b}" for a in sorted(graph) for b in sorted(graph[a]) if not _allowed(a, b)]


def test_each_folder_imports_only_what_its_rule_allows():
    bad = _folder_violations(GRAPH)
    assert not bad, "imports against the folder rules (tests/unit/test_architecture.py FOLDERS):\n" + "\n".join(bad)


def test_the_folder_rules_catch_an_arrow_that_runs_up():
    assert _folder_violations({"nbdist.engine.runtime": {"nbdist.parallel.checkpoint"}})
    assert _folder_violations({"nbdist.engine.metrics": {"nbdist.widgets.dashboard"}})
    assert _folder_violations({"nbdist.launch.pool": {"nbdist.world.engineset"}})
    assert _folder_violations({"nbdist.world.engineset": {"nbdist.cells.run"}})
    assert _folder_violations({"nbdist.widgets": {"nbdist.results"}})
    assert _folder_violations({"nbdist.results": {"nbdist.cluster"}})
    assert _folder_violations({"nbdist.cluster": {"nbdist.magics"}})
    assert _folder_violations({"nbdist.cluster": {"nbdist.tools.bench"}})
    assert _folder_violations({"nbdist.config": {"nbdist.launch.net"}})
    assert _folder_violations({"nbdist.engine.runtime": {"nbdist.launch.pool"}})
    assert not _folder_violations({"nbdist.engine.warm": {"nbdist.parallel"}})


def test_the_top_level_holds_the_api_and_the_shared_words_only():
    top = {n.removeprefix("nbdist.") for n in MODULES if n.count(".") == 1 and not _folder(n)}
    assert top <= SHARED | {"cluster", "demo"}, sorted(top - SHARED)
    assert len(top) <= 10, f"{len(top)} modules at the top level: {sorted(top)}"


# Who may import the lifecycle folder: the faces above it. Nothing below it does (the folder rules above say so for
# each folder; this says it for the folder as a whole, whatever rules are added later).
ABOVE_LIFECYCLE = {"nbdist", "nbdist.cluster", "nbdist.demo"}


def _lifecycle_importers(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{a} imports {b}"
        for a, targets in graph.items()
        for b in targets
        if _folder(b) == "lifecycle" and _folder(a) not in ("lifecycle", "magics", "tools") and a not in ABOVE_LIFECYCLE
    )


def test_nothing_below_the_lifecycle_imports_it():
    bad = _lifecycle_importers(GRAPH)
    assert not bad, "\n".join(bad)
    assert _lifecycle_importers({"nbdist.world.engineset": {"nbdist.lifecycle.membership"}})
    assert _lifecycle_importers({"nbdist.cells.run": {"nbdist.lifecycle.recovery"}})
    assert not _lifecycle_importers({"nbdist.cluster": {"nbdist.lifecycle.membership"}})


def test_membership_calls_nothing_above_it():
    """The one owner of membership is the bottom of the lifecycle: it imports nothing else of its folder."""
    assert "nbdist.lifecycle.membership" in MODULES
    inside = {t for t in GRAPH["nbdist.lifecycle.membership"] if _folder(t) == "lifecycle"}
    assert not inside, f"lifecycle/membership.py imports {sorted(inside)}"


def _callables_in_fields(path: pathlib.Path, cls: str) -> list[str]:
    """The fields of a dataclass whose annotation is a callable (what a bound method of the Cluster would be)."""
    tree = ast.parse(path.read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    return [
        f"{cls}.{stmt.target.id}: {ast.unparse(stmt.annotation)}"
        for stmt in node.body
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and "Callable" in ast.unparse(stmt.annotation)
    ]


def test_the_cell_path_is_given_the_membership_not_callables():
    for module, cls in (("nbdist.lifecycle.cellpath", "CellPath"), ("nbdist.lifecycle.recovery", "Replay")):
        found = _callables_in_fields(MODULES[module], cls)
        assert not found, f"a callable handed down instead of the membership: {found}"
    probe = pathlib.Path(__file__).with_name("_probe_fields.py")
    probe.write_text("class CellPath:\n    restart: Callable[[list[int]], float]\n")
    try:
        assert _callables_in_fields(probe, "CellPath"), "the field check misses a callable"
    finally:
        probe.unlink()


def test_no_attribute_of_the_cell_path_is_a_bound_method_of_the_cluster():
    from nbdist.cluster import Cluster

    cluster = Cluster(n=2)
    path = cluster.cells
    values = [getattr(path, name) for name in type(path).__dataclass_fields__]
    bound = [v for v in values if getattr(v, "__self__", None) is cluster]
    assert not bound, f"CellPath holds the Cluster's methods: {bound}"
    assert path.membership is cluster.membership and path.recovery is cluster.recovery


def _reach(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in GRAPH[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_is_over_400_lines(name):
    lines = len(MODULES[name].read_text().splitlines())
    limit = next((cap for part, cap in ROOMY.items() if name == part or name.startswith(part + ".")), MAX_LINES)
    assert lines <= limit, f"{MODULES[name]} has {lines} lines; split it by job (limit {limit})"


def test_no_private_name_crosses_a_module_boundary():
    found = []
    for name in MODULES:
        for base, names, line in _imports(name):
            if base.startswith("nbdist"):
                found += [f"{name}:{line} imports {base}.{n}" for n in names if n.startswith("_")]
        tree = ast.parse(MODULES[name].read_text())
        aliases = _module_aliases(name)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                found.append(f"{name}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    assert not found, "\n".join(found)


def _module_aliases(name: str) -> dict[str, str]:
    """Local names bound to nbdist modules in this module: {'api': 'nbdist.cluster', ...}."""
    tree = ast.parse(MODULES[name].read_text())
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = {b for b, _, line in _imports(name) if line == node.lineno}.pop()
            for alias in node.names:
                if f"{base}.{alias.name}" in MODULES:
                    out[alias.asname or alias.name] = f"{base}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES and alias.asname:
                    out[alias.asname] = alias.name
    return out


def _record_dicts(tree: ast.Module) -> list[str]:
    """Module-level names bound to a dict literal with fixed string keys: a record kept as a dict."""
    found = []
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if (
            isinstance(value, ast.Dict)
            and len(value.keys) >= 2
            and all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in value.keys)
            and 2 * sum(isinstance(v, ast.Constant) for v in value.values) >= len(value.values)  # not a registry
        ):
            found += [t.id for t in targets if isinstance(t, ast.Name) and t.id.isupper()]
    return found


def test_the_rank_side_keeps_its_state_in_typed_objects_not_dicts_of_fixed_keys():
    """What a rank keeps between calls (peer recovery, preemption, collectives, the debugger) is a dataclass: a
    misspelt field is a mypy error, not a KeyError on a rank in the middle of training (#57)."""
    found = [
        f"{name}.{var}"
        for name, path in MODULES.items()
        if _folder(name) in ("engine", "parallel")
        for var in _record_dicts(ast.parse(path.read_text()))
    ]
    assert not found, f"module-level records kept as dicts: {found}"
    planted = ast.parse('KEPT: dict[str, Any] = {"loader": None, "done": 0}\nNAMES = {"a": 1}\nBY = {"a": f, "b": g}\n')
    assert _record_dicts(planted) == ["KEPT"]
