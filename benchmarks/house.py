"""Before and after a change to the house (#57): the figures a user feels, for two trees in the same run.

For each tree (``--before``, a checkout of the earlier commit, and this one), alternated round by round, each
figure in a fresh process whose ``nbdist`` is that tree's (PYTHONPATH; its engines and warm process inherit it):
- ``start``: ``nbdist.start(2)`` until it returns (the world formed and proved);
- ``cell_2``, ``cell_16``: a trivial cell (``cluster.run("pass")``), median of 20, at 2 and 16 ranks;
- ``failure_to_next``: a cell where rank 1 raises while rank 0 waits in a collective, then the next cell (an
  all_reduce), from the first cell's start to the second's end;
- ``kill_to_progress``: 2 ranks, ``--max-restarts 1``, a DDP loop over ``shard(...).steps()``; rank 1 SIGKILLed at
  step 10; from the kill to the restarted rank's first step;
- ``restart``: rank 1 SIGKILLed between cells, then ``cluster.restart([1])``.
Medians of ``--rounds``; JSON under results/house.json.

    git worktree add /tmp/nbdist-before <commit>
    python benchmarks/house.py --before /tmp/nbdist-before
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

from _common import save

HERE = pathlib.Path(__file__).resolve().parents[1]

PROBE = r'''
import json, os, signal, sys, tempfile, threading, time
import nbdist
from nbdist.cells.output import Sink
what = sys.argv[1]
out = {"nbdist": os.path.dirname(nbdist.__file__)}
quiet = dict(sink=Sink())
if what == "start":
    tic = time.perf_counter()
    c = nbdist.start(2, progress=lambda s: None)
    out["s"] = time.perf_counter() - tic
    c.stop()
elif what.startswith("cell_"):
    n = int(what.split("_")[1])
    with nbdist.start(n, oversubscribe=True, timeout=120, progress=lambda s: None) as c:
        c.run("pass", **quiet)
        times = []
        for _ in range(20):
            tic = time.perf_counter()
            c.run("pass", **quiet).raise_for_error()
            times.append(time.perf_counter() - tic)
        times.sort()
        out["s"] = times[len(times) // 2]
elif what == "failure_to_next":
    with nbdist.start(2, progress=lambda s: None) as c:
        c.run("pass", **quiet)
        tic = time.perf_counter()
        c.run("if dist.get_rank() == 1:\n    raise ValueError('x')\ndist.all_reduce(torch.ones(1))", **quiet)
        c.run("t = torch.ones(1)\ndist.all_reduce(t)", **quiet).raise_for_error()
        out["s"] = time.perf_counter() - tic
elif what == "kill_to_progress":
    d = tempfile.mkdtemp()
    setup = (
        f"PROGRESS = {d!r}\nimport time, torch\nfrom nbdist.parallel import apply_ddp, shard\ntorch.manual_seed(0)\n"
        "model = apply_ddp(torch.nn.Linear(8, 1))\nopt = torch.optim.SGD(model.parameters(), lr=0.01)\n"
        "X = torch.randn(512, 8)\nloader = shard(torch.utils.data.TensorDataset(X, X.sum(1, keepdim=True)), batch_size=8)\n"
    )
    train = (
        "for step, (x, y) in loader.steps(40):\n"
        "    loss = torch.nn.functional.mse_loss(model(x), y)\n"
        "    opt.zero_grad(); loss.backward(); opt.step()\n"
        "    with open(PROGRESS + f'/{dist.get_rank()}-{os.getpid()}', 'a') as fh: fh.write(f'{time.time()} {step}\\n')\n"
        "    time.sleep(0.02)\n"
    )
    with nbdist.start(2, max_restarts=1, progress=lambda s: None) as c:
        c.run("import os\n" + setup, setup=True, **quiet).raise_for_error()
        victim = c.engines.ranks[1].pid
        killed = []
        def killer():
            path = f"{d}/1-{victim}"
            while True:
                try:
                    if len(open(path).read().splitlines()) >= 10:
                        break
                except OSError:
                    pass
                time.sleep(0.002)
            killed.append(time.time())
            os.kill(victim, signal.SIGKILL)
        threading.Thread(target=killer, daemon=True).start()
        r = c.run(train, **quiet)
        assert r.ok and r.recovered, r
        fresh = [f for f in os.listdir(d) if f.startswith("1-") and f != f"1-{victim}"]
        first = min(float(line.split()[0]) for f in fresh for line in open(f"{d}/{f}"))
        out["s"] = first - killed[0]
elif what == "restart":
    with nbdist.start(2, progress=lambda s: None) as c:
        c.run("pass", **quiet)
        pid = c.engines.ranks[1].pid
        os.kill(pid, signal.SIGKILL)
        def running(pid):
            try:  # gone, or a zombie: it has died (it may be reaped between two looks)
                return open(f"/proc/{pid}/stat").read().split()[2] != "Z"
            except OSError:  # FileNotFoundError, or ESRCH while it is reaped
                return False
        while running(pid):
            time.sleep(0.005)
        tic = time.perf_counter()
        c.restart([1])
        out["s"] = time.perf_counter() - tic
print("RESULT " + json.dumps(out))
'''

FIGURES = ("start", "cell_2", "cell_16", "failure_to_next", "kill_to_progress", "restart")


def once(tree: pathlib.Path, what: str) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    # run in the tree: ``python -c`` puts the working directory first on sys.path, before PYTHONPATH
    done = subprocess.run(
        [sys.executable, "-c", PROBE, what], env=env, capture_output=True, text=True, timeout=600, cwd=tree
    )
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{what} on {tree} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    got = json.loads(line[len("RESULT ") :])
    assert pathlib.Path(got["nbdist"]).parent == tree, (got, tree)  # the tree asked for, not the installed one
    return float(got["s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="a checkout of the earlier commit (git worktree add)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--figures", default=",".join(FIGURES))
    args = ap.parse_args()
    trees = {"before": pathlib.Path(args.before).resolve(), "after": HERE}
    samples: dict[str, dict[str, list[float]]] = {t: {} for t in trees}
    for rnd in range(args.rounds):
        for what in args.figures.split(","):
            for tree in (("before", "after") if rnd % 2 == 0 else ("after", "before")):
                s = once(trees[tree], what)
                samples[tree].setdefault(what, []).append(s)
                print(f"round {rnd} {what:17s} {tree:6s} {s * 1000:9.1f} ms", flush=True)
    table = {
        what: {tree: statistics.median(samples[tree][what]) for tree in trees} for what in args.figures.split(",")
    }
    print(f"\n{'figure':18s} {'before':>10s} {'after':>10s} {'after/before':>13s}")
    for what, row in table.items():
        print(f"{what:18s} {row['before'] * 1000:8.1f}ms {row['after'] * 1000:8.1f}ms {row['after'] / row['before']:12.2f}x")
    save("house", {"trees": {k: str(v) for k, v in trees.items()}, "medians_s": table, "samples_s": samples})


if __name__ == "__main__":
    main()
