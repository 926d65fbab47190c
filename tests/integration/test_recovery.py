"""Recovery without the user (docs/faults.md, rows 23-26), on real 2-rank clusters with real gloo groups.

* kill -9 of rank 1 in the middle of a checkpointing DDP training cell under --max-restarts 1:
  the cell succeeds by itself and ends with parameters bit-identical to an uninterrupted run;
  with the budget spent the next kill fails the cell as before;
* setup cells (with collectives) are replayed on every rank, other cells never;
* SIGTERM to one engine runs the save hooks on every rank at the same step, then it leaves;
* %dist_where on a hanging --noblock cell: both stacks with cell lines, the odd rank marked;
* --debug-collectives turns a shape mismatch into an error naming both ranks and both calls.

Time bounds only catch hangs (HANG_S); benchmarks/recovery.py measures how fast recovery is.
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
import torch

import nbdist
from nbdist.errors import RankError
from tests.helpers import poll, run_cell, touch_code, wait_for

HANG_S = 90.0

SETUP = """
import os, torch, nbdist
from nbdist.parallel import apply_ddp, shard, save_checkpoint
torch.manual_seed(0)
model = apply_ddp(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.5)
_g = torch.Generator().manual_seed(1)
X = torch.randn(256, 8, generator=_g)
loader = shard(torch.utils.data.TensorDataset(X, X.sum(1, keepdim=True)), batch_size=8, seed=2)
"""
# Shuffled data, dropout (the RNG) and momentum (optimizer state): all must resume exactly.
TRAIN = """
for step, (x, y) in loader.steps(40):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    if (step + 1) % 5 == 0:
        save_checkpoint(CKPT, model, opt, step + 1, loader=loader)
    if step == 22 and dist.get_rank() == 1 and MARK and not os.path.exists(MARK):
        open(MARK, "w").close()
        os.kill(os.getpid(), 9)
final = torch.cat([p.detach().flatten() for p in model.parameters()])
"""


def _setup(ckpt: str, mark: str) -> str:
    return f"%%distributed --setup\nCKPT, MARK = {ckpt!r}, {mark!r}\n{SETUP}"


def test_a_rank_killed_mid_training_recovers_by_itself_and_ends_bit_identical(ip, tmp_path, capsys):
    run_cell(ip, "%dist_start -n 2 --max-restarts 1")
    try:
        run_cell(ip, _setup(str(tmp_path / "plain"), ""))
        run_cell(ip, f"%%distributed\n{TRAIN}")
        reference = nbdist.current().pull("final")
        assert torch.equal(reference[0], reference[1])
        capsys.readouterr()

        run_cell(ip, _setup(str(tmp_path / "killed"), str(tmp_path / "mark1")))
        tic = time.monotonic()
        run_cell(ip, f"%%distributed\n{TRAIN}")  # rank 1 kills itself at step 22; the cell still succeeds
        assert time.monotonic() - tic < HANG_S
        assert (tmp_path / "mark1").exists()
        out = capsys.readouterr().out
        lines = [ln for ln in out.splitlines() if "died during the cell" in ln]
        assert len(lines) == 1, out
        assert "restarted rank(s) 1" in lines[0] and "replayed 2 setup cell(s)" in lines[0]  # both setups, in order
        # from the living rank's memory at the step the kill interrupted, not from the checkpoint of step 20
        assert "rebuilt step 23 from rank 0's memory (nothing recomputed)" in lines[0], lines[0]
        assert "automatic restarts left: 0 of 1" in lines[0]
        recovered = nbdist.current().pull("final")
        for rank in (0, 1):  # bit-identical: the data order, dropout masks and momentum all resumed
            assert torch.equal(recovered[rank], reference[rank]), (recovered[rank] - reference[rank]).abs().max()

        # The budget is spent: a second death fails the cell as before, and says so.
        run_cell(ip, _setup(str(tmp_path / "again"), str(tmp_path / "mark2")))
        with pytest.raises(RankError, match=r"rank 1 died") as err:
            run_cell(ip, f"%%distributed\n{TRAIN}")
        assert any("automatic restarts are spent (1 of 1)" in n for n in err.value.notes)
        assert nbdist.current().dead_ranks() == [1]
    finally:
        run_cell(ip, "%dist_stop")


def test_setup_cells_with_collectives_replay_on_every_rank_and_other_cells_never(tmp_path):
    log = str(tmp_path / "log")
    setup = (
        f"import os\nt = torch.ones(1)\ndist.all_reduce(t)\n"
        f"open({log!r} + f'-{{dist.get_rank()}}', 'a').write(f'setup {{int(t.item())}}\\n')"
    )
    plain = f"open({log!r} + f'-{{dist.get_rank()}}', 'a').write('plain\\n')\nbase = 5"
    kill = (
        f"open({log!r} + f'-{{dist.get_rank()}}', 'a').write('cell\\n')\n"
        f"if dist.get_rank() == 1 and not os.path.exists({log!r} + '-mark'):\n"
        f"    open({log!r} + '-mark', 'w').close()\n"
        "    os.kill(os.getpid(), 9)\n"
        "dist.all_reduce(t)\nafter = t.item()"
    )
    with nbdist.start(2, max_restarts=2, timeout=60) as c:
        c.run(setup, setup=True).raise_for_error()
        c.run(plain).raise_for_error()
        result = c.run(kill).raise_for_error()
        assert len(result.recovered) == 1 and "replayed 1 setup cell(s)" in result.recovered[0]
        assert c.pull("after") == [4.0, 4.0]  # the replayed setup's collective, then the cell's
        assert c.pull("base", ranks=0) == [5]  # rank 0 kept its variables; the plain cell was not replayed
        with pytest.raises(Exception, match="has no variable 'base'"):
            c.pull("base", ranks=1)
        assert c.recovery.left == 1
    logs = {r: open(f"{log}-{r}").read().split() for r in (0, 1)}
    # rank 0 lived: setup, plain, cell (released), setup again, cell again; rank 1 died in its first cell
    assert " ".join(logs[0]) == "setup 2 plain cell setup 2 cell"
    assert " ".join(logs[1]) == "setup 2 plain cell setup 2 cell"


def test_a_setup_cell_that_fails_when_replayed_is_said_with_the_rank_that_raised_not_one_released_for_it(tmp_path):
    """The replayed setup cell raises on the restarted rank only, while rank 0 waits for it in a collective and is
    released. The recovery's error names the rank that raised and its error (a 64-rank recovery said "rank 0 was
    interrupted in cell line 4", and rank 63's AttributeError was nowhere)."""
    mark = str(tmp_path / "mark")
    setup = (
        "import os\n"
        f"if dist.get_rank() == 1 and os.path.exists({mark!r}):\n"
        "    raise ValueError('the replay went wrong on this rank')\n"
        "t = torch.ones(1)\n"
        "dist.all_reduce(t)\n"
    )
    kill = f"if dist.get_rank() == 1:\n    open({mark!r}, 'w').close()\n    os.kill(os.getpid(), 9)\ndist.barrier()\n"
    with nbdist.start(2, max_restarts=1, timeout=60) as c:
        c.run(setup, setup=True).raise_for_error()
        result = c.run(kill, timeout=HANG_S)
    said = " ".join(result.notes)
    assert not result.ok and "setup cell 1 of 1 failed when replayed: rank 1 raised ValueError" in said, said


def test_sigterm_to_one_engine_runs_the_save_hook_on_every_rank_before_it_leaves(tmp_path):
    hooks = str(tmp_path / "hook")
    setup = f"""
import nbdist, time
from nbdist.parallel import shard
loader = shard(torch.utils.data.TensorDataset(torch.arange(64.)), batch_size=2, shuffle=False)
def save(step):
    open({hooks!r} + f'-{{dist.get_rank()}}', 'w').write(str(step))
nbdist.on_preempt(save, grace=20)
"""
    train = f"""
for step, (x,) in loader.steps(100_000):
    if step == 3:
        open({str(tmp_path / "going")!r}, 'w').close()
    time.sleep(0.01)
"""
    with nbdist.start(2, timeout=60) as c:
        c.run(setup).raise_for_error()
        pid1 = c.ranks[1].pid
        pending = c.run(train, block=False)
        end = time.monotonic() + HANG_S
        while not (tmp_path / "going").exists() and time.monotonic() < end:
            time.sleep(0.02)
        os.kill(pid1, signal.SIGTERM)
        result = pending.wait(timeout=HANG_S)
        assert {r.rank: r.error["ename"] for r in result.ranks} == {0: "Preempted", 1: "Preempted"}
        assert "rank(s) 1 received SIGTERM (preemption)" in result.ranks[0].error["evalue"]
        steps = [open(f"{hooks}-{r}").read() for r in (0, 1)]
        assert steps[0] == steps[1] and int(steps[0]) >= 3  # the same step on both ranks
        deadline = time.monotonic() + 30
        while psutil.pid_exists(pid1) and psutil.Process(pid1).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the preempted engine did not leave"
            time.sleep(0.05)
        assert psutil.Process(c.ranks[0].pid).is_running()  # the other rank stays
        assert c.dead_ranks() == [1]


def test_dist_where_shows_each_ranks_cell_lines_and_marks_the_one_behind(ip, capsys, tmp_path):
    run_cell(ip, "%dist_start -n 2")
    try:
        here = tmp_path / "here"
        cell = f"import time\nt = torch.ones(1)\nif dist.get_rank() == 1:\n    time.sleep(30)\n{touch_code(here)}dist.all_reduce(t)\n"
        run_cell(ip, f"%%distributed --noblock\n{cell}")
        wait_for(f"{here}-0")  # rank 0 is at the all_reduce: in it, or a breath away

        def where() -> str:
            capsys.readouterr()
            run_cell(ip, "%dist_where")
            out = capsys.readouterr().out
            both = "in all_reduce (inside torch.distributed)" in out and "time.sleep(30)" in out
            return out if both else ""  # rank 0 in the collective, rank 1 in its sleep

        out = poll(where, within=HANG_S)
        assert "rank 0: at cell line 6, in all_reduce (inside torch.distributed)" in out
        assert "cell line   6 in <module>: dist.all_reduce(t)" in out
        assert "last collective: all_reduce [1] float32" in out and "waiting" in out
        rank1 = out[out.index("rank 1: ") :]
        assert "at cell line 4, in <module>" in rank1.splitlines()[0]  # time.sleep is C: no frame of its own
        assert "<-- behind: rank(s) 0 entered all_reduce" in rank1.splitlines()[0]
        assert "<--" not in out[: out.index("rank 1: ")]
        assert "cell line   4 in <module>: time.sleep(30)" in rank1
        pending = nbdist.current().last
        result = pending.wait(timeout=0.1, show=False)  # release both; the world is rebuilt
        assert not result.ok
        nbdist.current().run("z = torch.ones(1)\ndist.all_reduce(z)\nproof = z.item()").raise_for_error()
        assert nbdist.current().pull("proof") == [2.0, 2.0]
    finally:
        run_cell(ip, "%dist_stop")


def test_debug_collectives_turns_a_shape_mismatch_into_an_error_naming_both_ranks():
    with nbdist.start(2, debug_collectives=True, timeout=60) as c:
        c.run("t = torch.ones(2)\ndist.all_reduce(t)").raise_for_error()  # matching calls pass the check
        tic = time.monotonic()
        with pytest.raises(RankError) as err:
            c.run("x = torch.ones(3 if dist.get_rank() == 0 else 4)\ndist.all_reduce(x)").raise_for_error()
        assert time.monotonic() - tic < HANG_S
        text = str(err.value)
        assert "ranks called different collectives: rank 0 called allreduce([3] float)" in text
        assert "rank 1 called allreduce([4] float)" in text and "cell line 2" in text
        c.run("z = torch.ones(1)\ndist.all_reduce(z)\nproof = z.item()").raise_for_error()
        assert c.pull("proof") == [2.0, 2.0]
        # torch 2.13's DDP segfaults in such a world; apply_ddp says so instead of losing the ranks
        r = c.run("from nbdist.parallel import apply_ddp\nm = apply_ddp(torch.nn.Linear(2, 1))")
        assert {x.error["ename"] for x in r.ranks} == {"ConfigError"} and c.dead_ranks() == []
        assert "without --debug-collectives" in r.ranks[0].error["evalue"]


# The quick start's loop with an LR scheduler, saved without state=: the scheduler holds the optimizer,
# so save_checkpoint keeps it too, and a rank killed mid-run resumes with the learning rate it had.
SCHED_SETUP = SETUP + "sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)\n"
SCHED_TRAIN = TRAIN.replace("opt.step()\n", "opt.step(); sched.step()\n")


def test_a_scheduler_left_out_of_save_checkpoint_is_kept_and_recovery_is_bit_identical(ip, tmp_path, capsys):
    assert SCHED_TRAIN != TRAIN
    run_cell(ip, "%dist_start -n 2 --max-restarts 1 --recover-from checkpoint")  # what the checkpoint holds
    try:
        run_cell(ip, f"%%distributed --setup\nCKPT, MARK = {str(tmp_path / 'plain')!r}, ''\n{SCHED_SETUP}")
        run_cell(ip, f"%%distributed\n{SCHED_TRAIN}")
        out = capsys.readouterr().out
        assert out.count("nbdist: save_checkpoint keeps sched (StepLR) too") == 1, out  # once, from rank 0
        reference = nbdist.current().pull("final")
        assert nbdist.current().pull("sched.get_last_lr()") == [[0.02 * 0.5**5]] * 2  # 40 steps: 5 halvings

        mark = tmp_path / "mark"
        run_cell(ip, f"%%distributed --setup\nCKPT, MARK = {str(tmp_path / 'killed')!r}, {str(mark)!r}\n{SCHED_SETUP}")
        run_cell(ip, f"%%distributed\n{SCHED_TRAIN}")  # rank 1 kills itself at step 22; restored from step 20
        assert mark.exists() and "restored step 20" in capsys.readouterr().out
        recovered = nbdist.current().pull("final")
        for rank in (0, 1):  # a scheduler started over at step 20 would have moved them (by 3.5e-4 at lr 0.02)
            assert torch.equal(recovered[rank], reference[rank]), (recovered[rank] - reference[rank]).abs().max()
    finally:
        run_cell(ip, "%dist_stop")


def test_a_run_killed_before_its_first_checkpoint_starts_from_its_setup_not_from_another_runs_checkpoint(
    ip, tmp_path, capsys
):
    """A setup cell that builds the model and optimizer anew begins another run: a rank killed before that run's
    first save is rebuilt from the replayed setup cells, never from the checkpoint the run before it saved."""
    setup = SETUP.replace("lr=0.02", "lr=LR")
    early = TRAIN.replace("step == 22", "step == 2")  # before the first save (step 5)
    assert setup != SETUP and early != TRAIN
    run_cell(ip, "%dist_start -n 2 --max-restarts 1 --recover-from checkpoint")  # the checkpoint path alone
    try:
        run_cell(ip, f"%%distributed --setup\nCKPT, MARK, LR = {str(tmp_path / 'a')!r}, '', 0.03\n{setup}")
        run_cell(ip, f"%%distributed\n{TRAIN}")
        reference = nbdist.current().pull("final")
        run_cell(ip, f"%%distributed --setup\nCKPT, MARK, LR = {str(tmp_path / 'b')!r}, '', 0.02\n{setup}")
        run_cell(ip, f"%%distributed\n{TRAIN}")  # another run: its checkpoints go up to step 40
        other = nbdist.current().pull("final")
        assert not torch.equal(other[0], reference[0])
        capsys.readouterr()

        mark = tmp_path / "mark"
        run_cell(ip, f"%%distributed --setup\nCKPT, MARK, LR = {str(tmp_path / 'c')!r}, {str(mark)!r}, 0.03\n{setup}")
        run_cell(ip, f"%%distributed\n{early}")  # rank 1 kills itself at step 2, before this run saved anything
        out = capsys.readouterr().out
        lines = [ln for ln in out.splitlines() if "died during the cell" in ln]
        assert mark.exists() and len(lines) == 1, out
        assert "restored step" not in lines[0], lines[0]
        assert "no checkpoint was saved since the setup cells ran, so the cell starts again" in lines[0], lines[0]
        recovered = nbdist.current().pull("final")
        for rank in (0, 1):  # run b's step 40 loaded into this run would have ended where run b did
            assert torch.equal(recovered[rank], reference[rank]), (recovered[rank] - reference[rank]).abs().max()
    finally:
        run_cell(ip, "%dist_stop")
