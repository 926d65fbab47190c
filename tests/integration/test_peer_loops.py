"""Recovery from a live peer for the loops people write (#50), on real 2-rank clusters with real gloo groups.

A plain ``for x, y in loader:`` inside ``for epoch in range(loader.epoch, 3)``, ``enumerate(loader)``, and a GAN
whose two optimizers step in turn within each batch: a rank is killed from outside (SIGKILL of its pid) at a seeded
random step, the cell still succeeds, and its line says the world was rebuilt from the living rank's memory. The
GAN's kill lands between its two optimizers' steps (the progress line is written there), so the living rank has
stepped one optimizer of the batch and not the other: it goes back to the batch's beginning (parallel/peer.py's
``Undo``). With gradient accumulation (a step every 4 batches) it goes on from the last step, not from a batch
whose gradients were summed but not stepped. The reference is the same cell run once without a kill, after the same setup: with 2 ranks gloo's sums
are exact whatever their order, so every parameter and buffer must be ``torch.equal`` to it, and the living rank
computes every batch once (the interrupted batch again). A loop around the loader's loop that begins at 0
(``range(3)``) would train the finished epochs again: recovery says what to write and runs the cell from the start,
which still ends equal to the reference. HANG_S only catches hangs.
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
from tests.helpers import poll

HANG_S = 120.0
SEED = int(os.environ.get("NBDIST_TEST_SEED", "0")) or random.SystemRandom().randrange(1, 10**6)

SETUP = """
import torch, nbdist
from nbdist.parallel import apply_ddp, shard
torch.manual_seed(0)
model = apply_ddp(torch.nn.Sequential(
    torch.nn.Linear(8, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1)))
opt = torch.optim.Adam(model.parameters(), lr=0.01)
torch.manual_seed(100 + dist.get_rank())  # each rank's dropout masks its own
_g = torch.Generator().manual_seed(1)
X = torch.randn(256, 8, generator=_g)
loader = shard(torch.utils.data.TensorDataset(X, X.sum(1, keepdim=True)), batch_size=8, seed=2)  # 16 steps an epoch
computed = globals().get("computed", 0)
"""
BODY = """
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
        computed += 1
        open(PROGRESS + f"-{dist.get_rank()}", "w").write(str(loader.step))
        time.sleep(0.02)
"""
FINAL = "final = [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]\n"
PLAIN = f"import time\nfor epoch in range(loader.epoch, 3):\n    for x, y in loader:{BODY}{FINAL}"  # 48 steps
ENUMERATE = (  # one epoch of 16 steps; the index goes on where the loader is
    "import time\nfor i, (x, y) in enumerate(loader, loader.batch):\n" + BODY.replace("\n        ", "\n    ") + FINAL
)
FROM_ZERO = PLAIN.replace("range(loader.epoch, 3)", "range(3)")
ACCUMULATING = ENUMERATE.replace(  # a step every 4 batches: a boundary between two is no place to go on from
    "opt.zero_grad(); loss.backward(); opt.step()",
    "loss.backward()\n    if (i + 1) % 4 == 0:\n        opt.step(); opt.zero_grad()",
)

GAN_SETUP = """
import torch, nbdist
from nbdist.parallel import apply_ddp, shard
torch.manual_seed(0)
G = apply_ddp(torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8)))
D = apply_ddp(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LeakyReLU(0.2), torch.nn.Linear(16, 1)))
optG = torch.optim.Adam(G.parameters(), lr=1e-3, betas=(0.5, 0.999))
optD = torch.optim.Adam(D.parameters(), lr=1e-3, betas=(0.5, 0.999))
torch.manual_seed(100 + dist.get_rank())  # each rank's noise its own
_g = torch.Generator().manual_seed(1)
loader = shard(torch.utils.data.TensorDataset(torch.randn(512, 8, generator=_g) * 2 + 1), batch_size=8, seed=2)
computed = globals().get("computed", 0)
"""
GAN = """
import time
bce = torch.nn.functional.binary_cross_entropy_with_logits
for (real,) in loader:  # 32 batches
    fake = G(torch.randn(len(real), 4))
    target = torch.cat([torch.ones(len(real), 1), torch.zeros(len(real), 1)])
    d_loss = bce(D(torch.cat([real, fake.detach()])), target)
    optD.zero_grad(); d_loss.backward(); optD.step()
    open(PROGRESS + f"-{dist.get_rank()}", "w").write(str(loader.step))  # between the two steps
    time.sleep(0.02)
    g_loss = bce(D(fake), torch.ones(len(real), 1))
    optG.zero_grad(); g_loss.backward(); optG.step()
    computed += 1
final = [t.detach().clone() for t in [*G.parameters(), *D.parameters()]]
"""

SHAPES = {  # setup, cell, batches in all, the range a kill lands in, batches a step spans
    "for x, y in loader": (SETUP, PLAIN, 48, (3, 44), 1),
    "enumerate(loader)": (SETUP, ENUMERATE, 16, (3, 13), 1),
    "a GAN's two optimizers": (GAN_SETUP, GAN, 32, (3, 28), 1),
    "gradient accumulation": (SETUP, ACCUMULATING, 16, (5, 14), 4),
}


def _progress(path: str, rank: int | str) -> int:
    try:
        return int(open(f"{path}-{rank}").read() or -1)
    except (OSError, ValueError):
        return -1


def run_with_a_kill(
    tmp_path, setup: str, cell: str, victim: int, after: int, watch: int | str | None = None
) -> tuple[str, list, list[int]]:
    """Kill ``victim`` once its progress (or the file ``watch`` names) reaches ``after``: the recovery's line, every
    rank's ``final``, and the batches each rank computed; then the same cell without a kill, after the same setup:
    its ``final``."""
    with nbdist.start(2, max_restarts=1, oversubscribe=True, timeout=90) as c:
        progress = str(tmp_path / "killed")
        c.run(f"PROGRESS = {progress!r}\n{setup}", setup=True).raise_for_error()
        pid = c.engines.ranks[victim].pid

        def killer() -> None:
            poll(lambda: _progress(progress, victim if watch is None else watch) >= after, within=HANG_S, every=0.002)
            os.kill(pid, signal.SIGKILL)

        thread = threading.Thread(target=killer, daemon=True)
        thread.start()
        result = c.run(cell).raise_for_error()  # the kill; the cell still succeeds
        thread.join(timeout=HANG_S)
        [line] = result.recovered
        final, computed = c.pull("final"), c.pull("computed")
        c.run(f"PROGRESS = {str(tmp_path / 'reference')!r}\n{setup}", setup=True).raise_for_error()
        c.run("computed = 0").raise_for_error()
        c.run(cell).raise_for_error()
        reference = c.pull("final")
    return line, [final, reference], computed


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_killed_rank_is_rebuilt_from_the_living_one_for_the_loops_people_write(tmp_path, shape):
    setup, cell, batches, (low, high), span = SHAPES[shape]
    rng = random.Random(f"{SEED}-{shape}")
    victim, after = rng.choice([0, 1]), rng.randrange(low, high)
    print(f"seed {SEED}: {shape}, rank {victim} killed after batch {after}")
    line, (final, reference), computed = run_with_a_kill(tmp_path, setup, cell, victim, after)
    print(line)
    assert line.startswith(f"rank(s) {victim} died during the cell"), line
    assert "memory (nothing recomputed)" in line and "not from a living rank" not in line, line
    rebuilt = int(re.search(r"rebuilt step (\d+) from rank", line)[1])
    assert after - span <= rebuilt <= after + 1 and rebuilt % span == 0, (after, rebuilt)  # the step the kill cut
    for rank in (0, 1):
        for i, (mine, theirs) in enumerate(zip(final[rank], reference[rank], strict=True)):
            assert torch.equal(mine, theirs), (SEED, shape, rank, i, (mine - theirs).abs().max())
    living = 1 - victim
    assert batches <= computed[living] <= batches + span, (SEED, shape, computed)  # each batch once, the cut step's again


def test_a_loop_around_the_loaders_loop_from_zero_is_said_and_the_cell_runs_from_the_start(tmp_path):
    """``for epoch in range(3)``: the kill lands in the second epoch, so a cell run again would begin the epochs
    at 0 with the loader mid-epoch 1 (four epochs in all). Recovery says what to write, replays the setup and runs
    the cell from the start: every batch computed again, the result still the reference's."""
    rng = random.Random(f"{SEED}-from-zero")
    victim, after = rng.choice([0, 1]), rng.randrange(18, 28)
    print(f"seed {SEED}: range(3), rank {victim} killed after batch {after}")
    line, (final, reference), computed = run_with_a_kill(tmp_path, SETUP, FROM_ZERO, victim, after)
    print(line)
    assert (
        "not from a living rank: the cell runs again from its first line, and its `for epoch in range(3)` would "
        "begin again although it had finished 1 pass(es) over loader: write `for epoch in range(loader.epoch, 3)`"
    ) in line, line
    assert "replayed 1 setup cell(s)" in line, line
    for rank in (0, 1):
        assert all(torch.equal(a, b) for a, b in zip(final[rank], reference[rank], strict=True)), (SEED, rank)
    assert computed[1 - victim] >= 48 + after - 1, computed  # the batches before the kill, then all 48 again


LEAKED = ENUMERATE.replace(  # rank 0, at step 6: grad mode off, as a release inside no_grad's __exit__ leaves it
    "    time.sleep(0.02)\n",
    "    time.sleep(0.02)\n"
    "    if dist.get_rank() == 0 and loader.step == 6 and not globals().get('_leaked'):\n"
    "        _leaked = True\n"
    "        torch._C._set_grad_enabled(False)\n"
    "        open(PROGRESS + '-leaked', 'w').write(str(loader.step))\n"
    f"        time.sleep({HANG_S})  # rank 1 is killed now; the release ends this\n",
)


def test_a_cell_run_again_after_a_recovery_begins_with_the_grad_mode_it_began_with(tmp_path):
    """A release is a SIGINT: its KeyboardInterrupt lands at whatever bytecode runs next, and after a peer's death
    that is often ``torch.no_grad().__exit__`` (DDP's forward broadcasts its buffers inside one) before it turned grad
    back on. The living rank's cell then ran again with grad off: "element 0 of tensors does not require grad" (CI,
    gradient accumulation above). Here rank 0 turns grad off itself, at step 6 (a race made certain), and rank 1 is
    killed while it waits: the cell run again trains on, and ends equal to the reference."""
    line, (final, reference), computed = run_with_a_kill(tmp_path, SETUP, LEAKED, 1, 6, watch="leaked")
    print(line)
    assert line.startswith("rank(s) 1 died during the cell") and "memory (nothing recomputed)" in line, line
    for rank in (0, 1):
        assert all(torch.equal(a, b) for a, b in zip(final[rank], reference[rank], strict=True)), rank
    assert 16 <= computed[0] <= 17, computed
