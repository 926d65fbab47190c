"""%dist_why on GPU ranks (#53): the verdicts for a slow device, from CUDA events, beside the host's clocks alone.

Two ranks (one GPU: they share it over gloo; a rank may train on the CPU instead). Cases: balanced; rank 1's GPU
spinning 20 ms in each forward (``torch.cuda._sleep``: the host returns at once); slow input on rank 1; rank 0's GPU
spinning beside a rank on the CPU. Each ``--seeds`` times under %dist_why as it is
(the GPU phases from CUDA events), and again with the ranks' timer told the model is not on a GPU (host clocks only,
as a profiler of host time sees it), in the same run. The cost of timing: the balanced GPU cell's median step (its
own clock) plain and under %dist_why, alternating, ``--overhead`` pairs. Saved under results/why_gpu.json.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
from collections import Counter

from _common import save
from why import step_s  # the cell's own median step, as the CPU suite reads it

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import nbdist  # noqa: E402
from tests.why_cases import cell  # noqa: E402

CASES = [  # (name, fault, devices, the verdict, the ranks it names)
    ("balanced", "none", ("cuda:0", "cuda:0"), "balanced", None),
    ("slow-gpu", "device", ("cuda:0", "cuda:0"), "compute", [1]),
    ("data", "data", ("cuda:0", "cuda:0"), "data", [1]),
    ("slow-gpu-vs-cpu", "device", ("cuda:0", "cpu"), "compute", [0]),
]
HOST_ONLY = "import nbdist.engine.why as _w\n_w._cuda_of, _w._kept = (lambda module: False), _w._cuda_of"
RESTORE = "import nbdist.engine.why as _w\n_w._cuda_of = _w._kept"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--overhead", type=int, default=5)
    args = parser.parse_args()
    rows, table = [], Counter()
    plain, timed = [], []
    with nbdist.start(n=2) as cluster:
        for clocks in ("cuda events", "host only"):
            if clocks == "host only":
                cluster.run(HOST_ONLY).raise_for_error()
            for name, fault, devices, want, ranks in CASES:
                for seed in range(args.seeds):
                    culprit = ranks[0] if ranks else -1
                    verdict = nbdist.why(cell(fault, culprit, seed, steps=30, devices=devices), cluster)
                    right = verdict.cause == want and verdict.figures.get("ranks") == ranks
                    rows.append(
                        {
                            "clocks": clocks,
                            "case": name,
                            "seed": seed,
                            "verdict": verdict.cause,
                            "named": verdict.figures.get("ranks"),
                            "right": right,
                            "text": verdict.text,
                        }
                    )
                    table[(clocks, name, verdict.cause)] += 1
                    print(
                        f"{clocks:11} {name:16} seed {seed}: {verdict.cause:9} {verdict.figures.get('ranks')} "
                        f"{'ok' if right else 'WRONG'}",
                        flush=True,
                    )
                    if not right or seed == 0:
                        print("    " + verdict.text, flush=True)
        cluster.run(RESTORE).raise_for_error()
        gpu = cell("none", -1, 0, steps=300, devices=("cuda:0", "cuda:0"))
        for _ in range(args.overhead):
            cluster.run(gpu).raise_for_error()
            plain.append(step_s(cluster))
            nbdist.why(gpu, cluster)
            timed.append(step_s(cluster))
    summary = {
        clocks: sum(r["right"] for r in rows if r["clocks"] == clocks) / sum(r["clocks"] == clocks for r in rows)
        for clocks in ("cuda events", "host only")
    }
    cost = statistics.median(t / p for t, p in zip(timed, plain, strict=True)) - 1
    summary.update(step_plain_s=statistics.median(plain), step_timed_s=statistics.median(timed), overhead=cost)
    for clocks in ("cuda events", "host only"):
        print(
            f"\n{clocks}: "
            + "; ".join(
                f"{name} -> " + ", ".join(f"{c} x{n}" for (k, m, c), n in table.items() if k == clocks and m == name)
                for name, *_ in CASES
            )
        )
    print(
        f"\nright with CUDA events {summary['cuda events']:.0%}, with host clocks only {summary['host only']:.0%}; "
        f"a GPU step {summary['step_plain_s'] * 1e3:.2f} ms plain, {summary['step_timed_s'] * 1e3:.2f} ms timed "
        f"({cost:+.1%})"
    )
    save(
        "why_gpu",
        {
            "seeds": args.seeds,
            "rows": rows,
            "summary": summary,
            "confusion": {f"{k} {m}->{c}": n for (k, m, c), n in table.items()},
        },
    )


if __name__ == "__main__":
    main()
