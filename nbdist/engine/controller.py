"""Start the ipyparallel controller with the kernel watched (see parentwatch).

When the kernel dies, the controller also cancels the batch jobs the kernel submitted
(their ids are in NBDIST_JOBS_FILE), so engines on other nodes do not wait for a
heartbeat timeout to notice.
"""

from __future__ import annotations

import os


def cancel_jobs() -> None:
    """scancel the job ids listed in NBDIST_JOBS_FILE (only jobs this cluster submitted)."""
    path = os.environ.get("NBDIST_JOBS_FILE", "")
    try:
        with open(path) as fh:
            jobs = [line.strip() for line in fh if line.strip()]
    except OSError:
        return
    from nbdist import slurm

    slurm.cancel(jobs)


def main() -> None:
    from nbdist.engine.parentwatch import watch_parent

    watch_parent(on_exit=cancel_jobs)
    from ipyparallel.controller.app import main as controller_main

    controller_main()


if __name__ == "__main__":
    main()
