"""What the world panel costs: one look of the server's route (``server.worlds.world``: the ranks'
file, each rank's memory, the busy ranks' cell lines from their reports, and the ask for the next
ones by SIGUSR1 at most once a second) at 2, 16 and 64 ranks while a cell runs; and what being asked
costs the ranks, as a cell's loop slows down with a panel open (one look every 0.25 s) beside none.
"""

from __future__ import annotations

import time

from _common import save, stats

CELL = """
import time
t0 = time.perf_counter()
for _ in range({rounds}):
    sum(i * i for i in range(2000))
loop_s = time.perf_counter() - t0
"""


def main() -> None:
    import nbdist
    from nbdist.cells import pointers
    from nbdist.server import worlds

    found = {}
    for n in (2, 16, 64):
        with nbdist.start(n=n, oversubscribe=True, timeout=240) as cluster:
            kernel = f"bench-{n}"
            pointers.point(cluster.engines.workdir, kernel)
            try:
                cell = CELL.format(rounds=100_000 // n)  # about 3 s of the 2 cores, whatever n
                cluster.run(cell, quiet=True).raise_for_error()
                before = max(cluster.pull("loop_s"))
                pending = cluster.run(cell, block=False, quiet=True)
                looks = []
                lines_seen = 0
                while not looks or not pending.done():
                    tic = time.perf_counter()
                    world = worlds.world(kernel, "bench.ipynb")
                    looks.append(time.perf_counter() - tic)
                    lines_seen = max(lines_seen, sum(1 for r in world["ranks"] if r.get("line")))
                    time.sleep(0.25)
                pending.wait().raise_for_error()
                watched = max(cluster.pull("loop_s"))
                cluster.run(cell, quiet=True).raise_for_error()
                alone = (before + max(cluster.pull("loop_s"))) / 2  # before and after: the machine drifts
            finally:
                import os

                os.unlink(pointers.pointer_path(kernel))
        found[n] = {
            "look_s": stats(looks),
            "loop_alone_s": alone,
            "loop_watched_s": watched,
            "ranks_with_a_line": lines_seen,
        }
        print(
            f"{n:>2} ranks: a look {stats(looks)['median'] * 1e3:.1f} ms (max {max(looks) * 1e3:.1f}); "
            f"{lines_seen}/{n} busy ranks had their cell line; the cell's loop {alone:.2f} s alone, "
            f"{watched:.2f} s with the panel looking ({watched / alone - 1:+.1%})",
            flush=True,
        )
    save("panel", found)


if __name__ == "__main__":
    main()
