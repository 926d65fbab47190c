"""Ways in and out of the notebook, on real 2-rank gloo clusters and real torchrun.

* ``%dist_run script.py args``: a torchrun script, unchanged, ends with the same parameters
  under nbdist as under torchrun itself; its own init/destroy_process_group keep the world,
  which the next cell uses; an incompatible request fails naming the values and the fix;
  its errors name the script's line; bad paths and syntax errors are said once, here;
* tutorial code pasted into a ``%%distributed`` cell may call init_process_group;
* ``%dist_export``: a session's DDP training (setup cells, a %%rank cell) written as a script
  that torchrun runs to the same final parameters as the notebook did, bit for bit.

Times are bounded only to catch hangs (HANG_S).
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from IPython.core.error import UsageError

from nbdist.errors import RankError
from nbdist.results import ANSI
from tests.helpers import rank_said, run_cell
from tests.torchrun import torchrun as _torchrun

HANG_S = 180

SCRIPT = textwrap.dedent(
    """
    import argparse, json, os, sys
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "ROLE_RANK",
           "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT")


    def main():
        parser = argparse.ArgumentParser()
        parser.add_argument("--steps", type=int, required=True)
        parser.add_argument("--out", required=True)
        args = parser.parse_args()
        dist.init_process_group("gloo", init_method="env://")
        rank = dist.get_rank()
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(100 + rank)
        for _ in range(args.steps):
            x = torch.randn(16, 8, generator=g)
            loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
            opt.zero_grad()
            loss.backward()
            opt.step()
        final = torch.cat([p.detach().flatten() for p in model.parameters()])
        torch.save(final, f"{args.out}-rank{rank}.pt")
        with open(f"{args.out}-rank{rank}.json", "w") as fh:
            json.dump({"name": __name__, "argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in ENV}}, fh)
        print(f"trained {args.steps} steps, loss {loss.item():.4f}")
        dist.destroy_process_group()
        return 0


    if __name__ == "__main__":
        sys.exit(main())
    """
)


@pytest.fixture
def session(ip):
    run_cell(ip, "%dist_start -n 2")
    try:
        yield ip
    finally:
        run_cell(ip, "%dist_stop")


def test_dist_run_runs_a_torchrun_script_unchanged_and_the_world_stays_up(session, tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    ref = tmp_path / "torchrun"
    _torchrun(str(script), "--steps", "12", "--out", str(ref), cwd=str(tmp_path))
    capsys.readouterr()

    mine = tmp_path / "nbdist"
    run_cell(session, f"%dist_run {script} --steps 12 --out {mine}")
    out = capsys.readouterr().out
    assert out.count("kept the world nbdist built (2 ranks, gloo)") == 1  # one line, from rank 0
    assert out.count("left the world up for the next cell") == 1
    assert rank_said(out, 0, "trained 12 steps") and rank_said(out, 1, "trained 12 steps"), out
    for rank in (0, 1):
        # the same script, the same data: the same parameters as under torchrun, bit for bit
        assert torch.equal(torch.load(f"{mine}-rank{rank}.pt"), torch.load(f"{ref}-rank{rank}.pt")), rank
        import json

        seen = json.loads(open(f"{mine}-rank{rank}.json").read())
        theirs = json.loads(open(f"{ref}-rank{rank}.json").read())
        assert seen["name"] == "__main__" and seen["argv"] == ["--steps", "12", "--out", str(mine)]
        for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "ROLE_RANK", "GROUP_RANK"):
            assert seen["env"][k] == theirs["env"][k], k
        assert seen["env"]["MASTER_PORT"] and seen["env"]["TORCHELASTIC_RESTART_COUNT"] == "0"

    # the world the script "destroyed" serves the next cell; the script's globals are there too
    run_cell(session, "%%distributed\nx = torch.ones(1); dist.all_reduce(x); print('sum', x.item(), callable(main))")
    out = capsys.readouterr().out
    assert rank_said(out, 0, "sum 2.0 True") and rank_said(out, 1, "sum 2.0 True"), out


def test_dist_run_errors_name_the_script_line_or_the_fix(session, tmp_path, capsys):
    bad = tmp_path / "crash.py"
    bad.write_text("import torch.distributed as dist\n\ndef step():\n    raise ValueError('bad batch')\n\nstep()\n")
    with pytest.raises(RankError) as err:
        run_cell(session, f"%dist_run {bad}")
    assert "rank 0 raised ValueError in crash.py line 4: bad batch" in str(err.value)

    # argparse's exit: its usage on stderr, the status in the error; sys.exit(0) is success
    (tmp_path / "args.py").write_text("import argparse\nargparse.ArgumentParser().parse_args()\n")
    with pytest.raises(RankError, match="raised RuntimeError: args.py exited with status 2"):
        run_cell(session, f"%dist_run {tmp_path / 'args.py'} --nope")
    assert rank_said(ANSI.sub("", capsys.readouterr().err), 1, "args.py: error: unrecognized arguments: --nope")
    (tmp_path / "done.py").write_text("import sys\nprint('bye')\nsys.exit(0)\n")
    run_cell(session, f"%dist_run {tmp_path / 'done.py'}")

    # said once, in the notebook, before any rank runs anything
    with pytest.raises(UsageError, match=r"crsh.py' is not a file .*did you mean 'crash.py'\?"):
        run_cell(session, f"%dist_run {tmp_path / 'crsh.py'}")
    (tmp_path / "typo.py").write_text("x = (1,\n")
    with pytest.raises(UsageError, match=r"typo.py line 1: .*fix the script"):
        run_cell(session, f"%dist_run {tmp_path / 'typo.py'}")
    with pytest.raises(UsageError, match="name the script"):
        run_cell(session, "%dist_run --quiet")

    # incompatible requests: the values and the fix; the world is untouched
    (tmp_path / "nccl.py").write_text("import torch.distributed as dist\ndist.init_process_group('nccl')\n")
    with pytest.raises(RankError) as err:
        run_cell(session, f"%dist_run {tmp_path / 'nccl.py'}")
    text = str(err.value)
    assert "init_process_group('nccl') asks for nccl, but this world runs gloo" in text
    assert "Drop the backend argument (or pass 'gloo')" in text and "%dist_start --backend nccl" in text
    with pytest.raises(RankError, match=r"asks for world_size=4, but this rank is rank \d of a world of 2"):
        run_cell(session, "%%distributed\ndist.init_process_group('gloo', world_size=4, rank=dist.get_rank())")
    capsys.readouterr()
    # pasted tutorial code: its init returns the world; a subgroup's destroy is torch's own
    run_cell(
        session,
        "%%distributed\nimport torch.distributed as dist\n"
        "dist.init_process_group(backend='gloo')\n"
        "g = dist.new_group([0, 1]); y = torch.ones(1); dist.all_reduce(y, group=g)\n"
        "dist.destroy_process_group(g)\nprint('y', y.item(), dist.is_initialized())",
    )
    out = capsys.readouterr().out
    assert out.count("init_process_group('gloo') kept the world") == 1 and "left the world up" not in out
    assert rank_said(out, 1, "y 2.0 True"), out


EXPORT_SETUP = """%%distributed --setup
import torch, nbdist
from nbdist.parallel import apply_ddp, shard
torch.manual_seed(0)
model = apply_ddp(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
X = torch.randn(256, 8, generator=torch.Generator().manual_seed(1))
loader = shard(torch.utils.data.TensorDataset(X, X.sum(1, keepdim=True)), batch_size=8, seed=3)
"""
EXPORT_TRAIN = """%%distributed
for step, (x, y) in loader.steps(30):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    nbdist.log(step=step, loss=loss.item())
final = torch.cat([p.detach().flatten() for p in model.parameters()])
"""


def test_dist_export_writes_a_script_torchrun_runs_to_the_notebooks_result(session, tmp_path, capsys):
    out = tmp_path / "final.pt"
    run_cell(session, EXPORT_SETUP)
    run_cell(session, "%%distributed\nprint(torch.__version__)")  # a plain cell: exported too, harmless
    run_cell(session, EXPORT_TRAIN)
    run_cell(session, f"%%rank 0\ntorch.save(final, {str(out)!r})")
    notebook = torch.load(out)
    pulled = session.run_line_magic("dist_pull", "final")
    assert torch.equal(pulled[0], notebook) and torch.equal(pulled[1], notebook)  # DDP: one model
    out.unlink()

    capsys.readouterr()
    run_cell(session, "%dist_export --list")
    listing = capsys.readouterr().out
    assert "  1 (setup) ranks 0,1: import torch, nbdist" in listing and "  4 ranks 0: torch.save(final" in listing
    run_cell(session, f"%dist_export {tmp_path / 'train.py'}")
    said = capsys.readouterr().out
    assert "wrote" in said and "(4 cell(s)) and train.sbatch" in said and "torchrun --nproc-per-node 2 train.py" in said
    script = (tmp_path / "train.py").read_text()
    assert "if dist.get_rank() in (0,):\n    torch.save(final" in script  # the %%rank cell, guarded
    compile(script, "train.py", "exec")
    sbatch = (tmp_path / "train.sbatch").read_text()
    assert (
        "srun --ntasks-per-node=1" in sbatch and "--nproc-per-node=2" in sbatch and "MASTER_ADDR=$(scontrol" in sbatch
    )

    _torchrun("train.py", cwd=str(tmp_path))
    assert torch.equal(torch.load(out), notebook)  # the same training, bit for bit

    # a second export replaces its own files; a file nbdist did not write is kept, with the fix said
    run_cell(session, f"%dist_export {tmp_path / 'train.py'} --cells 1,3")
    (tmp_path / "mine.py").write_text("print('my own work')\n")
    with pytest.raises(UsageError, match="mine.py exists and was not written by %dist_export; choose another"):
        run_cell(session, f"%dist_export {tmp_path / 'mine.py'}")
    assert (tmp_path / "mine.py").read_text() == "print('my own work')\n"
    with pytest.raises(UsageError, match=r"--cells '2-9': '2-9' is not a cell number or range within 1-4"):
        run_cell(session, f"%dist_export {tmp_path / 'train.py'} --cells 2-9")
    run_cell(session, "%%distributed\n%time x = 1")
    with pytest.raises(UsageError, match=r"cell 5 line 1 \('%time x = 1'\) is IPython syntax a script cannot run"):
        run_cell(session, f"%dist_export {tmp_path / 'train.py'}")
