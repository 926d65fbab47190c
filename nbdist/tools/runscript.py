"""``%dist_run script.py args``: a torchrun-style script, unchanged, on every live rank as one cell.

The script's source goes to the ranks (they need not share the notebook's filesystem)
and runs there as ``__main__`` with ``sys.argv`` and torchrun's environment
(engine/hosted.py); its ``init_process_group`` / ``destroy_process_group`` calls keep the
world nbdist built. It is a cell like any other: output tagged by rank, failures,
timeouts, Ctrl-C, metrics and the dashboard behave the same.
"""

from __future__ import annotations

import difflib
import os
import pathlib
import shlex
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..cells.history import SCRIPT
from ..config import check_plain_value
from ..errors import ConfigError

if TYPE_CHECKING:
    from ..cluster import Cluster


def script_cell(path: str | os.PathLike[str], args: Sequence[str] = ()) -> str:
    """The code that runs the script on a rank; ConfigError when it is missing or does not compile."""
    check_plain_value("%dist_run", str(path), "train.py")
    for arg in args:  # they go into the cell's first line, as its name in the history
        check_plain_value(f"%dist_run {pathlib.Path(path).name} argument", str(arg), "--epochs 1")
    file = pathlib.Path(path).expanduser()
    if not file.is_file():
        near = difflib.get_close_matches(file.name, [p.name for p in file.parent.glob("*.py")], n=1)
        hint = (
            f"did you mean {near[0]!r}?"
            if near
            else "give the path of a Python script, e.g. %dist_run train.py --epochs 1."
        )
        raise ConfigError(f"script {str(path)!r} is not a file (looked in {file.parent.resolve()}); {hint}")
    source = file.read_text()
    try:
        compile(source, str(file), "exec")
    except SyntaxError as exc:  # said once here, not once per rank
        raise ConfigError(f"{file.name} line {exc.lineno}: {exc.msg}; fix the script, then run it again.") from None
    shown = " ".join([file.name, *map(shlex.quote, args)])
    return (
        f"{SCRIPT}{shown}\n"
        f"__import__('nbdist.engine.hosted', fromlist=['run_script']).run_script("
        f"{source!r}, {str(file.resolve())!r}, {[str(a) for a in args]!r})\n"
    )


def run_script(cluster: Cluster, path: str | os.PathLike[str], args: Sequence[str] = (), **run: Any) -> Any:
    """Run the script on the cluster's ranks (``run``: Cluster.run's ranks, timeout, block, quiet, sink)."""
    return cluster.run(script_cell(path, args), **run)
