"""torchrun parity: the ecosystem's own training code, unchanged, does on nbdist's ranks what it does
under torchrun.

Each script in ``scripts/`` is what the library's docs teach for a torchrun launch. The same text runs
three ways: under ``torchrun --nproc-per-node 2`` (the reference), pasted into a ``%%distributed`` cell,
and through ``%dist_run``; the final parameters of every rank must be ``torch.equal`` to torchrun's. Bit
equality is expected, not merely closeness: the same ranks run the same ops in the same order on the
same data, with the same gloo all-reduce over 2 ranks and one thread each, so any difference means
the run was not the same run (a rank trained alone, on other data, or with another world size).
Each script also records the world size the library itself saw.

Accelerate and the HF Trainer are written as users write them (``Accelerator()``, default
``TrainingArguments``); their references are the explicit CPU forms (``cpu=True``, ``use_cpu=True``)
under torchrun, which is what ``accelerate launch --cpu`` gives: on a CPU machine the plain forms
under torchrun do not go distributed at all.

After each run a collective must work in the next cell and ``WORLD_SIZE`` must still be set (the
libraries' teardown paths: Accelerate's ``end_training``, Lightning's environment teardown).
Times are bounded only to catch hangs.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from nbdist.errors import RankError
from tests.helpers import rank_said, run_cell
from tests.torchrun import torchrun

SCRIPTS = pathlib.Path(__file__).parent / "scripts"

# name -> (script, the reference's edit (under torchrun), the edit for nbdist's runs)
CASES = {
    "plain-ddp": ("plain_ddp.py", {}, {}),
    "accelerate": ("accelerate_loop.py", {"Accelerator()": "Accelerator(cpu=True)"}, {}),
    "fabric": ("fabric_loop.py", {}, {}),
    "lightning-trainer": ("lightning_trainer.py", {}, {}),
    "deepspeed-zero1": ("deepspeed_zero.py", {"STAGE = 2": "STAGE = 1"}, {"STAGE = 2": "STAGE = 1"}),
    "deepspeed-zero2": ("deepspeed_zero.py", {}, {}),
    "deepspeed-zero3": ("deepspeed_zero.py", {"STAGE = 2": "STAGE = 3"}, {"STAGE = 2": "STAGE = 3"}),
    "hf-trainer": ("hf_trainer.py", {"TrainingArguments(": "TrainingArguments(use_cpu=True, "}, {}),
}


def source(script: str, out: pathlib.Path, edits: dict[str, str]) -> str:
    text = (SCRIPTS / script).read_text()
    for old, new in {'"__OUT__"': repr(str(out)), **edits}.items():
        assert old in text, (script, old)
        text = text.replace(old, new)
    return text


def reference(script: str, tmp: pathlib.Path, edits: dict[str, str]) -> pathlib.Path:
    out = tmp / "torchrun"
    path = tmp / f"ref_{script}"
    path.write_text(source(script, out, edits))
    torchrun(str(path), cwd=str(tmp))
    return out


def assert_same_run(out: pathlib.Path, ref: pathlib.Path) -> None:
    """Every rank's final parameters equal torchrun's bit for bit; the library saw a world of 2."""
    for rank in (0, 1):
        mine, theirs = torch.load(f"{out}-rank{rank}.pt"), torch.load(f"{ref}-rank{rank}.pt")
        assert mine.keys() == theirs.keys()
        for name in theirs:
            assert torch.equal(mine[name], theirs[name]), (rank, name, (mine[name] - theirs[name]).abs().max())
        seen = json.loads(pathlib.Path(f"{out}-rank{rank}.json").read_text())
        assert seen == json.loads(pathlib.Path(f"{ref}-rank{rank}.json").read_text())
        assert seen["seen"] == 2, seen  # the library's own view of the world


@pytest.fixture(scope="module")
def world(ip):
    run_cell(ip, "%dist_start -n 2")
    try:
        yield ip
    finally:
        run_cell(ip, "%dist_stop")


def world_intact(shell, capsys) -> None:
    capsys.readouterr()
    run_cell(
        shell,
        "%%distributed\nimport os\nt = torch.ones(1)\ndist.all_reduce(t)\nprint(t.item(), os.environ['WORLD_SIZE'])",
    )
    out = capsys.readouterr().out
    assert rank_said(out, 0, "2.0 2") and rank_said(out, 1, "2.0 2"), out


@pytest.mark.parametrize("case", list(CASES))
def test_library_loop_in_a_cell_and_dist_run_equals_torchrun(world, case, tmp_path, capsys):
    script, ref_edits, edits = CASES[case]
    ref = reference(script, tmp_path, ref_edits)

    cell = tmp_path / "cell"
    run_cell(world, "%%distributed\n" + source(script, cell, edits))
    assert_same_run(cell, ref)
    world_intact(world, capsys)

    run = tmp_path / "dist_run"
    path = tmp_path / script
    path.write_text(source(script, run, edits))
    run_cell(world, f"%dist_run {path}")
    assert_same_run(run, ref)
    world_intact(world, capsys)


def test_every_rank_shows_torchruns_worker_environment_and_no_prompt(world, tmp_path):
    """The variables torchrun's agent gives a worker, with its values, in every rank from the start (not
    only under %dist_run); MASTER_PORT is the world's own, and the agent store is not claimed."""
    ref = reference("env_dump.py", tmp_path, {})
    out = tmp_path / "cell"
    run_cell(world, "%%distributed\n" + source("env_dump.py", out, {}))
    for rank in (0, 1):
        theirs = json.loads(pathlib.Path(f"{ref}-rank{rank}.json").read_text())
        mine = json.loads(pathlib.Path(f"{out}-rank{rank}.json").read_text())
        assert theirs["interactive"] is False and mine["interactive"] is False
        assert mine["torchelastic_launched"] is True
        # the agent's own: which signals the agent forwards (set in its environment, inherited), and the
        # file its @record writes a worker's error to (nbdist reports errors itself)
        agent_only = {"TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCHELASTIC_ERROR_FILE"}
        # the world's own port and id; a store of its own, not an agent's
        differ = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE"}
        assert agent_only | differ <= set(theirs) | {"TORCHELASTIC_ERROR_FILE"}  # torchrun still sets these
        for key, value in theirs.items():
            if key in agent_only:
                continue
            assert key in mine, key
            if key not in differ:
                assert mine[key] == value, (key, mine[key], value)
        assert mine["MASTER_PORT"] and mine["TORCHELASTIC_USE_AGENT_STORE"] == "False"


def test_lightning_notebook_strategies_run_on_the_world_without_forking(world, tmp_path, capsys):
    """strategy="ddp_notebook" / "ddp_spawn" / "auto" would fork or spawn 2 processes on every rank;
    they train on the world nbdist built, in this process, to torchrun's "ddp" result."""
    ref = reference("fabric_loop.py", tmp_path, {})
    for strategy in ("ddp_notebook", "ddp_spawn", "auto"):
        out = tmp_path / strategy
        # the notebook form of Fabric: the training function handed to launch(), which forks or spawns
        notebook = {
            'strategy="ddp"': f"strategy={strategy!r}",
            "    fabric.launch()\n    train(fabric)\n": "    fabric.launch(train)\n",
            "def train(fabric):\n": "def train(fabric):\n    assert os.getpid() == PID, 'a forked or spawned process'\n",
        }
        code = source("fabric_loop.py", out, notebook)
        capsys.readouterr()
        run_cell(world, "%%distributed\nimport os\nPID = os.getpid()\n" + code)
        assert_same_run(out, ref)
        said = capsys.readouterr().out
        if strategy != "auto":  # "auto" is plain "ddp" once the rank is not taken for a prompt
            assert said.count("runs on the world nbdist built instead (2 ranks)") == 1, said
    world_intact(world, capsys)

    (tmp_path / "trainer").mkdir()
    ref = reference("lightning_trainer.py", tmp_path / "trainer", {})
    spawn = tmp_path / "trainer" / "spawn"
    code = source("lightning_trainer.py", spawn, {'strategy="ddp"': 'strategy="ddp_spawn"'})
    run_cell(world, "%%distributed\n" + code)
    assert_same_run(spawn, ref)
    world_intact(world, capsys)


def test_the_restart_count_counts_and_libraries_still_run_after_a_restart(world, tmp_path, capsys):
    run_cell(world, "%dist_restart")
    capsys.readouterr()
    run_cell(world, "%%distributed\nimport os\nprint('count', os.environ['TORCHELASTIC_RESTART_COUNT'])")
    out = capsys.readouterr().out
    assert rank_said(out, 0, "count 1") and rank_said(out, 1, "count 1"), out
    ref = reference("fabric_loop.py", tmp_path, {})
    out_path = tmp_path / "after"
    run_cell(world, "%%distributed\n" + source("fabric_loop.py", out_path, {}))
    assert_same_run(out_path, ref)


def _one_line_error(world, code: str) -> str:
    with pytest.raises(RankError) as err:
        run_cell(world, "%%distributed\n" + code)
    text = str(err.value)
    first = [line for line in text.splitlines() if line.startswith("rank 0 ")][0]
    return first


def test_a_library_asked_for_another_world_fails_in_one_line_and_the_world_stays(world, capsys):
    fabric = "from lightning.fabric import Fabric\nf = Fabric(accelerator='cpu', devices=4, strategy='ddp')\nf.launch()"
    line = _one_line_error(world, fabric)
    assert "devices=4, num_nodes=1" in line and "nbdist's world has 2 ranks" in line and "%dist_start -n 4" in line
    world_intact(world, capsys)

    trainer = (
        "import lightning.pytorch as pl\nfrom lightning.pytorch.strategies import DDPStrategy\n"
        "pl.Trainer(accelerator='cpu', devices=2, strategy=DDPStrategy(process_group_backend='nccl'))"
    )
    line = _one_line_error(world, trainer)
    assert "process_group_backend='nccl'" in line and "this world runs gloo" in line
    assert "%dist_start --backend nccl" in line
    world_intact(world, capsys)

    line = _one_line_error(world, "import deepspeed\ndeepspeed.init_distributed(dist_backend='nccl')")
    assert "deepspeed.init_distributed(dist_backend='nccl')" in line and "this world runs gloo" in line
    world_intact(world, capsys)

    line = _one_line_error(
        world, "from accelerate import notebook_launcher\nnotebook_launcher(print, (), num_processes=2)"
    )
    assert "notebook_launcher starts processes of its own" in line and "call print(*args) directly" in line
    world_intact(world, capsys)
