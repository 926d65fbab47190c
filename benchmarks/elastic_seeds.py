"""The elastic test's seeded scenarios over many seeds (#57): a seeded test must pass for every seed.

``tests/integration/test_elastic.py::test_a_lost_node_shrinks_the_world_and_training_goes_on_as_by_hand`` picks, from
``NBDIST_TEST_SEED``, which rank and node are lost and after which step. This runs it once per seed for each
variant (``--variants``: peer, checkpoint, fsdp), each in its own pytest process, and counts the seeds that fail;
the failing seeds are listed with their last lines. Too long for CI at 50 seeds (about 25 s a run on 2 cores).
JSON under results/elastic_seeds.json; exits non-zero when any seed failed.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import time

from _common import save

ROOT = pathlib.Path(__file__).resolve().parents[1]
TEST = "tests/integration/test_elastic.py::test_a_lost_node_shrinks_the_world_and_training_goes_on_as_by_hand"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=50)
    ap.add_argument("--first", type=int, default=1)
    ap.add_argument("--variants", default="peer,fsdp")
    args = ap.parse_args()
    runs = []
    for seed in range(args.first, args.first + args.seeds):
        for variant in args.variants.split(","):
            tic = time.perf_counter()
            done = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{TEST}[{variant}]"],
                cwd=ROOT,
                env={**os.environ, "NBDIST_TEST_SEED": str(seed), "OMP_NUM_THREADS": "1"},
                capture_output=True,
                text=True,
                timeout=600,
            )
            ok = done.returncode == 0
            runs.append(
                {
                    "seed": seed,
                    "variant": variant,
                    "ok": ok,
                    "seconds": round(time.perf_counter() - tic, 1),
                    "tail": [] if ok else done.stdout.splitlines()[-15:],
                }
            )
            print(f"seed {seed:3d} {variant:10s} {'ok' if ok else 'FAILED'} ({runs[-1]['seconds']} s)", flush=True)
    failed = [r for r in runs if not r["ok"]]
    summary = {"runs": len(runs), "failed": len(failed), "failed_seeds": [(r["seed"], r["variant"]) for r in failed]}
    print(summary)
    save("elastic_seeds", {"args": vars(args), "summary": summary, "runs": runs})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
