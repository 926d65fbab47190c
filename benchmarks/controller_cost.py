"""What the hub's record of every request, its log line of every message and its reading of every message its queues
pass cost the controller, against nbdist's controller as shipped (``nbdist.engine.controller.main``: no record,
warnings and errors only, only the monitor topics it acts on: ``compat.lean_hub_monitor``).

Worlds alternate, one size at a time: as shipped; with the hub hearing every message again (``Hub.__init__`` as
ipyparallel's, put back by the controller config); and with all of ipyparallel's own hub settings put back (that,
its in-memory DictDB, and traitlets' logger at DEBUG with the handler at INFO). Each is written into the world's
controller config as a profile would (it wins over the controller's defaults; the config is Python the controller
runs after nbdist's own patches and before it makes its hub). Each world: a trivial cell timed as benchmarks/many_ranks.py
times one (nbdist's cell against ``view.execute``; the notebook's and the controller's CPU), then the controller's
resident memory before and after ``--cells`` cells in which each rank prints ``--kib`` KiB.

    python benchmarks/controller_cost.py [--ranks 16,64] [--rounds 4] [--reps 11] [--cells 100] [--kib 64]
"""

from __future__ import annotations

import contextlib
import io
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

from _common import alternated, medians, save, sizes_parser  # noqa: E402
from many_ranks import cell_cost, controller_of  # noqa: E402

import nbdist  # noqa: E402
from nbdist.launch import launchers  # noqa: E402

SECURE = launchers.secure_controller
EVERY_MESSAGE = (  # ipyparallel's Hub.__init__: its monitor socket subscribed to every topic, every iopub message read
    "from ipyparallel.controller import hub as _hub\n"
    "_hub.Hub.__init__ = getattr(_hub.Hub.__init__, '__wrapped__', _hub.Hub.__init__)\n"
)
IPYPARALLELS = EVERY_MESSAGE + (
    "c.IPController.db_class = 'DictDB'\n"
    "c.IPController.logging_config = {'loggers': {'IPController': {'level': 'DEBUG'}}}\n"
)
HUBS = {"nbdist's (as shipped)": "", "nbdist's, every message heard": EVERY_MESSAGE, "ipyparallel's": IPYPARALLELS}


def hub_config(extra: str):
    def secure(profile_dir: str) -> None:
        SECURE(profile_dir)
        with open(os.path.join(profile_dir, "ipcontroller_config.py"), "a") as fh:
            fh.write(extra)

    return secure


def one_world(n: int, hub: str, reps: int, cells: int, kib: int) -> dict[str, float]:
    launchers.secure_controller = hub_config(HUBS[hub])  # type: ignore[assignment]
    try:
        cluster = nbdist.start(n=n, oversubscribe=n > (os.cpu_count() or 1), timeout=300)
    finally:
        launchers.secure_controller = SECURE
    try:
        row = cell_cost(cluster, reps)
        controller = controller_of(cluster)
        before = controller.memory_info().rss
        with contextlib.redirect_stdout(io.StringIO()):  # the notebook's share is not what is measured here
            for _ in range(cells):
                cluster.run(f"print('x' * {kib * 1024})", quiet=True).raise_for_error()
        row["controller_rss_growth_mib"] = (controller.memory_info().rss - before) / 2**20
        row["controller_rss_mib"] = controller.memory_info().rss / 2**20
    finally:
        cluster.stop()
    return row


def main() -> None:
    parser = sizes_parser("16,64", rounds=4)
    parser.add_argument("--cells", type=int, default=100)
    parser.add_argument("--kib", type=int, default=64)
    args = parser.parse_args()
    hubs = list(HUBS)
    result: dict[str, object] = {"cells": args.cells, "kib": args.kib}
    for n in [int(x) for x in args.ranks.split(",") if x]:
        rows = medians(alternated(hubs, args.rounds, lambda hub, n=n: one_world(n, hub, args.reps, args.cells, args.kib)))
        result[str(n)] = rows
        for hub, m in rows.items():
            print(
                f"{n:3} ranks, hub {hub:29} nbdist cell {m['nbdist_cell_ms']:7.2f} ms  view.execute "
                f"{m['view_execute_ms']:7.2f} ms  ratio {m['ratio']:.3f}  controller CPU {m['controller_cpu_ms']:6.2f} ms"
                f"  notebook CPU {m['notebook_cpu_ms']:6.2f} ms  controller memory +{m['controller_rss_growth_mib']:.1f}"
                f" MiB over {args.cells} cells of {args.kib} KiB a rank (then {m['controller_rss_mib']:.0f} MiB)",
                flush=True,
            )
    save("controller_cost", result)


if __name__ == "__main__":
    main()
