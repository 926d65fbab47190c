"""A warm engine: import torch and ipyparallel's engine now, become an engine when told.

Started by ``nbdist.pool`` while nobody waits for it (for example right after
``%load_ext nbdist``). It reads one JSON line on stdin, the job the launcher would
have passed to a fresh process: arguments, environment, working directory and log
file. Then it turns into an ordinary ``python -m nbdist.engine``. End of input
(the pool closing its pipe) means it is not needed: it exits quietly.
"""

from __future__ import annotations

import json
import os
import sys


def _become(job: dict) -> None:
    out = os.open(job["output"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    args = list(job["args"])
    if not any(a.startswith(("--work-dir", "--BaseParallelApplication.work_dir")) for a in args):
        # ipyparallel's default is the cwd at import time, which was before the job came
        args.append(f"--work-dir={job['cwd']}")
    sys.argv = [sys.argv[0], *args]
    if sys.path and sys.path[0] != job["cwd"]:
        sys.path[0] = job["cwd"]  # what `python -m` started in cwd would have


def _job_waiting() -> bool:
    import select

    return bool(select.select([sys.stdin.buffer], [], [], 0)[0])


def _preload_numba() -> None:
    """Numba loads its typing registries on the first call of any jitted function
    (about 0.3 s, even with every kernel cached): pay that here, while nobody waits,
    so a notebook's first compressed step does not."""
    import numpy as np

    from nbdist.compression import kernels

    kernels.sign_pack(np.zeros(8, np.float32), np.empty(1, np.uint8))
    if not _job_waiting():
        kernels.topk(np.zeros(8, np.float32), 1)


def main() -> None:
    from nbdist.engine.__main__ import preload, run_engine
    from nbdist.engine.parentwatch import watch_parent

    watch_parent()
    preload()
    if not _job_waiting():  # an engine is wanted now: don't make it wait for extras
        try:
            _preload_numba()
        except Exception:  # only an optimisation; the engine reports real errors when used
            pass
    line = sys.stdin.buffer.readline()
    if not line.strip():
        return
    _become(json.loads(line))
    run_engine()


if __name__ == "__main__":
    main()
