"""``%dist_export train.py``: the session's cells as a script torchrun runs, and an sbatch script.

The cells that succeeded on the ranks (history.py), in the order they ran, become one
script: torchrun's rendezvous (``init_process_group`` from its env vars) first, each cell
under a comment naming it, cells that ran on some ranks only inside a rank check, and
``destroy_process_group`` last. Beside it, ``train.sbatch`` runs it on Slurm: one torchrun
per node through srun, the rendezvous on the allocation's first node.

What a script cannot hold is said, not dropped silently: IPython syntax (``%magic``,
``!shell``) is an error naming the cell and line; variables sent with ``%dist_push`` and
``%dist_run`` cells (already scripts) are listed in the notes.
"""

from __future__ import annotations

import ast
import datetime
import os
import pathlib
import re
import shlex
import sys
import textwrap
from dataclasses import dataclass, field

from ..cells.history import Cell, History
from ..errors import ConfigError
from ..world.views import WorldShape

MARK = "# Exported by nbdist"  # the first line of every script it writes: only those are overwritten
SCRIPT_NAME = re.compile(r"[A-Za-z0-9_.+-]+")  # a file name that an sbatch line and a shell read as itself


@dataclass(slots=True)
class Export:
    """What ``export`` wrote: the script, the sbatch script, the cells (numbers as listed), notes."""

    script: pathlib.Path
    sbatch: pathlib.Path
    cells: list[int]
    command: str  # the torchrun command for this machine
    notes: list[str] = field(default_factory=list)


def listing(history: History) -> list[str]:
    """One line per cell, numbered as ``--cells`` takes them."""
    out = []
    for i, cell in enumerate(history.cells, 1):
        kind = " (setup)" if cell.setup else ""
        out.append(f"{i:3d}{kind} ranks {_ranks(cell.ranks)}: {cell.title()}")
    return out


def select(history: History, spec: str | None) -> list[int]:
    """Cell numbers (1-based) from '1-3,5' (None: all); ConfigError names a bad one."""
    n = len(history.cells)
    if not n:
        raise ConfigError("no cell has run on the ranks yet; run your %%distributed cells first, then export.")
    if spec is None or spec.strip() in ("", "all"):
        return list(range(1, n + 1))
    chosen: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        first, last = (int(m.group(1)), int(m.group(2) or m.group(1))) if m else (0, -1)
        if not m or not 1 <= first <= last <= n:
            raise ConfigError(
                f"--cells {spec!r}: {part.strip()!r} is not a cell number or range within 1-{n}; "
                "see the numbers with %dist_export --list, e.g. --cells 1-3,5."
            )
        chosen += [i for i in range(first, last + 1) if i not in chosen]
    return chosen


def script_text(cells: list[tuple[int, Cell]], backend: str, world_size: int, name: str, pushed: set[str]) -> str:
    """The standalone script: torchrun's rendezvous, the cells in order, the group destroyed."""
    day = datetime.date.today().isoformat()
    init = (
        'local_rank = int(os.environ["LOCAL_RANK"])\n'
        "torch.cuda.set_device(local_rank)  # one GPU per process, as nbdist bound them\n"
        'dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))'
        if backend == "nccl"
        else f'dist.init_process_group("{backend}")'
    )
    head = [
        f"{MARK} from a notebook session on {day}: {len(cells)} cell(s), {world_size} ranks, {backend}.",
        f"# Run it on this machine:  torchrun --nproc-per-node {world_size} {name}",
        f"# On a Slurm cluster:      sbatch {pathlib.Path(name).stem}.sbatch",
        "# Every process runs the cells in the order they ran in the notebook; a cell that ran",
        "# on some ranks only is inside a rank check.",
    ]
    needed = sorted(n for n in pushed if any(re.search(rf"\b{re.escape(n)}\b", c.code) for _, c in cells))
    if needed:
        head.append(f"# NOTE: {', '.join(needed)} came from the notebook (%dist_push); define them before use.")
    body = [
        "import os",
        "",
        "import torch",
        "import torch.distributed as dist",
        "",
        "# torchrun sets RANK,",
        "# WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; nbdist set the same on its ranks.",
        init,
    ]
    for number, cell in cells:
        code = _plain(cell.code, number).rstrip()
        tag = " (setup)" if cell.setup else ""
        body += ["", "", f"# ---- cell {number}{tag}, ran on ranks {_ranks(cell.ranks)}"]
        if len(cell.ranks) < world_size:
            body += [f"if dist.get_rank() in {tuple(cell.ranks)!r}:", textwrap.indent(code or "pass", "    ")]
        else:
            body.append(code)
    # the notebook waited for every rank at the end of each cell; the script waits once, before it ends, so no
    # process exits while another still writes (torchrun ends the rest when one process fails at exit)
    body += ["", "", "dist.barrier()  # every rank has finished, as at the end of each cell in the notebook"]
    body += ["dist.destroy_process_group()", ""]
    return "\n".join(head + body)


def sbatch_text(script: str, nodes: int, per_node: int, backend: str, threads: int, python: str) -> str:
    """srun starts one torchrun per node; the first node of the allocation hosts the rendezvous."""
    gpus = f"#SBATCH --gpus-per-node={per_node}\n" if backend == "nccl" else ""
    job = pathlib.Path(script).stem
    return f"""#!/bin/bash
{MARK}: runs {script} on {nodes} node(s) x {per_node} process(es), as the notebook's ranks ran.
#SBATCH --job-name={job}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task={max(1, per_node * threads)}
{gpus}#SBATCH --time=00:30:00
#SBATCH --output={job}-%j.out
set -euo pipefail
# The rendezvous runs on the allocation's first node; every node's torchrun finds it there.
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
export MASTER_ADDR MASTER_PORT OMP_NUM_THREADS={threads}
# The notebook's Python (change it when the nodes use another environment).
PYTHON={shlex.quote(python)}
srun --ntasks-per-node=1 --kill-on-bad-exit=1 "$PYTHON" -m torch.distributed.run \\
    --nnodes="$SLURM_JOB_NUM_NODES" --nproc-per-node={per_node} \\
    --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID" \\
    {script} "$@"
"""


def export(
    history: History, shape: WorldShape, path: str | os.PathLike[str], cells: str | None = None, force: bool = False
) -> Export:
    """Write the cells of ``history`` as a script for a world of ``shape``, and its sbatch script beside it;
    return what was written."""
    target = pathlib.Path(path).expanduser()
    if target.suffix != ".py":
        raise ConfigError(f"export to {str(path)!r}: name a .py file, e.g. %dist_export train.py.")
    if not SCRIPT_NAME.fullmatch(target.name):  # the name goes into the sbatch script's lines
        raise ConfigError(
            f"export to {str(path)!r}: the sbatch script names the file, so its name may hold only letters, "
            "digits, '.', '_', '+' and '-'; e.g. %dist_export train.py."
        )
    numbers = select(history, cells)
    sbatch = target.with_suffix(".sbatch")
    for file in (target, sbatch):
        if (
            file.exists()
            and not force
            and not file.read_text(errors="replace").startswith(("#!/bin/bash\n" + MARK, MARK))
        ):
            raise ConfigError(
                f"{file} exists and was not written by %dist_export; choose another name, or pass --force to replace it."
            )
    notes = []
    chosen = [(i, history.cells[i - 1]) for i in numbers]
    scripts = [i for i, c in chosen if c.script]
    if scripts:
        notes.append(f"left out cell(s) {_ranks(scripts)}: %dist_run of a script that already runs under torchrun.")
    kept = [(i, c) for i, c in chosen if not c.script]
    nodes, per_node = shape.nodes, shape.world_size // max(1, shape.nodes)
    text = script_text(kept, shape.backend, shape.world_size, target.name, history.pushed)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    threads = shape.threads or int(os.environ.get("OMP_NUM_THREADS") or 1)
    sbatch.write_text(sbatch_text(target.name, nodes, per_node, shape.backend, threads, sys.executable))
    sbatch.chmod(0o755)
    if "NOTE:" in text:
        notes.append(next(ln for ln in text.splitlines() if "NOTE:" in ln).lstrip("# "))
    command = f"torchrun --nproc-per-node {shape.world_size} {target.name}"
    return Export(target, sbatch, [i for i, _ in kept], command, notes)


def _plain(code: str, number: int) -> str:
    """The cell as plain Python; ConfigError at the first line IPython would have to run."""
    from IPython.core.inputtransformer2 import TransformerManager

    plain = TransformerManager().transform_cell(code)
    if "get_ipython()" in plain and "get_ipython()" not in code:
        for lineno, line in enumerate(code.splitlines(), 1):
            if "get_ipython()" in TransformerManager().transform_cell(line + "\n"):
                raise ConfigError(
                    f"cell {number} line {lineno} ({line.strip()!r}) is IPython syntax a script cannot run; "
                    f"rewrite it in Python, or leave the cell out with --cells (see %dist_export --list)."
                )
    return _world_calls_out(code)


def _world_calls_out(code: str) -> str:
    """The cell's own init_process_group / destroy_process_group() calls, commented out: the script
    sets up its world once at the top and ends it once at the bottom (torchrun would refuse a second)."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return code
    lines = code.splitlines()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)):
            continue
        call = node.value
        name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
        first, last = node.lineno - 1, (node.end_lineno or node.lineno) - 1
        indent = lines[first][: node.col_offset]
        whole = not indent.strip() and not lines[last][node.end_col_offset or 0 :].strip()
        if whole and (name == "init_process_group" or (name == "destroy_process_group" and not call.args)):
            lines[first] = f"{indent}pass  # {lines[first].strip()}  <- the world is set up once, at the top"
            for i in range(first + 1, last + 1):
                lines[i] = f"{indent}# {lines[i].strip()}"
    return "\n".join(lines)


def _ranks(ranks: list[int]) -> str:
    return ",".join(map(str, ranks))
