"""Start one ipyparallel engine with torch already imported and the kernel watched.

Importing torch here, while the controller is still starting, overlaps the two
slowest parts of a cold start instead of running them one after the other.
"""

from __future__ import annotations

import os
import sys


def _fault_exit_one() -> None:
    # Fault drill (docs/faults.md, row 7): the first engine that creates this file exits
    # at once, so a test can start a world in which one rank never joins.
    path = os.environ.get("NBDIST_FAULT_EXIT_ONE")
    if not path:
        return
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return
    os.close(fd)
    print("nbdist fault drill: this engine exits before registering (NBDIST_FAULT_EXIT_ONE)", file=sys.stderr)
    sys.exit(3)


def preload() -> None:
    """Import what every engine needs and is slow to import (torch: about 2 s)."""
    import ipyparallel.engine.app  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401


def run_engine() -> None:
    """Run ipyparallel's engine with this process's arguments (after the fault drill)."""
    from ipyparallel.engine.app import main as engine_main

    _fault_exit_one()
    engine_main()


def preflight() -> None:
    """On another host: can this engine reach the controller? If not, leave one line for the notebook
    (NBDIST_CLUSTER_DIR/preflight-HOST-RANK.txt, a shared directory) and exit, instead of timing out silently."""
    import json
    import socket
    import time

    from nbdist import net

    workdir, profile = os.environ.get("NBDIST_CLUSTER_DIR", ""), os.environ.get("IPP_PROFILE_DIR", "")
    cluster_id = os.environ.get("IPP_CLUSTER_ID", "")
    name = f"ipcontroller-{cluster_id}-engine.json" if cluster_id else "ipcontroller-engine.json"
    path = os.path.join(profile, "security", name)
    if not workdir or not profile:
        return
    deadline = time.monotonic() + 30  # the controller may still be writing it (ipengine waits too)
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return  # ipengine reports the missing file itself
        time.sleep(0.05)
    with open(path) as fh:
        info = json.load(fh)
    addr = info["interface"].split("//")[-1]
    port = int(info["registration"])
    reason = net.connect_error(addr, port, timeout=10)
    if not reason:
        return
    host = socket.gethostname()
    rank = next((os.environ[v] for v in os.environ.get("NBDIST_RANK_VARS", "").split(",") if v in os.environ), "?")
    line = f"the engine on {host} cannot reach the controller at {addr}:{port} ({reason}): {net.likely_fix(reason)}."
    path = os.path.join(workdir, f"preflight-{host}-{rank}.txt")
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as fh:
        fh.write(line)
    print("nbdist: " + line, file=sys.stderr)
    sys.exit(2)


def main() -> None:
    from nbdist.engine.parentwatch import watch_parent

    if "--mpi" in sys.argv:  # ipyparallel's MPI launcher asks for mpi4py; nbdist reads the rank from the env
        sys.argv.remove("--mpi")
    watch_parent()
    preflight()
    preload()
    run_engine()


if __name__ == "__main__":
    main()
