"""A world that shrinks and grows, timed beside doing the same by hand.

- **Shrink** (``--min-ranks``): 4 ranks train (the small DDP model of benchmarks/recovery.py, a checkpoint every
  5 steps); at step ~22 rank 1 is killed from outside and its node is gone (tests/gone_node.py: no engine starts
  there any more). nbdist goes on with 3 ranks by itself, from the living ranks' memory (``--recover-from peer``)
  or from the last checkpoint. Timed: kill -> the first step completed after it; counted: steps computed twice.
  **By hand**, as without ``--min-ranks``: the cell fails naming the dead rank, then ``%dist_stop``,
  ``%dist_start -n 3``, the setup cell, ``load_checkpoint`` of the last checkpoint (``per_rank=False``: a
  checkpoint of 4 ranks has no part for a world of 3) and the cell again.
- **Grow** (``%dist_grow 1``, 3 -> 4 ranks between cells): ``Cluster.grow`` beside by hand (``save_checkpoint``
  now, ``%dist_stop``, ``%dist_start -n 4``, the setup cell, ``load_checkpoint``).
- **Grow while a ``--noblock`` cell trains**: asked at step ~10, the loop stops at the next step boundary the ranks
  agree on, the world grows, the cell goes on. Timed: asked -> the first step done by the 4 ranks, split into
  asked -> stopped (the 3 ranks train on meanwhile: not time lost), the grow (training stands still), and the
  cell again -> its first step; counted: steps computed twice. By hand
  would add the interrupt to the between-cells figure above.

Medians of --reps; JSON under results/elastic.json.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time

from _common import save, stats

import nbdist
from nbdist.cells.output import Sink

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from recovery import _kill_at, _lines, _progress_after, _seconds  # noqa: E402

from tests.gone_node import gone_node  # noqa: E402

STEPS, EVERY, SLEEP = 60, 5, 0.02
SETUP = """
import os, time, torch
from nbdist.parallel import apply_ddp, shard, save_checkpoint, load_checkpoint
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
_g = torch.Generator().manual_seed(1)
X = torch.randn(1024, 8, generator=_g)
model = apply_ddp(net)
opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.5)
loader = shard(torch.utils.data.TensorDataset(X, X.sum(1, keepdim=True)), batch_size=8, seed=2)
"""
TRAIN = f"""
for step, (x, y) in loader.steps(STEPS):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    if (step + 1) % {EVERY} == 0:
        save_checkpoint(CKPT, model, opt, step + 1, loader=loader)
    if dist.get_rank() == 0:
        with open(PROGRESS, "a") as fh:
            fh.write(f"{{time.time()}} {{step}}\\n")
    time.sleep({SLEEP})
"""


def _twice(progress: str) -> int:
    steps = [int(r[1]) for r in _lines(progress)]
    return len(steps) - len(set(steps))


def shrink_once(workdir: str, i: int, mode: str) -> dict:
    tag = os.path.join(workdir, f"shrink-{mode}-{i}")
    progress, ckpt = f"{tag}-progress", f"{tag}-ckpt"
    with gone_node(pathlib.Path(workdir)) as flag:
        kw = dict(launcher="gone-node", max_restarts=1, min_ranks=2, recover_from=mode, oversubscribe=True)
        with nbdist.start(4, timeout=60, **kw) as cluster:
            cluster.run(f"CKPT, PROGRESS, STEPS = {ckpt!r}, {progress!r}, {STEPS}\n{SETUP}", setup=True)
            flag.write_text("")  # the node is gone: no engine starts any more
            said: dict = {}
            cluster.progress = lambda line: said.setdefault("began", time.time() - _seconds(line))
            out: dict = {}
            watcher = _kill_at(progress, lambda: cluster.ranks[1].pid, out)
            result = cluster.run(TRAIN, sink=Sink())
            watcher.join()
            result.raise_for_error()
            line = result.recovered[0]
            assert "continuing with 3 of 4 ranks" in line, line
        flag.unlink()
    total = _progress_after(progress, out["kill"])
    return {
        "kill_to_progress_s": total,
        "detect_s": said["began"] - out["kill"],  # kill -> the recovery begins (the others released, the death seen)
        "shrink_s": _seconds(line),  # the replacement tried, the world rebuilt smaller, setup replayed, state given
        "rerun_to_first_step_s": total - (said["began"] - out["kill"]) - _seconds(line),
        "steps_computed_twice": _twice(progress),
        "line": line,
    }


def shrink_by_hand_once(workdir: str, i: int) -> dict:
    tag = os.path.join(workdir, f"byhand-{i}")
    progress, ckpt = f"{tag}-progress", f"{tag}-ckpt"
    out: dict = {}
    with nbdist.start(4, timeout=60, oversubscribe=True) as cluster:
        cluster.run(f"CKPT, PROGRESS, STEPS = {ckpt!r}, {progress!r}, {STEPS}\n{SETUP}", setup=True)
        watcher = _kill_at(progress, lambda: cluster.ranks[1].pid, out)
        result = cluster.run(TRAIN, sink=Sink())
        watcher.join()
        assert not result.ok, "the kill did not land during the cell"
    with nbdist.start(3, timeout=60, oversubscribe=True) as cluster:
        cluster.run(f"CKPT, PROGRESS, STEPS = {ckpt!r}, {progress!r}, {STEPS}\n{SETUP}").raise_for_error()
        # a checkpoint of 4 ranks has no per-rank part for 3: the loader starts its epoch again, at the saved step
        cluster.run("loader.step = load_checkpoint(CKPT, model, opt, per_rank=False)").raise_for_error()
        cluster.run(TRAIN, sink=Sink()).raise_for_error()
    return {"kill_to_progress_s": _progress_after(progress, out["kill"]), "steps_computed_twice": _twice(progress)}


def grow_once(workdir: str, i: int) -> dict:
    progress, ckpt = os.path.join(workdir, f"grow-{i}-progress"), os.path.join(workdir, f"grow-{i}-ckpt")
    with nbdist.start(3, timeout=60, oversubscribe=True) as cluster:
        cluster.run(f"CKPT, PROGRESS, STEPS = {ckpt!r}, {progress!r}, 20\n{SETUP}", setup=True).raise_for_error()
        cluster.run(TRAIN, sink=Sink()).raise_for_error()
        tic = time.perf_counter()
        line = cluster.grow(1)
        seconds = time.perf_counter() - tic
        assert "nothing recomputed" in line, line
    return {"seconds": seconds, "line": line}


def grow_running_once(workdir: str, i: int) -> dict:
    progress, ckpt = os.path.join(workdir, f"growr-{i}-progress"), os.path.join(workdir, f"growr-{i}-ckpt")
    with nbdist.start(3, timeout=60, oversubscribe=True) as cluster:
        cluster.run(f"CKPT, PROGRESS, STEPS = {ckpt!r}, {progress!r}, {STEPS}\n{SETUP}", setup=True).raise_for_error()
        cluster.run(TRAIN, sink=Sink(), block=False)
        while len(_lines(progress)) < 10:
            time.sleep(0.01)
        asked = time.time()
        line = cluster.grow(1)
        grown = time.time()
        result = cluster.last.wait(show=False)  # type: ignore[union-attr]
        assert result.ok and len(result.ranks) == 4 and "nothing recomputed" in line, (result, line)
    took = float(line.rsplit(" in ", 1)[1].split(" s")[0])  # the grow's own seconds, as its line says
    again = _progress_after(progress, grown)  # the first step the 4 ranks completed
    return {
        "asked_to_progress_s": grown - asked + again,
        "asked_to_stopped_s": grown - asked - took,
        "grow_s": took,
        "rerun_to_first_step_s": again,
        "steps_computed_twice": _twice(progress),
        "line": line,
    }


def grow_by_hand_once(workdir: str, i: int) -> float:
    progress, ckpt = os.path.join(workdir, f"growh-{i}-progress"), os.path.join(workdir, f"growh-{i}-ckpt")
    head = f"CKPT, PROGRESS, STEPS = {ckpt!r}, {progress!r}, 20\n{SETUP}"
    with nbdist.start(3, timeout=60, oversubscribe=True) as cluster:
        cluster.run(head).raise_for_error()
        cluster.run(TRAIN, sink=Sink()).raise_for_error()
        tic = time.perf_counter()
        cluster.run("save_checkpoint(CKPT + '-now', model, opt, loader.step, loader=loader)").raise_for_error()
    with nbdist.start(4, timeout=60, oversubscribe=True) as cluster:
        cluster.run(head).raise_for_error()
        cluster.run("load_checkpoint(CKPT + '-now', model, opt, per_rank=False)").raise_for_error()
        return time.perf_counter() - tic


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    rows: dict[str, list] = {"shrink from peer": [], "shrink from checkpoint": [], "by hand": []}
    grows: list[dict] = []
    grows_by_hand: list[float] = []
    running: list[dict] = []
    with tempfile.TemporaryDirectory() as workdir:
        for i in range(args.reps):
            for mode in ("peer", "checkpoint"):
                rows[f"shrink from {mode}"].append(shrink_once(workdir, i, mode))
                print(f"shrink from {mode}: {rows[f'shrink from {mode}'][-1]}")
            rows["by hand"].append(shrink_by_hand_once(workdir, i))
            print(f"by hand: {rows['by hand'][-1]}")
            grows.append(grow_once(workdir, i))
            grows_by_hand.append(grow_by_hand_once(workdir, i))
            print(f"grow: {grows[-1]['seconds']:.2f} s; by hand {grows_by_hand[-1]:.2f} s")
            running.append(grow_running_once(workdir, i))
            print(f"grow while a cell trains: {running[-1]}")
    parts = ("kill_to_progress_s", "detect_s", "shrink_s", "rerun_to_first_step_s", "steps_computed_twice")
    data = {
        "shrink": {
            name: {k: stats([r[k] for r in got]) for k in parts if k in got[0]} for name, got in rows.items()
        },
        "grow_s": stats([g["seconds"] for g in grows]),
        "grow_by_hand_s": stats(grows_by_hand),
        "grow_while_training": {k: stats([r[k] for r in running]) for k in running[0] if k != "line"},
        "lines": {name: got[-1].get("line", "") for name, got in rows.items()} | {"grow": grows[-1]["line"], "grow while training": running[-1]["line"]},
    }
    for name, row in data["shrink"].items():
        split = (
            f" (detection {row['detect_s']['median']:.2f} s, shrink {row['shrink_s']['median']:.2f} s, cell again -> "
            f"first step {row['rerun_to_first_step_s']['median']:.2f} s)"
            if "detect_s" in row
            else ""
        )
        print(
            f"  {name}: kill -> progress {row['kill_to_progress_s']['median']:.2f} s{split}, steps computed twice "
            f"{row['steps_computed_twice']['samples']}"
        )
    print(f"  grow 3 -> 4: {data['grow_s']['median']:.2f} s; by hand {data['grow_by_hand_s']['median']:.2f} s")
    r = data["grow_while_training"]
    print(
        f"  grow 3 -> 4 while a cell trains: asked -> 4 ranks training {r['asked_to_progress_s']['median']:.2f} s "
        f"(to the step boundary {r['asked_to_stopped_s']['median']:.2f} s, grow {r['grow_s']['median']:.2f} s, cell "
        f"again -> first step {r['rerun_to_first_step_s']['median']:.2f} s), steps computed twice "
        f"{r['steps_computed_twice']['samples']}"
    )
    save("elastic", data)


if __name__ == "__main__":
    main()
