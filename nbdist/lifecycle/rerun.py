"""What a cell run again from its first line repeats: recovery goes on from a step inside the cell's loop and runs
the whole cell again, so a loop around the loop over the loader (``for epoch in range(3):``) begins at its first
value again. A restored loader goes on mid-epoch; the epochs the cell had finished would be trained once more
unless that loop begins where the loader is (``range(loader.epoch, 3)``, as a torchrun script begins at the
epoch its checkpoint holds). And the names a setup cell binds anew (``binds``: recovery.py forgets a checkpoint of
the objects it replaced). Read from the cell's code, never run.
"""

from __future__ import annotations

import ast


def starts_over(code: str, loader: str) -> str:
    """The header of the first loop around a loop over ``loader`` (a plain ``for``, ``enumerate(loader)``, ...)
    that does not begin at ``loader.epoch``, as written; '' when there is none or the code does not parse."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return ""
    parents: dict[ast.AST, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    for node in ast.walk(tree):
        if not isinstance(node, (ast.For, ast.AsyncFor)) or not _reads(node.iter, loader, parents):
            continue
        outer = parents.get(node)
        while outer is not None:
            if isinstance(outer, (ast.For, ast.AsyncFor)) and not _from_epoch(outer.iter, loader):
                return f"for {ast.unparse(outer.target)} in {ast.unparse(outer.iter)}"
            outer = parents.get(outer)
    return ""


def fix(header: str, loader: str) -> str:
    """The header begun where the loader is: ``range(3)`` or ``range(0, 3)`` -> ``range(loader.epoch, 3)``."""
    try:
        loop = ast.parse(header + ": pass").body[0]
    except SyntaxError:
        return f"begin it at {loader}.epoch"
    assert isinstance(loop, ast.For)
    call = loop.iter
    if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "range" and call.args:
        stop = call.args[0] if len(call.args) == 1 else call.args[1]
        return f"write `for {ast.unparse(loop.target)} in range({loader}.epoch, {ast.unparse(stop)})`"
    return f"begin it at {loader}.epoch"


def binds(code: str) -> set[str]:
    """The names the cell's code binds at its top level (assigned, imported, defined, a loop's or a ``with``'s
    target), not those bound inside its functions and classes; none when it does not parse."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return set()
    out: set[str] = set()
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
            continue  # its body binds its own names
        if isinstance(node, ast.Lambda):
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update((a.asname or a.name).split(".")[0] for a in node.names if a.name != "*")
        todo.extend(ast.iter_child_nodes(node))
    return out


def _reads(expr: ast.expr, loader: str, parents: dict[ast.AST, ast.AST]) -> bool:
    """The loader itself is iterated (not one of its attributes, as ``loader.steps(n)``, which counts steps)."""
    return any(
        isinstance(n, ast.Name) and n.id == loader and not isinstance(parents.get(n), ast.Attribute)
        for n in ast.walk(expr)
    )


def _from_epoch(expr: ast.expr, loader: str) -> bool:
    return any(
        isinstance(n, ast.Attribute) and n.attr == "epoch" and isinstance(n.value, ast.Name) and n.value.id == loader
        for n in ast.walk(expr)
    )
