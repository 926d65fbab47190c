"""Exact resume of a whole training loop (docs/faults.md), on real 2-rank clusters with real gloo groups.

The loop has everything that must come back for a resumed run to be the same run: BatchNorm (each
rank's running statistics differ: DDP broadcasts rank 0's at each forward, then each rank updates
them from its own batch), dropout (the RNG), Adam (optimizer state), a StepLR scheduler and a
GradScaler under bf16 autocast (``state=``), a shuffled sharded loader (its position), and a plain
value in ``extra=``. The reference is the same loop run once without a kill. After a kill the
final parameters *and* buffers must be ``torch.equal`` to the reference on every rank: the same
ops on the same data in the same order give the same bits, so any difference is a missed piece.

Cases: rank 0 killed (it hosts the store), rank 1 killed, a rank killed in the middle of a save
(the previous checkpoint is used), saves written asynchronously, and the same by hand with
``%dist_restart`` and ``load_checkpoint``. Time bounds only catch hangs (HANG_S).
"""

from __future__ import annotations

import time

import pytest
import torch

import nbdist
from tests.helpers import run_cell

HANG_S = 120.0

SETUP = """
import os, time, torch, nbdist
from nbdist.parallel import apply_ddp, shard, save_checkpoint, load_checkpoint
torch.manual_seed(0)
model = apply_ddp(torch.nn.Sequential(
    torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)))
opt = torch.optim.Adam(model.parameters(), lr=0.01)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=3)
_g = torch.Generator().manual_seed(1)
X = torch.randn(256, 8, generator=_g)
loader = shard(torch.utils.data.TensorDataset(X, X.sum(1, keepdim=True)), batch_size=8, seed=2)
meta = {"best": float("inf")}


class Saboteur:
    # kills this rank from inside save_checkpoint at step KILL_IN_SAVE (a kill mid-save)
    def state_dict(self):
        if SAVING == KILL_IN_SAVE and dist.get_rank() == KILL_RANK and MARK and not os.path.exists(MARK):
            open(MARK, "w").close()
            os.kill(os.getpid(), 9)
        return {}

    def load_state_dict(self, state):
        pass


saboteur = Saboteur()
"""

TRAIN = """
for step, (x, y) in loader.steps(40):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    if step == KILL_EARLY and dist.get_rank() == KILL_RANK and MARK and not os.path.exists(MARK):
        open(MARK, "w").close()  # killed after its backward, before its optimizer step, 50 ms into the step (a
        time.sleep(0.05)  # real one's length: this model's takes 1 ms, less than its boundary part takes to leave)
        os.kill(os.getpid(), 9)
    scaler.step(opt)
    scaler.update()
    sched.step()
    meta["best"] = min(meta["best"], loss.item())
    meta.setdefault("first", loss.item())  # set at step 0 only: a restarted rank has it only from extra=
    if (step + 1) % 5 == 0:
        SAVING = step + 1
        save_checkpoint(CKPT, model, opt, step + 1, loader=loader, extra=meta, keep=2, asynchronous=ASYNC,
                        state={"sched": sched, "scaler": scaler, "saboteur": saboteur})
    if step == KILL_AT and dist.get_rank() == KILL_RANK and MARK and not os.path.exists(MARK):
        open(MARK, "w").close()
        os.kill(os.getpid(), 9)
final = [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]
summary = (sched.last_epoch, scaler.get_scale(), meta["best"], meta["first"])
"""


def _setup(
    ckpt: str,
    *,
    mark: str = "",
    kill_rank: int = 0,
    kill_at: int = -1,
    kill_in_save: int = -1,
    kill_early: int = -1,
    asynchronous: bool = False,
) -> str:
    knobs = (
        f"CKPT, MARK, KILL_RANK, KILL_AT, KILL_IN_SAVE, KILL_EARLY, ASYNC, SAVING = {ckpt!r}, {mark!r}, {kill_rank}, "
        f"{kill_at}, {kill_in_save}, {kill_early}, {asynchronous}, 0"
    )
    return f"%%distributed --setup\n{knobs}\n{SETUP}"


@pytest.fixture(scope="module")
def reference(ip, tmp_path_factory):
    """The loop without a kill: each rank's final parameters and buffers, and (epoch, scale, best, first loss)."""
    ckpt = str(tmp_path_factory.mktemp("reference") / "ckpt")
    run_cell(ip, "%dist_start -n 2")
    try:
        run_cell(ip, _setup(ckpt))
        run_cell(ip, f"%%distributed\n{TRAIN}")
        c = nbdist.current()
        return c.pull("final"), c.pull("summary")
    finally:
        run_cell(ip, "%dist_stop")


def _assert_same_run(reference) -> None:
    c = nbdist.current()
    final, summary = c.pull("final"), c.pull("summary")
    ref_final, ref_summary = reference
    assert summary == ref_summary  # the scheduler's epoch, the scaler's scale, extra's running best and first loss
    for rank in (0, 1):
        assert len(final[rank]) == len(ref_final[rank])
        for i, (mine, theirs) in enumerate(zip(final[rank], ref_final[rank], strict=True)):
            assert torch.equal(mine, theirs), (rank, i, (mine.double() - theirs.double()).abs().max())
    # the ranks' BatchNorm statistics really differ: a resume that gave every rank one copy would fail above
    assert not torch.equal(ref_final[0][-3], ref_final[1][-3])


CASES = [
    dict(kill_rank=0, kill_at=22),  # rank 0 hosts the rendezvous store
    dict(kill_rank=1, kill_at=22),
    dict(kill_rank=1, kill_in_save=20),  # mid-save: step 20 never completes; 15 is the latest
    dict(kill_rank=0, kill_at=27, asynchronous=True),
]
IDS = ["rank0-killed", "rank1-killed", "killed-mid-save", "async-saves-rank0-killed"]


def _killed_run(ip, tmp_path, capsys, case: dict) -> tuple[str, list[str]]:
    """Set up with ``case``'s kill, run the loop (the cell succeeds by itself); the checkpoint path and the
    one recovery line, checked to name the killed rank."""
    ckpt = str(tmp_path / "ckpt")
    run_cell(ip, _setup(ckpt, mark=str(tmp_path / "mark"), **case))
    capsys.readouterr()
    tic = time.monotonic()
    run_cell(ip, f"%%distributed\n{TRAIN}")  # the kill happens; the cell still succeeds
    assert time.monotonic() - tic < HANG_S
    assert (tmp_path / "mark").exists()
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "died during the cell" in ln]
    assert len(lines) == 1 and f"restarted rank(s) {case['kill_rank']}" in lines[0], lines
    return ckpt, lines


PEER_CASES = [
    dict(kill_rank=0, kill_early=22),  # after its backward, before its optimizer step
    dict(kill_rank=1, kill_at=22),  # after its step: its part is taken at the step, and extra= changes after it
    dict(kill_rank=1, kill_early=22),
    dict(kill_rank=0, kill_early=27, asynchronous=True),
]
PEER_IDS = ["rank0-killed-before-its-step", "rank1-killed-after-its-step", "rank1-killed-before-its-step", "async"]


@pytest.mark.parametrize("case", PEER_CASES, ids=PEER_IDS)
def test_a_killed_rank_is_rebuilt_from_the_living_rank_with_no_step_recomputed(ip, tmp_path, capsys, reference, case):
    """--recover-from peer (the default): the living rank's memory, no file read; the loop goes on from the
    step the kill interrupted and ends as the uninterrupted run. Killed after its step, the rank took its
    extra= (meta, updated after the step) along: that one falls back to the checkpoint and says why."""
    run_cell(ip, "%dist_start -n 2 --max-restarts 1")
    try:
        ckpt, lines = _killed_run(ip, tmp_path, capsys, case)
        if "kill_early" in case:
            step, living = case["kill_early"], 1 - case["kill_rank"]
            assert f"rebuilt step {step} from rank {living}'s memory (nothing recomputed)" in lines[0], lines[0]
            assert "restored step" not in lines[0]  # no checkpoint was read
        else:
            assert (
                "not from a living rank: rank 1 died after its optimizer step 23 and before the next step " in lines[0]
            )
            assert "the meta it updates in between (extra= of save_checkpoint) died with it" in lines[0], lines[0]
            assert f"restored step 20 from {ckpt}" in lines[0], lines[0]
        _assert_same_run(reference)
    finally:
        run_cell(ip, "%dist_stop")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_killed_rank_recovers_by_itself_to_the_uninterrupted_run(ip, tmp_path, capsys, reference, case):
    """--recover-from checkpoint: the last complete checkpoint, the steps since computed again."""
    run_cell(ip, "%dist_start -n 2 --max-restarts 1 --recover-from checkpoint")
    try:
        ckpt, lines = _killed_run(ip, tmp_path, capsys, case)
        expected = {22: ["20"], 27: ["25", "20"]}.get(case.get("kill_at", -1), ["15"])
        if not case.get("asynchronous"):
            expected = expected[:1]  # a synchronous save is complete when the call returns
        assert any(f"restored step {s} from {ckpt}" in lines[0] for s in expected), lines[0]
        _assert_same_run(reference)
        # keep=2: only the two newest complete checkpoints are left; no half-written one
        from nbdist.parallel.checkpoint import complete_steps

        assert complete_steps(ckpt) == [35, 40]
    finally:
        run_cell(ip, "%dist_stop")


def test_the_same_by_hand_with_dist_restart_and_load_checkpoint(ip, tmp_path, reference):
    run_cell(ip, "%dist_start -n 2")
    try:
        ckpt = str(tmp_path / "ckpt")
        run_cell(ip, _setup(ckpt, mark=str(tmp_path / "mark"), kill_rank=0, kill_at=22))
        with pytest.raises(Exception, match="died"):
            run_cell(ip, f"%%distributed\n{TRAIN}")
        run_cell(ip, "%dist_restart")
        run_cell(ip, _setup(ckpt, mark=str(tmp_path / "mark")))
        run_cell(
            ip,
            "%%distributed\nresumed = load_checkpoint(CKPT, model, opt, loader=loader, extra=meta, "
            "state={'sched': sched, 'scaler': scaler, 'saboteur': saboteur})",
        )
        assert nbdist.current().pull("resumed") == [20, 20]
        run_cell(ip, f"%%distributed\n{TRAIN}")
        _assert_same_run(reference)
    finally:
        run_cell(ip, "%dist_stop")


BAD = """
import os, shutil, torch
from nbdist.parallel import apply_ddp, save_checkpoint, load_checkpoint, latest_step
torch.manual_seed(0)
model = apply_ddp(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
save_checkpoint(P, model, opt, 5)
good = [p.detach().clone() for p in model.parameters()]
"""


def _fails(c, code: str) -> str:
    result = c.run(code)
    assert not result.ok, code
    text = result.failed[0].failure().summary
    assert "\n" not in text.strip(), text  # one line
    return text


def test_bad_checkpoint_input_is_one_line_and_the_last_good_checkpoint_is_kept(tmp_path):
    path = str(tmp_path / "ckpt")
    with nbdist.start(2, timeout=60) as c:
        c.run(f"P = {path!r}\n{BAD}").raise_for_error()
        said = _fails(c, "save_checkpoint(P, model, opt, 6, state={'sched': [1, 2]})")
        assert "state['sched'] (a list) has no state_dict()/load_state_dict()" in said
        assert "keep (0) must be 1 or more" in _fails(c, "save_checkpoint(P, model, opt, 6, keep=0)")
        said = _fails(c, "save_checkpoint(P, model, opt, 6, extra={'run': {'cb': print}})")
        assert "extra['run']['cb'] (a builtin_function_or_method) is not a plain value" in said
        said = _fails(c, "m = torch.nn.Linear(3, 3)\nload_checkpoint(P, m, torch.optim.SGD(m.parameters()))")
        assert "does not load into this model, optimizer and state" in said
        said = _fails(
            c,
            "o = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "load_checkpoint(P, model, o, state={'sched': torch.optim.lr_scheduler.StepLR(o, 2)})",
        )
        assert "does not load into this model, optimizer and state" in said  # saved without a scheduler
        # a half-written save (a .partial folder) is never a step to load
        c.run("if dist.get_rank() == 0: os.makedirs(P + '/step-000000009.partial')").raise_for_error()
        said = _fails(c, "load_checkpoint(P, model, opt, step=9)")
        assert "checkpoint step 9 is not under" in said and "complete steps: [5]" in said
        # damage: a truncated rank file, a missing metadata file (in copies of step 5)
        c.run(
            "if dist.get_rank() == 0:\n"
            "    shutil.copytree(P + '/step-000000005', P + '/step-000000007')\n"
            "    open(P + '/step-000000007/rank-1.pt', 'wb').write(b'PK')\n"
            "    shutil.copytree(P + '/step-000000005', P + '/step-000000008')\n"
            "    os.remove(P + '/step-000000008/.metadata')"
        ).raise_for_error()
        said = _fails(c, "load_checkpoint(P, model, opt, step=7)")
        assert "rank-1.pt is unreadable" in said and "load another step" in said
        said = _fails(c, "load_checkpoint(P, model, opt, step=8)")
        assert "has no readable .metadata" in said and "load another step ([5, 7])" in said
        # none of it touched the last good checkpoint
        r = c.run(
            "step = load_checkpoint(P, model, opt)\nsame = all(torch.equal(a, b) for a, b in zip(good, model.parameters()))"
        )
        r.raise_for_error()
        assert c.pull("step") == [5, 5] and c.pull("same") == [True, True]
    with nbdist.start(1, timeout=60) as c:  # another world size
        c.run(f"P = {path!r}\n" + BAD.replace("save_checkpoint(P, model, opt, 5)", "")).raise_for_error()
        said = _fails(c, "load_checkpoint(P, model, opt)")
        assert "was saved by a world of 2 rank(s), and this one has 1" in said and "per_rank=False" in said
        c.run("step = load_checkpoint(P, model, opt, per_rank=False)").raise_for_error()
        assert c.pull("step") == [5]
