"""Which world a kernel's distributed cells ran on, for nbdist's server extension: one 0600 file per
kernel, ``<Jupyter runtime dir>/nbdist-kernels/<kernel id>.json``, in a 0700 directory. Written when a
cell starts a transcript (transcript.py) and at ``%dist_attach``; dropped when the world stops; the
server prunes those of kernels gone with an earlier server."""

from __future__ import annotations

import json
import os
from typing import Any

from .. import wire

POINTERS = "nbdist-kernels"  # in Jupyter's runtime directory: which world each kernel's cells ran on


def pointer_path(kernel_id: str) -> str:
    from jupyter_core.paths import jupyter_runtime_dir

    return os.path.join(jupyter_runtime_dir(), POINTERS, f"{kernel_id}.json")


def this_kernel() -> tuple[str, dict[str, Any]]:
    """(this kernel's id, the execute request being run: its cell id, count and source), or ('', {}) outside a
    Jupyter kernel. The id is the one the Jupyter server knows (its connection file is kernel-<id>.json)."""
    try:
        from ipykernel.connect import get_connection_file
        from IPython import get_ipython

        shell = get_ipython()
        kernel = getattr(shell, "kernel", None)
        if kernel is None:
            return "", {}
        name = os.path.basename(get_connection_file())
        kernel_id = name[len("kernel-") : -len(".json")] if name.startswith("kernel-") else ""
        parent = kernel.get_parent() or {}
    except Exception:  # not in a kernel, or one without a connection file
        return "", {}
    cell = {
        "id": (parent.get("metadata") or {}).get("cellId", ""),
        "count": _count(shell),
        "code": (parent.get("content") or {}).get("code", ""),  # the cell's whole source, as the page sent it
    }
    return kernel_id, cell


def _count(shell: Any) -> int | None:
    """The execution count the page shows for the cell running now (its execute_reply's). IPython 9
    advances ``shell.execution_count`` before the cell runs, older IPython after; the running cell's
    result holds its own count in both."""
    result = getattr(getattr(shell, "displayhook", None), "exec_result", None)
    count = getattr(result, "execution_count", None)
    return count if isinstance(count, int) else shell.execution_count


def point(workdir: str, kernel_id: str = "") -> None:
    """Say that this kernel's distributed cells run on the world in ``workdir`` (a 0600 file in a 0700
    directory of Jupyter's runtime directory), for the server extension. At ``%dist_attach`` too: the
    transcripts of a kept world come back with it."""
    kernel_id = kernel_id or this_kernel()[0]
    if not kernel_id:
        return
    path = pointer_path(kernel_id)
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        wire.write_private(path, json.dumps({"workdir": workdir, "pid": os.getpid()}))
    except OSError:
        pass  # the cells run as before; a page opened later cannot show them


def unpoint(workdir: str) -> None:
    """The world in ``workdir`` stopped: drop this kernel's pointer if it names that world."""
    kernel_id = this_kernel()[0]
    if not kernel_id:
        return
    path = pointer_path(kernel_id)
    try:
        with open(path) as fh:
            if json.load(fh).get("workdir") == workdir:
                os.unlink(path)
    except (OSError, ValueError, AttributeError):
        pass


def prune(alive: set[str]) -> int:
    """Remove the pointers of kernels that are gone: neither ``alive`` (this server's kernels, as it starts: its
    kernels of before are gone) nor running still. Another Jupyter server of this user (a second JupyterLab, a
    hub's) shares the runtime directory: its kernels' pointers stay, or its pages could not show their cells
    when opened again. The number removed."""
    from jupyter_core.paths import jupyter_runtime_dir

    where = os.path.join(jupyter_runtime_dir(), POINTERS)
    removed = 0
    try:
        names = os.listdir(where)
    except OSError:
        return 0
    for name in names:
        kernel_id = name[: -len(".json")]
        path = os.path.join(where, name)
        if not name.endswith(".json") or kernel_id in alive or _running(path, kernel_id):
            continue
        try:
            os.unlink(path)
            removed += 1
        except OSError:
            pass
    return removed


def _running(path: str, kernel_id: str) -> bool:
    """Whether the kernel that wrote the pointer at ``path`` still runs: its pid is a process started with that
    kernel's connection file (kernel-<id>.json), so a reused pid does not count."""
    import psutil

    try:
        with open(path) as fh:
            pid = int(json.load(fh)["pid"])
        return any(f"kernel-{kernel_id}.json" in arg for arg in psutil.Process(pid).cmdline())
    except (OSError, ValueError, KeyError, TypeError, psutil.Error):
        return False
