"""A run you can leave keeps its memory flat (#50): the short version of benchmarks/soak.py, in a real Jupyter
kernel as a notebook has it (nbdist's cell output, its dashboard widget and transcript).

Two ranks each log 100,000 steps in one ``%%distributed`` cell. What the kernel still holds afterwards, by
tracemalloc (Python's own count of the bytes allocated and not freed, so no allocator noise), must stay under a
bound that every row kept would pass many times over (each row is a dict of about 400 bytes: 200,000 rows are
about 80 MiB); the cell's result keeps at most KEPT_ROWS rows a rank with the last EXACT_ROWS exact, and the
world's directory stays small. Time bounds only catch hangs.
"""

from __future__ import annotations

import json
import os

from nbdist.results import EXACT_ROWS, KEPT_ROWS

STEPS = 100_000
HELD_MIB = 16  # what the kernel may still hold after the cell: the dashboard, the kept rows, ipyparallel's records


def test_a_long_logging_cell_leaves_the_kernel_as_it_found_it(tmp_path):
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", env={**os.environ, "OMP_NUM_THREADS": "1"})

    def run(code: str, expr: str = "") -> object:
        reply = kc.execute_interactive(
            code, timeout=600, output_hook=lambda msg: None, user_expressions={"r": expr} if expr else None
        )
        assert reply["content"]["status"] == "ok", reply["content"]
        if not expr:
            return None
        value = reply["content"]["user_expressions"]["r"]
        assert value["status"] == "ok", value
        return json.loads(eval(value["data"]["text/plain"]))

    try:
        run("%load_ext nbdist\n%dist_start -n 2 --timeout 120")
        run("%%distributed\nimport nbdist\nnbdist.log(step=0, loss=1.0)")  # the dashboard and its imports exist
        run("import gc, json, tracemalloc\ngc.collect()\ntracemalloc.start()\n_before = tracemalloc.get_traced_memory()[0]")
        run(f"%%distributed\nimport nbdist\nfor s in range({STEPS}):\n    nbdist.log(step=s, loss=1.0 / (s + 1))\n")
        held = run(
            "gc.collect()\nimport os, nbdist.cluster as _c\n_w = _c.current()\n_last = _w.last",
            "json.dumps({'held': tracemalloc.get_traced_memory()[0] - _before, "
            "'rows': {r: len(v) for r, v in _last.metrics.items()}, "
            "'last_steps': {r: [row['step'] for row in v[-3:]] for r, v in _last.metrics.items()}, "
            "'dir': sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(_w.membership.workdir) for f in fs)})",
        )
        assert isinstance(held, dict)
        assert held["held"] < HELD_MIB * 2**20, f"the kernel still holds {held['held'] / 2**20:.1f} MiB after the cell"
        assert all(EXACT_ROWS <= n <= KEPT_ROWS for n in held["rows"].values()), held["rows"]
        assert all(steps == [STEPS - 3, STEPS - 2, STEPS - 1] for steps in held["last_steps"].values()), held
        assert held["dir"] < 16 * 2**20, f"the world's directory holds {held['dir'] / 2**20:.1f} MiB"
        run("%dist_stop")
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)
