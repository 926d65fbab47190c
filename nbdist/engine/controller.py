"""Start the ipyparallel controller with the kernel watched (see parentwatch).

When the kernel dies, the controller also cancels the batch jobs the kernel submitted
(their ids are in NBDIST_JOBS_FILE), so engines on other nodes do not wait for a
heartbeat timeout to notice, and removes the cluster's directory (NBDIST_CLUSTER_DIR),
which the kernel can no longer clean up.
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
    from nbdist.launch import slurm

    slurm.cancel(jobs)


def clean_up() -> None:
    """The kernel is gone: cancel its jobs, remove its cluster's directory."""
    import shutil

    cancel_jobs()
    cluster_dir = os.environ.get("NBDIST_CLUSTER_DIR", "")
    if cluster_dir and os.path.basename(cluster_dir).startswith("nbdist-"):
        shutil.rmtree(cluster_dir, ignore_errors=True)


def main() -> None:
    from nbdist.engine.parentwatch import watch_parent

    watch_parent(on_exit=clean_up)
    from ipyparallel.controller.app import main as controller_main

    from nbdist import compat

    compat.skip_controller_settle_sleep()
    compat.fast_iso_dates()
    compat.lean_hub_monitor()
    # What the hub does for every request and reply that nbdist never reads (a profile's config or a command line's
    # options still win):
    # - no record of each: ipyparallel's in-memory DictDB, which nbdist never queries, kept up to 1,024 requests and
    #   1 GiB of their output, culled one request at a time once full (a 64-rank world fills it in 16 cells);
    # - no log line of each: two a rank a cell at INFO, and a DEBUG record made for every message, which traitlets'
    #   logger (always at DEBUG; its handler filters) builds before it drops. Warnings and errors are still logged.
    # At 64 ranks they were a quarter of the controller's CPU for a trivial cell (benchmarks/controller_cost.py).
    # And (lean_hub_monitor above) no reading of a copy of each direct request, reply and iopub message.
    controller_main(db_class="NoDB", logging_config={"loggers": {"IPController": {"level": "WARNING"}}})


if __name__ == "__main__":
    main()
