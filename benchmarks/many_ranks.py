"""Many ranks: what one cell costs and shows at 2, 8 and 16 ranks (oversubscribed on this machine).

For each world size, in the same run:
- nbdist's trivial cell (``cluster.run``, default output) against ipyparallel's ``view.execute`` on the
  same engines, alternated; nbdist's own cost per cell is the difference;
- the lines that reach the notebook when every rank prints the same line, and a loss that differs by
  rank: folded (the default) and unfolded (``each=True``, what every rank printed);
- a ``tqdm`` loop of 2,000 steps on every rank: the lines it leaves in the notebook and their bytes,
  and whether the last shows 100%.

Run it on an older checkout too (it falls back where ``each`` does not exist) to compare.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import time

from _common import save

import nbdist

PRINT = "print('epoch 1 done')"
LOSS = "print(f'epoch 1 loss {0.5 + dist.get_rank() / 100:.3f}')"
TQDM = "from tqdm import tqdm\nfor _ in tqdm(range(2000), desc='train', mininterval=0.05):\n    pass\nprint('after')"


def shown(cluster: nbdist.Cluster, code: str, each: bool = False) -> str:
    """What the notebook shows of a cell: its stdout and stderr, in the order written."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            cluster.run(code, each=each).raise_for_error()
        except TypeError:  # a checkout before folding: every rank's lines as they are
            cluster.run(code).raise_for_error()
    return out.getvalue()


def cell_cost(cluster: nbdist.Cluster, reps: int) -> dict[str, float]:
    view = cluster.view(list(range(cluster.world_size)))
    ours, raw = [], []
    for _ in range(reps):
        tic = time.perf_counter()
        shown(cluster, "x = 1")
        ours.append(time.perf_counter() - tic)
        tic = time.perf_counter()
        view.execute("x = 1", block=True)
        raw.append(time.perf_counter() - tic)
    nb, ipp = statistics.median(ours) * 1e3, statistics.median(raw) * 1e3
    return {"nbdist_cell_ms": nb, "view_execute_ms": ipp, "ratio": nb / ipp, "own_cost_ms": nb - ipp}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", default="2,8,16")
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args()
    out = {}
    for n in map(int, args.ranks.split(",")):
        with nbdist.start(n, oversubscribe=True, timeout=180) as cluster:
            shown(cluster, "x = 1")  # warm
            row: dict[str, object] = cell_cost(cluster, args.reps)
            for name, code in (("same_line", PRINT), ("loss_line", LOSS)):
                row[f"{name}_lines_folded"] = len(shown(cluster, code).splitlines())
                row[f"{name}_lines_each"] = len(shown(cluster, code, each=True).splitlines())
            text = shown(cluster, TQDM)
            lines = [ln for ln in text.splitlines() if "train" in ln]
            row["tqdm_lines"] = len(lines)
            row["tqdm_bytes"] = len(text.encode())
            row["tqdm_last_shows_100"] = bool(lines) and all("100%" in ln.split("\r")[-1] for ln in lines)
            each = shown(cluster, TQDM, each=True)  # every rank's own lines: is its bar before its 'after'?
            row["tqdm_bar_before_after_on_every_rank"] = all(
                f"[rank {r}] after" in each and each.rfind(f"[rank {r}] train") < each.index(f"[rank {r}] after")
                for r in range(n)
            )
        out[str(n)] = row
        print(
            f"{n:>2} ranks: cell {row['nbdist_cell_ms']:.1f} ms vs view.execute {row['view_execute_ms']:.1f} ms "
            f"({row['ratio']:.2f}x, own {row['own_cost_ms']:.1f} ms); one print -> {row['same_line_lines_folded']} "
            f"line(s) ({row['same_line_lines_each']} unfolded); loss -> {row['loss_line_lines_folded']} "
            f"({row['loss_line_lines_each']}); tqdm -> {row['tqdm_lines']} line(s), {row['tqdm_bytes']} bytes, "
            f"all at 100%: {row['tqdm_last_shows_100']}, each rank's bar before its 'after': "
            f"{row['tqdm_bar_before_after_on_every_rank']}",
            flush=True,
        )
    print(f"saved {save('many_ranks', out)}")


if __name__ == "__main__":
    main()
