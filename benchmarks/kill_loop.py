"""A rank killed again and again in one world: does any living rank die beside it? (#57)

One world of ``--ranks`` ranks (oversubscribed on this machine's cores, ``--max-restarts`` as many as the kills),
a DDP loop over ``shard(...).steps()`` in a ``--setup`` world; in each round one rank, chosen by a seeded random
generator (rank 0, which hosts the store, included), is SIGKILLed from outside at a random step, and the cell must
recover by itself. Counted per round: the ranks the recovery line names as dead (1 is right; more means a living
rank was ended or died beside the killed one), the notes about ranks that "did not stop after an interrupt", and
kill -> the cell's end. A living rank that dies is a defect, never noise: the script exits non-zero when one did.
JSON under results/kill_loop.json.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import sys
import tempfile
import threading
import time

from _common import save, stats

import nbdist
from nbdist.cells.output import Sink

SETUP = """
import os, time, torch
from nbdist.parallel import apply_ddp, shard
torch.manual_seed(0)
model = apply_ddp(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
_g = torch.Generator().manual_seed(1)
X = torch.randn(4096, 8, generator=_g)
loader = shard(torch.utils.data.TensorDataset(X, X.sum(1, keepdim=True)), batch_size=8, seed=2)
"""
TRAIN = """
for step, (x, y) in loader.steps(loader.step + {steps}):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    open(PROGRESS + f"-{{dist.get_rank()}}", "w").write(str(step))
    time.sleep(0.03)
"""


def _progress(path: str, rank: int) -> int:
    try:
        return int(open(f"{path}-{rank}").read() or -1)
    except (OSError, ValueError):
        return -1


def _died(line: str) -> list[int]:
    """The ranks a recovery line names as dead, and those it names as ended for not stopping after the release."""
    found = re.match(r"rank\(s\) ([\d, ]+) died", line)
    ended = re.search(r"rank\(s\) ([\d, ]+) did not stop after the release and were ended", line)
    return [int(r) for m in (found, ended) if m for r in m.group(1).split(", ")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--kills", type=int, default=50)
    ap.add_argument("--steps", type=int, default=40, help="loop steps per round")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--second-after",
        type=float,
        default=None,
        metavar="S",
        help="kill a second rank S seconds after the first (two deaths: the second may land in the recovery itself)",
    )
    args = ap.parse_args()
    rng = random.Random(args.seed)
    rounds: list[dict] = []
    workdir = tempfile.mkdtemp(prefix="kill-loop-")
    progress = os.path.join(workdir, "progress")
    with nbdist.start(args.ranks, max_restarts=args.kills, oversubscribe=True, timeout=120, progress=lambda s: None) as c:
        c.run(f"PROGRESS = {progress!r}\n{SETUP}", setup=True, sink=Sink()).raise_for_error()
        for k in range(args.kills):
            victim, after = rng.randrange(args.ranks), rng.randrange(3, args.steps // 2)
            for r in range(args.ranks):
                try:
                    os.unlink(f"{progress}-{r}")
                except FileNotFoundError:
                    pass
            killed_at: list[float] = []
            c.run("START = loader.step", sink=Sink()).raise_for_error()
            first = c.pull("START", ranks=[0])[0]

            second = rng.choice([r for r in range(args.ranks) if r != victim])

            def killer(
                rank: int = victim, at: int = after + first, killed_at: list[float] = killed_at, other: int = second
            ) -> None:
                end = time.monotonic() + 120
                while _progress(progress, rank) < at and time.monotonic() < end:
                    time.sleep(0.002)
                os.kill(c.engines.ranks[rank].pid, signal.SIGKILL)
                killed_at.append(time.perf_counter())
                if args.second_after is not None:  # another rank, moments later: during the release or the recovery
                    time.sleep(args.second_after)
                    try:
                        os.kill(c.engines.ranks[other].pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass

            thread = threading.Thread(target=killer, daemon=True)
            thread.start()
            result = c.run(f"PROGRESS = {progress!r}\n" + TRAIN.format(steps=args.steps), sink=Sink())
            ended = time.perf_counter()
            thread.join(timeout=5)
            dead = sorted({r for line in result.recovered for r in _died(line)})
            slow = [n for n in result.notes if "did not stop after an interrupt" in n]
            row = {
                "round": k,
                "victim": victim,
                "victims": sorted({victim} | ({second} if args.second_after is not None else set())),
                "after_step": after,
                "ok": result.ok,
                "dead": dead,
                "did_not_stop": len(slow),
                "kill_to_end_s": round(ended - killed_at[0], 3) if killed_at else None,
                "recovered": result.recovered,
                "notes": result.notes[:3],
            }
            rounds.append(row)
            victims = {victim} | ({second} if args.second_after is not None else set())
            beside = [r for r in dead if r not in victims]
            print(
                f"round {k:2d}: killed rank {victim} after step {after}: ok={result.ok} dead={dead} "
                f"kill->end {row['kill_to_end_s']} s"
                + (f"  LIVING RANK(S) {beside} DIED" if beside or not result.ok else ""),
                flush=True,
            )
            if beside:
                print("   " + "\n   ".join(result.recovered + result.notes), flush=True)
            if not result.ok:
                print("   " + "\n   ".join(str(result).splitlines()[:12]), flush=True)
                break
    bad = [r for r in rounds if not r["ok"] or [d for d in r["dead"] if d not in r["victims"]]]
    times = [r["kill_to_end_s"] for r in rounds if r["kill_to_end_s"] is not None and r["ok"]]
    summary = {
        "ranks": args.ranks,
        "kills": len(rounds),
        "rounds_with_a_living_rank_dead_or_failed": len(bad),
        "kill_to_cell_end_s": stats(times) if times else None,
    }
    print(summary)
    save("kill_loop", {"args": vars(args), "summary": summary, "rounds": rounds})
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
