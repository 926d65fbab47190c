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


def main() -> None:
    from nbdist.engine.parentwatch import watch_parent

    watch_parent()
    preload()
    run_engine()


if __name__ == "__main__":
    main()
