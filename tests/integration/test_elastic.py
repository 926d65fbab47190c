"""A world that goes on with fewer ranks (``--min-ranks``) and one that grows (``%dist_grow``), docs/faults.md
rows 60-63, on real clusters with real gloo groups, 2 cores.

The node a rank runs on goes away: the rank is killed from outside (SIGKILL of its pid, at a seeded random
step, rank 0 included) and no engine can start in its place. The launcher here (tests/gone_node.py) starts
every engine as a fresh process that exits at once, as an engine on a lost node never comes, once the test
has marked the node gone: the rest (engines, controller, gloo, recovery) is nbdist's own. The same on a real
two-node Slurm: tests/multinode/test_multinode.py. The world
goes on with the 3 ranks left from the step the kill interrupted, the rest of the epoch's samples split over
them.

The reference is the same training done by hand, as a user would without nbdist's recovery: 4 ranks train to
that step, rank 0 saves the model and optimizer, a new world of 3 ranks loads them and goes on, each rank
reading the samples the stated rule gives it (the rest of the epoch's order from the place the 4 ranks
reached, cut to a multiple of 3 and strided, then whole epochs of 3), all index arithmetic written here.
A grow while a ``--noblock`` cell trains stops its loop where the ranks agree, in any epoch: ``plan`` covers both.
Every parameter must be ``torch.equal`` to it. A grow is compared the same way (3 ranks to the step, 4 after).
HANG_S only catches hangs.
"""

from __future__ import annotations

import os
import random
import re
import signal
import threading

import pytest
import torch

import nbdist
from nbdist.errors import ClusterError, ConfigError, RankError
from tests import trackers
from tests.gone_node import gone_node
from tests.helpers import poll, run_cell

HANG_S = 120.0
N, B, STEPS, SEED = 384, 8, 40, 3  # 12 steps an epoch with 4 ranks, 16 with 3: the run crosses two epochs
PICK = int(os.environ.get("NBDIST_TEST_SEED", "0")) or random.SystemRandom().randrange(1, 10**6)

MODEL = f"""
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
model = DDP(net)
opt = torch.optim.Adam(model.parameters(), lr=0.01)
_g = torch.Generator().manual_seed(1)
X = torch.randn({N}, 8, generator=_g)
Y = (X ** 2).sum(1, keepdim=True)
"""
SETUP = (
    MODEL
    + f"""
from nbdist.parallel import shard
loader = shard(torch.utils.data.TensorDataset(X, Y), batch_size={B}, seed={SEED})
"""
)
TRAIN = f"""
import time
for step, (x, y) in loader.steps({STEPS}):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    open(PROGRESS + f"-{{dist.get_rank()}}", "w").write(str(step))
    time.sleep(0.03)
final = [p.detach().clone() for p in model.parameters()]
"""

# The same training by hand: the indices each rank reads, from the epoch's order as DistributedSampler makes it.
BY_HAND = f"""
def order(epoch):
    g = torch.Generator(); g.manual_seed({SEED} + epoch)
    return torch.randperm({N}, generator=g).tolist()

def batches(places, rank, size):
    mine = places[: len(places) // size * size][rank::size]
    return [mine[i : i + {B}] for i in range(0, len(mine) // {B} * {B}, {B})]

def plan(size, epoch, places, count):  # count steps from places of epoch's order on, then whole epochs
    steps = batches(order(epoch)[places:], dist.get_rank(), size)[:count]
    while len(steps) < count:
        epoch += 1
        steps += batches(order(epoch), dist.get_rank(), size)[: count - len(steps)]
    return steps

def train(plan):
    for idx in plan:
        loss = torch.nn.functional.mse_loss(model(X[idx]), Y[idx])
        opt.zero_grad(); loss.backward(); opt.step()
"""
FIRST = """
train(plan(BEFORE, 0, 0, STOP))
if dist.get_rank() == 0:
    torch.save({"model": net.state_dict(), "opt": opt.state_dict()}, SAVED)
"""
THEN = f"""
saved = torch.load(SAVED)
net.load_state_dict(saved["model"]); opt.load_state_dict(saved["opt"])
per_epoch = len(batches(order(0), 0, BEFORE))  # the steps of an epoch the first world read
epoch, places = STOP // per_epoch, STOP % per_epoch * BEFORE * {B}
left = STEPS - STOP  # loader.steps(STEPS); a loop over epochs: the rest of this one, then whole ones
if EPOCHS:
    left = len(batches(order(epoch)[places:], 0, AFTER)) + (EPOCHS - 1 - epoch) * len(batches(order(0), 0, AFTER))
train(plan(AFTER, epoch, places, left))
final = [p.detach().clone() for p in model.parameters()]
"""

# FSDP2 (fully_shard, no replicas): no peer holds a dead rank's shard, so the world that goes on loads the last
# checkpoint, resharded by DCP from 4 ranks' shards to 3; the reference saves and loads with DCP by hand.
FSDP_MODEL = MODEL.replace(
    "from torch.nn.parallel import DistributedDataParallel as DDP\n", "from torch.distributed.fsdp import fully_shard\n"
).replace("model = DDP(net)", "for block in (net[0], net[2]):\n    fully_shard(block)\nmodel = fully_shard(net)")
FULL = "final = [p.full_tensor().detach().clone() for p in model.parameters()]"
DCP = """
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
"""
FIRST_FSDP = (
    DCP
    + """
train(batches(order(0), dist.get_rank(), BEFORE)[:STOP])
msd, osd = get_state_dict(model, opt)
dcp.save({"model": msd, "opt": osd}, checkpoint_id=SAVED)
"""
)
THEN_FSDP = (
    DCP
    + """
msd, osd = get_state_dict(model, opt)
state = {"model": msd, "opt": osd}
dcp.load(state, checkpoint_id=SAVED)
set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["opt"])
"""
    + THEN.split("\n", 3)[3].replace("final = [p.detach().clone() for p in model.parameters()]", FULL)
)


@pytest.fixture
def gone_launcher(tmp_path):
    """The "gone-node" launcher (tests/gone_node.py); the flag it yields marks the node gone."""
    with gone_node(tmp_path) as flag:
        yield flag


def _progress(path: str, rank: int) -> int:
    try:
        return int(open(f"{path}-{rank}").read() or -1)
    except (OSError, ValueError):
        return -1


# The loop people write: epochs of a plain for over the loader (3 epochs: 36 steps with 4 ranks).
EPOCHS = 3
PLAIN = TRAIN.replace(
    f"for step, (x, y) in loader.steps({STEPS}):\n",
    f"for epoch in range(loader.epoch, {EPOCHS}):\n  for x, y in loader:\n    step = loader.step - 1\n",
)

# The same loop saving a checkpoint every 4 steps, for --recover-from checkpoint.
SAVING = TRAIN.replace(
    "opt.step()\n", "opt.step()\n    if step % 4 == 3: save_checkpoint(CKPT, model, opt, step + 1, loader=loader)\n"
)


@pytest.mark.parametrize("source", ["peer", "plain", "checkpoint", "fsdp"])
def test_a_lost_node_shrinks_the_world_and_training_goes_on_as_by_hand(tmp_path, gone_launcher, source):
    """From the living ranks' memory (the default; "plain": a plain for over the loader, in epochs), or from the last
    checkpoint: each rank then loads the part it saved under its old number, and the loader splits the rest of the
    epoch over the 3 ranks left. A sharded (FSDP) model has no copy on a peer: the checkpoint, resharded by DCP to 3
    ranks."""
    rng = random.Random(PICK)
    victim, after = rng.choice([0, 1, 2, 3]), rng.randrange(5, 10)
    print(f"seed {PICK}: rank {victim} and its node lost after step {after}")
    progress, ckpt = str(tmp_path / "progress"), str(tmp_path / "ckpt")
    with nbdist.start(
        4,
        launcher="gone-node",
        max_restarts=2,
        min_ranks=2,
        recover_from="checkpoint" if source == "checkpoint" else "peer",
        oversubscribe=True,
        timeout=90,
    ) as c:
        c.run(
            f"from nbdist.parallel import save_checkpoint\nPROGRESS, CKPT = {progress!r}, {ckpt!r}\n"
            + (SETUP if source != "fsdp" else SETUP.replace(MODEL, FSDP_MODEL)),
            setup=True,
        ).raise_for_error()
        gone_launcher.write_text("")  # from now on no engine starts: a replacement never comes
        pid = c.engines.ranks[victim].pid

        def killer() -> None:
            poll(lambda: _progress(progress, victim) >= after, within=HANG_S, every=0.005)
            os.kill(pid, signal.SIGKILL)

        thread = threading.Thread(target=killer, daemon=True)
        thread.start()
        train = {"peer": TRAIN, "plain": PLAIN}.get(source, SAVING)
        if source == "fsdp":
            train = train.replace("final = [p.detach().clone() for p in model.parameters()]", FULL)
        result = c.run(train).raise_for_error()  # the cell succeeds with 3 ranks
        thread.join(timeout=HANG_S)
        [line] = result.recovered
        print(line)
        assert line.startswith(f"rank(s) {victim} died during the cell; could not replace them ("), line
        assert "continuing with 3 of 4 ranks" in line, line
        if source in ("peer", "plain"):
            assert " memory (nothing recomputed)" in line, line
            stop = int(re.search(r"rebuilt step (\d+) from rank (\d+)'s (\(was rank (\d+)\) )?memory", line)[1])
            assert after <= stop <= after + 2, (after, stop)  # the step the kill interrupted, not an earlier one
        else:
            if source == "fsdp":
                assert "not from a living rank: the model is sharded (FSDP)" in line, line
            stop = int(re.search(rf"restored step (\d+) from {re.escape(ckpt)}", line)[1])
            assert stop % 4 == 0 and after - 4 < stop <= after + 1, (after, stop)  # the last one saved
        assert f"world size: 4 ranks, then 3 from step {stop} (rank(s) {victim} lost at " in c.membership.sizes_line()
        sizes = c.run("print(dist.get_rank(), dist.get_world_size())", quiet=True).raise_for_error()
        assert c.world_size == 3 and [r.stdout for r in sizes.ranks] == [f"{r} 3\n" for r in range(3)]
        elastic = c.pull("final")
    for rank in (1, 2):
        assert all(torch.equal(a, b) for a, b in zip(elastic[0], elastic[rank], strict=True))

    reference = _by_hand(tmp_path, stop, 4, 3, fsdp=source == "fsdp", epochs=EPOCHS if source == "plain" else 0)
    assert all(torch.equal(a, b) for a, b in zip(elastic[0], reference, strict=True)), (
        "the world that went on with 3 ranks differs from the same training done by hand"
    )


def _by_hand(tmp_path, stop: int, before: int, after: int, fsdp: bool = False, epochs: int = 0) -> list[torch.Tensor]:
    """The same training by hand: ``before`` ranks to step ``stop``, saved; ``after`` ranks load it and go on
    (``fsdp``: sharded, saved and loaded with DCP, which reshards), to STEPS in all or to the end of ``epochs``."""
    saved = str(tmp_path / "by-hand.pt")
    model = FSDP_MODEL if fsdp else MODEL
    common = (
        f"STEPS, STOP, SAVED, BEFORE, AFTER, EPOCHS = {STEPS}, {stop}, {saved!r}, {before}, {after}, {epochs}\n"
        f"{model}\n{BY_HAND}"
    )
    with nbdist.start(before, oversubscribe=True) as c:
        c.run(common + (FIRST_FSDP if fsdp else FIRST)).raise_for_error()
    with nbdist.start(after, oversubscribe=True) as c:
        c.run(common + (THEN_FSDP if fsdp else THEN)).raise_for_error()
        return c.pull("final", ranks=[0])[0]


def test_a_world_grown_between_cells_goes_on_as_by_hand(tmp_path, ip, capsys):
    """3 ranks train to step 7; %dist_grow 1; the 4 go on to the end: as by hand. %dist_status shows the sizes."""
    with nbdist.start(3, oversubscribe=True) as c:
        c.run(f"PROGRESS = {str(tmp_path / 'progress')!r}\n{SETUP}", setup=True).raise_for_error()
        c.run(TRAIN.replace(f"loader.steps({STEPS})", "loader.steps(7)")).raise_for_error()
        capsys.readouterr()
        run_cell(ip, "%dist_grow 1\n%dist_status")
        said = capsys.readouterr().out
        line = said.splitlines()[0]
        assert line.startswith("grew the world from 3 to 4 ranks: started rank(s) 3, rebuilt the process group"), line
        assert "gave every rank step 7 from rank 0's memory (nothing recomputed)" in line, line
        assert said.splitlines()[1].startswith("world size: 3 ranks, then 4 from step 7 (1 rank(s) added at "), said
        sizes = c.run("print(dist.get_rank(), dist.get_world_size())", quiet=True).raise_for_error()
        assert [r.stdout for r in sizes.ranks] == [f"{r} 4\n" for r in range(4)]
        c.run(TRAIN).raise_for_error()
        grown = c.pull("final")
    for rank in (1, 2, 3):
        assert all(torch.equal(a, b) for a, b in zip(grown[0], grown[rank], strict=True))
    reference = _by_hand(tmp_path, 7, 3, 4)
    assert all(torch.equal(a, b) for a, b in zip(grown[0], reference, strict=True)), (
        "the world grown to 4 ranks differs from the same training done by hand"
    )


def test_a_grow_the_launcher_cannot_give_says_so_and_the_world_goes_on(tmp_path, gone_launcher):
    with nbdist.start(2, launcher="gone-node", timeout=90) as c:
        cores = os.cpu_count() or 2
        with pytest.raises(ConfigError, match=f"from 2 to {cores + 1} ranks: n \\({cores + 1}\\) is more than this"):
            c.grow(cores - 1)  # beyond the host's slots: its cores
        c.config.world.oversubscribe = True
        with pytest.raises(ConfigError, match="no cell is marked %%distributed --setup"):
            c.grow(1)
        c.run(f"PROGRESS = {str(tmp_path / 'progress')!r}\n{SETUP}", setup=True).raise_for_error()
        with pytest.raises(ConfigError, match=r"\(0\) must be a whole number, 1 or more"):
            c.grow(0)
        gone_launcher.write_text("")
        with pytest.raises(ClusterError, match="could not grow the world: .*it goes on with its 2 ranks"):
            c.grow(1)
        assert c.world_size == 2 and c.run("x = 1").ok  # nothing changed


def test_a_world_below_min_ranks_fails_the_cell_naming_what_was_lost(tmp_path, gone_launcher):
    progress = str(tmp_path / "progress")
    with nbdist.start(2, launcher="gone-node", max_restarts=1, min_ranks=2, timeout=90) as c:
        c.run(f"PROGRESS = {progress!r}\n{SETUP}", setup=True).raise_for_error()
        gone_launcher.write_text("")
        pid = c.engines.ranks[1].pid
        threading.Thread(
            target=lambda: (poll(lambda: _progress(progress, 1) >= 3, within=HANG_S), os.kill(pid, signal.SIGKILL)),
            daemon=True,
        ).start()
        result = c.run(TRAIN)
        with pytest.raises(RankError):
            result.raise_for_error()
        said = " ".join(result.notes)
        assert "rank(s) 1 died and could not be replaced (" in said and "fewer than --min-ranks 2" in said, said
        kept = c.run("print(step)", ranks=[0], quiet=True).raise_for_error()
        assert kept.ranks[0].stdout.strip().isdigit()  # rank 0 kept what it had


def test_a_world_grown_while_a_noblock_cell_trains_goes_on_from_the_step_it_stopped_at(tmp_path, ip, capsys):
    """3 ranks train in a --noblock cell; at a seeded random step %dist_grow 1: the loop stops at a step boundary
    every rank agrees on, the world grows to 4 from that step's state and the cell goes on: as by hand (3 ranks to
    that step, 4 after). The cell's result says the grow; the 4 ranks hold the same weights. The loop logs its loss
    and the world is tracked: the cell followed with nothing shown (wait(show=False)) still keeps every rank's rows
    after the grow, and the tracked run has each step once, every rank's from where it joined."""
    progress = str(tmp_path / "progress")
    after = 3 + PICK % 10
    slow = TRAIN.replace("time.sleep(0.03)", "time.sleep(0.06)").replace(  # the loop must still run when the grow comes
        " opt.step()\n", " opt.step()\n    nbdist.log(step=step, loss=loss.item())\n"
    )
    assert slow != TRAIN.replace("time.sleep(0.03)", "time.sleep(0.06)")
    with nbdist.start(3, oversubscribe=True) as c:
        nbdist.track("tensorboard", "grown", str(tmp_path / "runs"))
        c.run(f"PROGRESS = {progress!r}\nimport nbdist\n{SETUP}", setup=True).raise_for_error()
        c.run(slow, block=False)
        assert poll(lambda: _progress(progress, 0) >= after, HANG_S), "the loop did not start"
        capsys.readouterr()
        run_cell(ip, "%dist_grow 1")
        said = capsys.readouterr().out
        grew = re.search(r"gave every rank step (\d+) from rank 0's memory \(nothing recomputed\)", said)
        assert "asked the running cell to stop at its next step boundary" in said, said
        assert "grew the world from 3 to 4 ranks: started rank(s) 3" in said and grew, said
        stop = int(grew.group(1))
        assert after <= stop < STEPS, f"the loop stopped at step {stop}, not while it ran (picked {after}, PICK={PICK})"
        assert not c.last.done() or c.last.wait().ok  # the cell goes on, in the background, on 4 ranks
        result = c.last.wait(show=False)
        assert result.ok, result
        assert [r.rank for r in result.ranks] == [0, 1, 2, 3], result
        assert any(line.startswith("grew the world from 3 to 4 ranks") for line in result.recovered), result.recovered
        logged = {rank: [row["step"] for row in rows if "loss" in row] for rank, rows in result.metrics.items()}
        assert logged == {rank: list(range(stop, STEPS)) for rank in range(4)}, (stop, logged)
        grown = c.pull("final")
    got = trackers.read("tensorboard", tmp_path / "runs", "grown")
    assert [s for s, _ in got["rank0/loss"]] == list(range(STEPS)), got["rank0/loss"]  # every step once, in order
    assert [s for s, _ in got["rank3/loss"]] == list(range(stop, STEPS)), (stop, got["rank3/loss"])
    assert got["world/size"] == [(0, 3.0), (stop, 4.0)], got["world/size"]
    for rank in (1, 2, 3):
        assert all(torch.equal(a, b) for a, b in zip(grown[0], grown[rank], strict=True))
    reference = _by_hand(tmp_path, stop, 3, 4)
    assert all(torch.equal(a, b) for a, b in zip(grown[0], reference, strict=True)), (
        f"the world grown to 4 ranks at step {stop} while its cell ran differs from the same training done by hand"
    )


def test_a_grow_beside_a_cell_without_a_step_boundary_comes_when_the_cell_ends(tmp_path):
    """A --noblock cell with no loader.steps() never stops for the grow: it ends as it would, then the world grows
    (its result says so), and cluster.last.wait() still returns that result."""
    with nbdist.start(2, oversubscribe=True) as c:
        c.run(f"PROGRESS = {str(tmp_path / 'progress')!r}\n{SETUP}", setup=True).raise_for_error()
        c.run("import time\nfor _ in range(20):\n    time.sleep(0.1)\nsize = dist.get_world_size()", block=False)
        line = c.grow(1)
        assert line.startswith("grew the world from 2 to 3 ranks: started rank(s) 2"), line
        result = c.last.wait(show=False)
        assert result.ok and [r.rank for r in result.ranks] == [0, 1] and result.recovered == [line], result
        assert c.pull("size", ranks=[0, 1]) == [2, 2] and c.world_size == 3  # it ran on 2; the world has 3 now
        sizes = c.run("print(dist.get_world_size())", quiet=True).raise_for_error()
        assert [r.stdout for r in sizes.ranks] == ["3\n"] * 3
