"""A run you can leave keeps its memory flat (#50): the short version of benchmarks/soak.py, in a real Jupyter
kernel as a notebook has it (nbdist's cell output, its dashboard widget and transcript).

Two ranks each log 100,000 steps in one ``%%distributed`` cell, as fast as a loop can. The kernel's resident
memory may grow by a bound over the cell (the rows that arrive faster than it takes them in, and what its
allocator keeps of them, were the growth that never came back). What the kernel still holds afterwards, by
tracemalloc (Python's own count of the bytes allocated and not freed, so no allocator noise), must stay under a
bound that every row kept would pass many times over (each row is a dict of about 400 bytes: 200,000 rows are
about 80 MiB); the cell's result keeps at most KEPT_ROWS rows a rank with the last EXACT_ROWS exact, and the
world's directory stays small. Time bounds only catch hangs.
"""

from __future__ import annotations

from nbdist.cells.rows import EXACT_ROWS, KEPT_ROWS
from tests.helpers import NotebookKernel

STEPS = 100_000
HELD_MIB = 16  # what the kernel may still hold after the cell: the dashboard, the kept rows, ipyparallel's records
GROWN_MIB = 48  # its resident memory over the cell (unbounded batches: 142 MiB for these steps, never given back)


def test_a_long_logging_cell_leaves_the_kernel_as_it_found_it():
    import psutil

    kernel = NotebookKernel()
    run = kernel.run
    try:
        run("%load_ext nbdist\n%dist_start -n 2 --timeout 120")
        run("%%distributed\nimport nbdist\nnbdist.log(step=0, loss=1.0)")  # the dashboard and its imports exist
        run(
            "import gc, json, tracemalloc\ngc.collect()\ntracemalloc.start()\n_before = tracemalloc.get_traced_memory()[0]"
        )
        rss = psutil.Process(kernel.pid).memory_info().rss
        run(f"%%distributed\nimport nbdist\nfor s in range({STEPS}):\n    nbdist.log(step=s, loss=1.0 / (s + 1))\n")
        grown = psutil.Process(kernel.pid).memory_info().rss - rss
        held = run(
            "gc.collect()\nimport os, nbdist.cluster as _c\n_w = _c.current()\n_last = _w.last",
            "json.dumps({'held': tracemalloc.get_traced_memory()[0] - _before, "
            "'rows': {r: len(v) for r, v in _last.metrics.items()}, "
            "'last_steps': {r: [row['step'] for row in v[-3:]] for r, v in _last.metrics.items()}, "
            "'dir': sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(_w.membership.workdir) for f in fs), "
            "'transcripts': len(__import__('nbdist.cells.transcript', fromlist=['cells']).cells(_w.membership.workdir))})",
        )
        assert isinstance(held, dict)
        print(f"kernel grew {grown / 2**20:.1f} MiB over the cell; holds {held['held'] / 2**20:.1f} MiB after it")
        assert grown < GROWN_MIB * 2**20, f"the kernel grew by {grown / 2**20:.1f} MiB over the cell"
        assert held["held"] < HELD_MIB * 2**20, f"the kernel still holds {held['held'] / 2**20:.1f} MiB after the cell"
        assert all(EXACT_ROWS <= n <= KEPT_ROWS for n in held["rows"].values()), held["rows"]
        assert all(steps == [STEPS - 3, STEPS - 2, STEPS - 1] for steps in held["last_steps"].values()), held
        assert held["transcripts"] >= 2, held  # the cells were kept for a page opened later, as in a notebook
        assert held["dir"] < 16 * 2**20, f"the world's directory holds {held['dir'] / 2**20:.1f} MiB"
        run("%dist_stop")
    finally:
        kernel.close()
