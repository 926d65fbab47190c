"""Start one ipyparallel engine with torch already imported and the kernel watched.

Importing torch here, while the controller is still starting, overlaps the two
slowest parts of a cold start instead of running them one after the other.
"""

from __future__ import annotations

import os
import sys
from typing import Any


def _first_to_claim(variable: str) -> bool:
    """Fault drills: True in the first engine to create the file the environment variable names."""
    path = os.environ.get(variable)
    if not path:
        return False
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def _fault_exit_one() -> None:
    # Fault drill (docs/faults.md, row 7): the first engine exits at once, so a test can start a world in
    # which one rank never joins.
    if _first_to_claim("NBDIST_FAULT_EXIT_ONE"):
        print("nbdist fault drill: this engine exits before registering (NBDIST_FAULT_EXIT_ONE)", file=sys.stderr)
        sys.exit(3)


def _fault_hold_one() -> None:
    # Fault drill (docs/faults.md, row 49): the first engine waits here, before it registers, until it is
    # ended, so a test can see a start that stalls say where each engine is (engine/steps.py).
    if _first_to_claim("NBDIST_FAULT_HOLD_ONE"):
        import time

        while True:
            time.sleep(1)


def _fault_slow_heart() -> None:
    # Fault drill (docs/faults.md, row 119): the first engine waits NBDIST_FAULT_SLOW_HEART_S seconds between the
    # controller's answer to its registration and its heart's first beat, as one of 64 engines whose kernels all
    # start at once on 2 cores may.
    if _first_to_claim("NBDIST_FAULT_SLOW_HEART"):
        import time

        from nbdist import compat

        late = float(os.environ.get("NBDIST_FAULT_SLOW_HEART_S", "35"))
        compat.on_engine_registration(
            registering=lambda: None, registered=lambda: time.sleep(late), beating=lambda eid: None
        )


def preload() -> None:
    """Import what every engine needs and is slow to import (torch: about 2 s)."""
    import ipyparallel.engine.app  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401


def run_engine() -> None:
    """Run ipyparallel's engine with this process's arguments (after the fault drill); never returns.

    When the engine stops (SIGTERM from ``%dist_stop``), the process ends at once: an
    interpreter's own shutdown would garbage-collect torch's whole heap first, which takes
    seconds and does nothing an engine needs (its results were sent; its files belong to the
    cluster's directory, which the kernel removes)."""
    from ipyparallel.engine.app import main as engine_main

    from nbdist.engine import steps

    _fault_exit_one()
    steps.say(steps.IMPORTED)
    if await_connection_file(30):
        steps.say(steps.CONNECTION)
    _fault_hold_one()
    steps.follow_registration()
    _fault_slow_heart()
    code: Any = 0
    try:
        engine_main()
    except SystemExit as exc:
        code = exc.code
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
    os._exit(code if isinstance(code, int) else (0 if code is None else 1))


def connection_file() -> str:
    """The controller's connection file for engines ('' when the environment does not say)."""
    profile, cluster_id = os.environ.get("IPP_PROFILE_DIR", ""), os.environ.get("IPP_CLUSTER_ID", "")
    if not profile:
        return ""
    name = f"ipcontroller-{cluster_id}-engine.json" if cluster_id else "ipcontroller-engine.json"
    return os.path.join(profile, "security", name)


def await_connection_file(timeout: float) -> bool:
    """Wait until the controller has written the connection file; True once it is whole.

    An engine started beside its controller is ready before the file is; ipengine itself
    looks for it every 0.1 s, this every 5 ms. The controller creates the file, then writes
    it: it counts once it parses."""
    import json
    import time

    if os.environ.get("IPP_CONNECTION_INFO"):  # handed over in the environment: no file to wait for
        return True
    path = connection_file()
    deadline = time.monotonic() + timeout
    while path:
        try:
            with open(path) as fh:
                json.load(fh)
            return True
        except (OSError, ValueError):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
    return False


def preflight() -> None:
    """On another host: can this engine reach the controller? If not, leave one line for the notebook
    (NBDIST_CLUSTER_DIR/preflight-HOST-RANK.txt, a shared directory) and exit, instead of timing out silently."""
    import json
    import socket

    from nbdist import wire
    from nbdist.launch import net

    workdir, path = os.environ.get("NBDIST_CLUSTER_DIR", ""), connection_file()
    if not workdir or not path or not await_connection_file(30):  # (ipengine reports a missing file itself)
        return
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
    wire.write_private(os.path.join(workdir, f"preflight-{host}-{rank}.txt"), line)  # read as soon as it exists
    print("nbdist: " + line, file=sys.stderr)
    sys.exit(2)


def main() -> None:
    from nbdist.engine.parentwatch import watch_parent

    if "--mpi" in sys.argv:  # ipyparallel's MPI launcher asks for mpi4py; nbdist reads the rank from the env
        sys.argv.remove("--mpi")
    from nbdist.engine import steps

    watch_parent()
    steps.say(steps.STARTED)
    preflight()
    preload()
    run_engine()


if __name__ == "__main__":
    main()
