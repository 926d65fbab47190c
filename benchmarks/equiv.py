"""%dist_equiv's planted bugs (#53): each cause named, each fix agreeing with one rank, each in <= 60 s.

One world of ``--ranks`` ranks (4 by default, gloo, oversubscribed on a small machine). For every case of
tests/equiv_cases.py: the buggy cell (the verdict must name its cause) and its fix or the correct cell (the
verdict must be 'equivalent', with the largest relative loss difference over 20 steps <= 1e-5, fp64). Printed as
a table (case, expected, verdict, seconds, loss difference); saved under results/equiv.json.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

from _common import save

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import nbdist  # noqa: E402
from tests.equiv_cases import CASES, CORRECT  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    runs = [("correct", "equivalent", CORRECT)]
    for name, (cause, buggy, fixed) in CASES.items():
        runs.append((name, cause, buggy))
        if fixed is not None:
            runs.append((f"{name} (fixed)", "equivalent", fixed))
    rows = []
    with nbdist.start(n=args.ranks, oversubscribe=True) as cluster:
        for name, expected, code in runs:
            tic = time.perf_counter()
            verdict = nbdist.equiv(code, cluster, steps=args.steps)
            seconds = time.perf_counter() - tic
            row = {
                "case": name,
                "expected": expected,
                "verdict": verdict.cause,
                "right": verdict.cause == expected,
                "step": verdict.step,
                "seconds": seconds,
                "loss_rel": verdict.figures.get("loss"),
                "text": verdict.text,
            }
            rows.append(row)
            loss = f"{row['loss_rel']:.1e}" if row["loss_rel"] is not None else "-"
            print(
                f"{name:32} {expected:16} {verdict.cause:16} {'ok ' if row['right'] else 'BAD'} "
                f"{seconds:6.1f} s  loss {loss}",
                flush=True,
            )
            print(f"    {verdict.text}", flush=True)
    right = sum(r["right"] for r in rows)
    print(f"{right}/{len(rows)} right; slowest {max(r['seconds'] for r in rows):.1f} s")
    save("equiv", {"ranks": args.ranks, "steps": args.steps, "rows": rows, "right": right, "runs": len(rows)})


if __name__ == "__main__":
    main()
