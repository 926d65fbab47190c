"""A trivial cell's cost with the engines' lean iopub (as shipped: no busy status, no echo of the code, and a cell's
output ended by a count in its reply instead of an idle status, see ``compat.lean_iopub``) against the same lean
engines ending each cell's output with its idle status (as before the count: the notebook asks for no count,
``compat.execute_heard(counted=False)``) and against the engines publishing all three, as ipykernel does by default;
alternated round by round on one world per size, each round timed as benchmarks/many_ranks.py times a cell (nbdist's
cell against ipyparallel's ``view.execute`` on the same engines, and the notebook's and the controller's CPU for one).

    python benchmarks/cell_messages.py [--ranks 2,16,64] [--rounds 6] [--reps 11]
"""

from __future__ import annotations

import functools
import os
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

from _common import medians, save, sizes_parser  # noqa: E402
from many_ranks import cells_alternated, world  # noqa: E402
from stub_ranks import LEAN  # noqa: E402  (each rank lean again, as configured)

from nbdist import compat  # noqa: E402

# Each rank's kernel back to ipykernel's own methods (the class's) and its session's own send.
FULL = """
_k = get_ipython().kernel
for _name in ("_publish_status", "_publish_execute_input", "_nbdist_lean_iopub"):
    _k.__dict__.pop(_name, None)
_k.session.__dict__.pop("send", None)
"""
# way -> (what each rank runs, whether the notebook asks for the count)
WAYS = {
    "lean, counted (as shipped)": (FULL + LEAN, True),
    "lean, idle status (before)": (FULL + LEAN, False),
    "full (ipykernel's default)": (FULL, False),
}
COUNTED = compat.execute_heard


def put_in_place(cluster: Any, code: str, counted: bool) -> None:
    cluster.run(code, quiet=True).raise_for_error()
    compat.execute_heard = COUNTED if counted else functools.partial(COUNTED, counted=False)


def one_size(n: int, rounds: int, reps: int) -> dict[str, dict[str, float]]:
    with world(n) as cluster:
        ways = {way: functools.partial(put_in_place, cluster, code, counted) for way, (code, counted) in WAYS.items()}
        rows = cells_alternated(cluster, ways, rounds, reps)
    out: dict[str, dict[str, Any]] = dict(medians(rows))
    for way, samples in rows.items():
        out[way]["ratio_range"] = [min(s["ratio"] for s in samples), max(s["ratio"] for s in samples)]
    return out


def main() -> None:
    parser = sizes_parser("2,16,64", rounds=6)
    args = parser.parse_args()
    result = {}
    for n in [int(x) for x in args.ranks.split(",")]:
        result[str(n)] = one_size(n, args.rounds, args.reps)
        for way, m in result[str(n)].items():
            low, high = m["ratio_range"]
            print(
                f"{n:3} ranks, {way:28} nbdist cell {m['nbdist_cell_ms']:7.2f} ms  view.execute "
                f"{m['view_execute_ms']:7.2f} ms  ratio {m['ratio']:.3f} ({low:.2f}-{high:.2f})  notebook CPU "
                f"{m['notebook_cpu_ms']:.2f} ms  controller CPU {m['controller_cpu_ms']:.2f} ms",
                flush=True,
            )
    save("cell_messages", {"medians_of_rounds": result})


if __name__ == "__main__":
    main()
