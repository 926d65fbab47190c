"""A rank that dies while the world recovers from another's death (docs/faults.md, rows 108-110), on real 3- and
4-rank clusters with real gloo groups on 2 cores: each ends in one line, with the world either whole or said to be
short, never hung.

* a rank killed while the world forms again around a replaced rank (the replacement has just registered);
* a rank that dies while the setup cells are replayed, with the budget left, and with it spent;
* collectives a recovery runs outside a cell (a peer's give, a checkpoint's load) fail on every rank within
  seconds when one rank dies in them, not at the group's timeout.

The training cell saves a checkpoint every 5 steps: two neighbours dead lose a part that only they kept, so the
world goes on from the checkpoint, and the test compares it, bit for bit, with the same loop run without a kill.
Time bounds only catch hangs (HANG_S).
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import torch

import nbdist
from tests.helpers import poll

HANG_S = 120.0
STEPS = 40

SETUP = """
import os, time, torch
from nbdist.parallel import apply_ddp, shard, save_checkpoint
if os.path.exists(ARM) and dist.get_rank() == 2 and not os.path.exists(MARK):
    open(MARK, "w").close()
    os.kill(os.getpid(), 9)  # dies while the recovery replays this cell
torch.manual_seed(0)
model = apply_ddp(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.5)
torch.manual_seed(100 + dist.get_rank())
_g = torch.Generator().manual_seed(1)
X = torch.randn(480, 8, generator=_g)
loader = shard(torch.utils.data.TensorDataset(X, X.sum(1, keepdim=True)), batch_size=8, seed=2)
"""
TRAIN = f"""
for step, (x, y) in loader.steps({STEPS}):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    if (step + 1) % 5 == 0:
        save_checkpoint(CKPT, model, opt, step + 1, loader=loader)
    open(PROGRESS + f"-{{dist.get_rank()}}", "w").write(str(step))
    time.sleep(0.02)
final = [t.detach().clone() for t in model.parameters()]
"""


def _setup(tmp_path, name: str) -> str:
    paths = {k: str(tmp_path / f"{name}-{k}") for k in ("ckpt", "progress", "arm", "mark")}
    return (
        f"CKPT, PROGRESS, ARM, MARK = {paths['ckpt']!r}, {paths['progress']!r}, {paths['arm']!r}, {paths['mark']!r}\n"
        + SETUP
    )


def _progress(tmp_path, name: str, rank: int) -> int:
    try:
        return int(open(tmp_path / f"{name}-progress-{rank}").read() or -1)
    except (OSError, ValueError):
        return -1


def _whole(c, n: int) -> None:
    """Every rank alive, in one process group of ``n`` that reduces."""
    assert c.engines.dead_ranks() == []
    out = c.run("t = torch.ones(1); dist.all_reduce(t); print(dist.get_world_size(), int(t.item()))").raise_for_error()
    assert {line for rank in out.ranks for line in rank.stdout.splitlines()} == {f"{n} {n}"}, out


def _reference(c, tmp_path, step: int) -> list[list[torch.Tensor]]:
    """The same loop without a kill, with a fresh DDP where the recovery went on (``step``): above 2 ranks a new
    DDP's first bucket layout changes gloo's summation order in the last bit (test_peer_recovery.py says more)."""
    c.run(_setup(tmp_path, "reference"), setup=True).raise_for_error()
    fresh = f"    if step == {step}:\n        model = apply_ddp(model.module)\n"
    c.run(TRAIN.replace("    loss = torch", fresh + "    loss = torch")).raise_for_error()
    return c.pull("final")


def test_a_rank_killed_while_the_world_forms_again_is_taken_into_the_same_recovery(tmp_path):
    """Rank 1 dies at step 12; rank 2 is killed the moment rank 1's replacement registers, while every rank leaves
    the old group and the new one forms. Before: the living ranks waited 30 s in torch's rendezvous for the dead
    one, and the recovery failed ("run %dist_restart")."""
    with nbdist.start(3, max_restarts=2, oversubscribe=True, timeout=90) as c:
        c.run(_setup(tmp_path, "run"), setup=True).raise_for_error()
        killed: list[int] = []

        def killer() -> None:
            poll(lambda: _progress(tmp_path, "run", 1) >= 12, within=HANG_S, every=0.005)
            old, second = c.engines.ranks[1].engine_id, c.engines.ranks[2].pid
            os.kill(c.engines.ranks[1].pid, signal.SIGKILL)
            killed.append(1)
            poll(lambda: c.engines.ranks[1].engine_id != old, within=HANG_S, every=0.002)
            os.kill(second, signal.SIGKILL)
            killed.append(2)

        thread = threading.Thread(target=killer, daemon=True)
        thread.start()
        tic = time.monotonic()
        result = c.run(TRAIN)
        thread.join(timeout=HANG_S)
        assert time.monotonic() - tic < HANG_S and killed == [1, 2], killed
        assert result.ok, (result, result.notes)
        assert len(result.recovered) == 1, result.recovered
        line = result.recovered[0]
        print(line)
        assert line.startswith(
            "rank(s) 1 died during the cell; rank(s) 2 died during its recovery; restarted rank(s) 1, 2, rebuilt the "
            "process group, replayed 1 setup cell(s), "
        ), line
        assert "automatic restarts left: 0 of 2" in line, line  # one round each
        # The hang this guards: the living ranks waiting out the rendezvous timeout (30 s) for the dead one.
        assert float(re.search(r" in ([\d.]+) s, and ran", line).group(1)) < 20, line
        step = int(re.search(r"(?:rebuilt|restored) step (\d+) from", line).group(1))
        final = c.pull("final")
        _whole(c, 3)
        reference = _reference(c, tmp_path, step)
        for rank in range(3):
            for mine, theirs in zip(final[rank], reference[rank], strict=True):
                assert torch.equal(mine, theirs), (line, rank, (mine - theirs).abs().max())


def test_a_rank_that_dies_while_the_setup_cells_replay_is_recovered_or_said_to_be_short(tmp_path):
    """Rank 1 is killed at step 12; rank 2 dies when the recovery replays the setup cell. With a restart left it
    is taken into the recovery and the world is whole; with none left the cell fails in one line that names the
    ranks the world is short of and the command that brings them back, which does."""
    for budget in (2, 1):
        name = f"budget{budget}"
        with nbdist.start(3, max_restarts=budget, oversubscribe=True, timeout=90) as c:
            c.run(_setup(tmp_path, name), setup=True).raise_for_error()

            def killer(c=c, name=name) -> None:
                poll(lambda: _progress(tmp_path, name, 1) >= 12, within=HANG_S, every=0.005)
                open(tmp_path / f"{name}-arm", "w").close()  # the setup cell kills rank 2 when it runs again
                os.kill(c.engines.ranks[1].pid, signal.SIGKILL)

            thread = threading.Thread(target=killer, daemon=True)
            thread.start()
            tic = time.monotonic()
            result = c.run(TRAIN)
            thread.join(timeout=HANG_S)
            assert time.monotonic() - tic < HANG_S
            assert (tmp_path / f"{name}-mark").exists()  # rank 2 did die in the replay
            print(result.recovered, result.notes)
            if budget == 2:
                assert result.ok and len(result.recovered) == 1, (result, result.notes)
                assert result.recovered[0].startswith(
                    "rank(s) 1 died during the cell; rank(s) 2 died during its recovery; restarted rank(s) 1, 2,"
                ), result.recovered
                _whole(c, 3)
                assert c.pull("step") == [STEPS - 1] * 3
                continue
            assert not result.ok and not result.recovered, result
            said = [n for n in result.notes if "died during its recovery" in n]
            assert said == [
                "rank(s) 1 died during the cell; rank(s) 2 died during its recovery, and the automatic restarts are "
                "spent (1 of 1): the world is short of rank(s) 2; %dist_restart --ranks 1,2 brings them back."
            ], result.notes
            c.restart([1, 2])
            _whole(c, 3)


GIVE = """
def give(die):
    import os, torch, torch.distributed as dist
    from nbdist.engine import group
    if die:
        os._exit(9)
    t = torch.ones(1 << 16)
    with group.broken_on_error():
        dist.all_reduce(t)
"""


def test_collectives_a_recovery_runs_outside_a_cell_fail_on_every_rank_when_one_dies_in_them():
    """Rank 3 exits instead of joining an all_reduce that 0-2 run through apply (as a recovery's give and restore
    do). Its neighbours see the closed connection; the rank waiting on them would wait for the group's timeout
    (30 minutes by default) had they not broken their group in turn."""
    with nbdist.start(4, oversubscribe=True, timeout=90) as c:
        c.run(GIVE).raise_for_error()
        tic = time.monotonic()
        give = [c.engines.client[r.engine_id].apply_async(_call_give, r.rank == 3) for r in c.engines.ranks]
        for rank in range(3):
            try:
                give[rank].get(timeout=60)
            except Exception as exc:  # noqa: BLE001 - the error is the point
                assert "Engine" not in type(exc).__name__, exc
            else:
                raise AssertionError(f"rank {rank}'s all_reduce went through with rank 3 dead")
        print(f"every living rank failed in {time.monotonic() - tic:.1f} s")
        assert time.monotonic() - tic < 60  # a hang: the group's 30 minutes


def _call_give(die: bool) -> None:
    from IPython import get_ipython

    get_ipython().user_ns["give"](die)


GLOO_WORKERS = """
import os
workers = sum(
    open(f"/proc/self/task/{t}/comm").read().strip() == "pt_gloo_runloop" for t in os.listdir("/proc/self/task")
)
"""


def test_a_broken_worlds_groups_are_kept_from_being_freed_as_a_rank_leaves_it():
    """torch frees a gloo group by joining its worker threads, and gloo can leave a worker in a send for the group's
    timeout after the connection was shut (engine/group.py, keep_broken): freed as the rank left the world, that held
    it in leave_world (1 recovery in 32 at 32 ranks here). The race is not made on purpose here; what is checked is
    that a rank that broke its world (rank 1) keeps the group's workers as it leaves, and a rank that leaves a whole
    world (rank 0) frees them, as before."""
    with nbdist.start(2, oversubscribe=True, timeout=90) as c:
        c.run(GLOO_WORKERS).raise_for_error()
        assert c.pull("workers") == [2, 2]  # the world's group: gloo's two worker threads
        c.run(
            "from nbdist.engine import group\n"
            "if dist.get_rank() == 1:\n    group.abort_world()\n"
            "group.leave_world()\nkept = len(group.BROKEN)\n" + GLOO_WORKERS
        ).raise_for_error()
        assert c.pull("kept") == [0, 1]
        assert c.pull("workers") == [0, 2]
