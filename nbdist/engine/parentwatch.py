"""End this process soon after the process that started it (the notebook kernel) is gone.

ipyparallel starts its controller and engines in their own sessions so Ctrl-C in a
terminal does not reach them; the price is that they outlive a killed kernel. The
launcher passes the kernel's pid in NBDIST_PARENT_PID; when our parent pid is no
longer that pid (we were re-parented because it died), we exit at once.
"""

from __future__ import annotations

import os
import threading
import time

ENV = "NBDIST_PARENT_PID"


def watch_parent(interval: float = 0.5) -> threading.Thread | None:
    """Start a daemon thread that exits this process when its parent dies.

    Does nothing when NBDIST_PARENT_PID is unset or is not our parent (for example
    when a batch system started us on another host).
    """
    try:
        parent = int(os.environ.get(ENV, "0"))
    except ValueError:
        return None
    if parent <= 1 or os.getppid() != parent:
        return None

    def _watch() -> None:
        while True:
            time.sleep(interval)
            if os.getppid() != parent:
                os._exit(70)

    thread = threading.Thread(target=_watch, name="nbdist-parent-watch", daemon=True)
    thread.start()
    return thread
