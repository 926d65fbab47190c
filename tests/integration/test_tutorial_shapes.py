"""The launch shapes PyTorch's tutorials teach, run three ways on real 2-rank gloo worlds and compared.

Each program is written here in the tutorials' structure (the code is this project's): ``mp.spawn``
of a DDP function that sets MASTER_ADDR/PORT and calls ``init_process_group(rank=, world_size=)``;
the "Writing Distributed Applications" template that starts ``mp.Process(target=init_process)`` in a
loop after ``set_start_method("spawn")``; an FSDP2-shaped script whose ``__main__`` parses its
arguments and calls ``exit()`` when there are too few GPUs; calls of ``init_process_group`` that torch
refuses. Each runs as its authors run it (``python prog.py``, which starts its own processes, or
``torchrun``: the reference), with ``%dist_run``, and pasted unchanged into a ``%%distributed`` cell;
final weights are compared bit for bit (the same seeds, the same gloo reductions: no tolerance), and
a collective works after each. Then the bad input, one line each, with the world still usable.

Time bounds only catch hangs (HANG_S).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import nbdist
from nbdist.errors import RankError
from tests.helpers import free_port, rank_said, run_cell, stand_in_driver
from tests.torchrun import torchrun

HANG_S = 180

SPAWN_DDP = """
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

OUT = "OUT_PATH"


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def setup(rank, world_size):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = "PORT_NUMBER"
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def cleanup():
    dist.destroy_process_group()


def demo_basic(rank, world_size, steps):
    print(f"Running the basic DDP example on rank {rank}.")
    setup(rank, world_size)
    torch.manual_seed(0)
    ddp_model = DDP(ToyModel())
    loss_fn = nn.MSELoss()
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.01, momentum=0.9)
    data = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(20, 10, generator=data))
        loss_fn(outputs, torch.randn(20, 5, generator=data)).backward()
        optimizer.step()
    torch.save([p.detach() for p in ddp_model.parameters()], f"{OUT}-rank{rank}.pt")
    dist.barrier()  # no process exits before both have written (tests/torchrun.py)
    cleanup()
    print(f"Finished the basic DDP example on rank {rank}.")


def run_demo(demo_fn, world_size):
    mp.spawn(demo_fn, args=(world_size, 6), nprocs=world_size, join=True)


if __name__ == "__main__":
    world_size = 2
    run_demo(demo_basic, world_size)
"""

PROCESS_TEMPLATE = '''
"""run.py: a hand-written data-parallel SGD, gradients averaged with all_reduce."""
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

OUT = "OUT_PATH"


def average_gradients(model):
    size = float(dist.get_world_size())
    for param in model.parameters():
        dist.all_reduce(param.grad.data, op=dist.ReduceOp.SUM)
        param.grad.data /= size


def run(rank, size):
    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(rank)
    for epoch in range(4):
        x = torch.randn(16, 6, generator=data)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        loss.backward()
        average_gradients(model)
        optimizer.step()
    print(f"Rank {rank}, epoch {epoch}: loss {loss.item():.4f}")
    torch.save([p.detach() for p in model.parameters()], f"{OUT}-rank{rank}.pt")
    dist.barrier()  # no process exits before both have written (tests/torchrun.py)


def init_process(rank, size, fn, backend="gloo"):
    """Initialize the distributed environment."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = "PORT_NUMBER"
    dist.init_process_group(backend, rank=rank, world_size=size)
    fn(rank, size)


if __name__ == "__main__":
    world_size = 2
    processes = []
    mp.set_start_method("spawn")
    for rank in range(world_size):
        p = mp.Process(target=init_process, args=(rank, world_size, run))
        p.start()
        processes.append(p)
    for p in processes:
        p.join()
    print("exit codes", [p.exitcode for p in processes])
'''

EXIT_EARLY = """
import argparse
import os

import torch
import torch.distributed as dist

OUT = "OUT_PATH"


def main(args):
    dist.init_process_group(backend="nccl")
    open(f"{OUT}-rank{os.environ['RANK']}.trained", "w").close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="FSDP2-shaped example")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        print(f"this example needs 2 GPUs, found {torch.cuda.device_count()} ({args.epochs} epochs asked)")
        open(f"{OUT}-rank{os.environ['RANK']}.exited", "w").close()
        exit()
    main(args)
"""

# torch's checks before it forms a world, in torch's order; under torchrun the last one (device_id on a CPU
# rank) is refused after the rendezvous, so it comes last
REFUSALS = """
import datetime, json, os
import torch
import torch.distributed as dist

OUT = "OUT_PATH"
cases = {
    "init_method and store": dict(backend="gloo", init_method="env://", store=dist.HashStore(), world_size=2, rank=0),
    "store without world_size": dict(backend="gloo", store=dist.HashStore()),
    "device_id an int on CPU torch": dict(backend="gloo", device_id=0),
    "a backend torch does not know": dict(backend="glooo"),
    "timeout in seconds": dict(backend="gloo", timeout=30),
    "device_id the CPU": dict(backend="gloo", device_id=torch.device("cpu")),
}
said = {}
for name, kwargs in cases.items():
    try:
        dist.init_process_group(**kwargs)
        said[name] = "accepted"
    except Exception as exc:
        said[name] = f"{type(exc).__name__}: {exc}"
with open(f"{OUT}-rank{os.environ['RANK']}.json", "w") as fh:
    json.dump(said, fh)
"""


def _program(text: str, path, out) -> str:
    return text.replace("OUT_PATH", str(out)).replace("PORT_NUMBER", str(free_port()))


def _python(script, cwd) -> subprocess.CompletedProcess:
    """The reference for a program that starts its own processes: ``python prog.py``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    done = subprocess.run(
        [sys.executable, str(script)], cwd=cwd, env=env, capture_output=True, text=True, timeout=HANG_S
    )
    # torch 2.13's gloo now and then aborts a process at interpreter exit, after the program has finished and
    # destroyed its group (tests/torchrun.py says more): the results are written by then, and compared
    exit_abort = "terminate called without an active exception" in done.stderr
    assert done.returncode == 0 or exit_abort, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _weights(out) -> list[list[torch.Tensor]]:
    return [torch.load(f"{out}-rank{r}.pt") for r in (0, 1)]


def _same(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> bool:
    return all(torch.equal(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def _world_works(ip) -> None:
    """A collective on both ranks after the program: the world is up, the same ranks, the same size."""
    run_cell(ip, "%%distributed\n_t = torch.ones(1); dist.all_reduce(_t); _after = (_t.item(), dist.get_world_size())")
    assert nbdist.current().pull("_after") == [(2.0, 2), (2.0, 2)]


@pytest.fixture(scope="module")
def world(ip):
    run_cell(ip, "%dist_start -n 2")
    pids = [r.pid for r in nbdist.current().ranks]
    try:
        yield ip, pids
    finally:
        run_cell(ip, "%dist_stop")


FORKSERVER = {  # the same programs with forkserver, Python 3.14's default start method on Linux
    "mp.spawn": ("nprocs=world_size, join=True)", 'nprocs=world_size, join=True, start_method="forkserver")'),
    "mp.Process": ('mp.set_start_method("spawn")', 'mp.set_start_method("forkserver")'),
}


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
@pytest.mark.parametrize("shape", ["mp.spawn", "mp.Process"])
def test_a_program_that_starts_its_own_processes_runs_on_the_world_bit_for_bit(world, tmp_path, capsys, shape, method):
    ip, pids = world
    text = SPAWN_DDP if shape == "mp.spawn" else PROCESS_TEMPLATE
    if method == "forkserver":
        old, new = FORKSERVER[shape]
        assert text.count(old) == 1
        text = text.replace(old, new)
    outs = {way: tmp_path / way for way in ("python", "dist_run", "pasted")}
    ref = tmp_path / "ref.py"
    ref.write_text(_program(text, ref, outs["python"]))
    said = _python(ref, tmp_path).stdout
    reference = _weights(outs["python"])
    capsys.readouterr()

    script = tmp_path / "prog.py"
    script.write_text(_program(text, script, outs["dist_run"]))
    run_cell(ip, f"%dist_run {script}")
    out = capsys.readouterr().out
    assert _same(_weights(outs["dist_run"]), reference), shape
    assert out.count("kept the world nbdist built (2 ranks, gloo)") == 1, out
    _world_works(ip)

    pasted = _program(text, tmp_path / "cell", outs["pasted"])
    run_cell(ip, f"%%distributed\n{pasted}")
    out = capsys.readouterr().out
    assert _same(_weights(outs["pasted"]), reference), shape
    if shape == "mp.spawn":  # each rank ran demo_basic once, as its own process would have
        for rank in (0, 1):
            assert rank_said(out, rank, f"Running the basic DDP example on rank {rank}."), out
            assert f"Running the basic DDP example on rank {rank}." in said
    else:  # the parent's join loop saw its processes end well, as under python prog.py
        assert rank_said(out, 0, "exit codes [0, 0]") and rank_said(out, 1, "exit codes [0, 0]"), out
        assert re.search(r"exit codes \[(0|-6), (0|-6)\]", said), said  # -6: that exit-time abort
    _world_works(ip)
    # what fn set in os.environ went with it, as a child's environment does: the world's own port is back
    port = next(ln for ln in pasted.splitlines() if "MASTER_PORT" in ln).split('"')[-2]
    assert nbdist.current().pull("os.environ['MASTER_PORT']") != [port, port]
    assert [r.pid for r in nbdist.current().ranks] == pids  # the same processes all along


def test_exit_ends_the_code_not_the_rank_as_under_torchrun(world, tmp_path, capsys):
    ip, pids = world
    outs = {way: tmp_path / way for way in ("torchrun", "dist_run", "pasted")}
    ref = tmp_path / "ref.py"
    ref.write_text(_program(EXIT_EARLY, ref, outs["torchrun"]))
    said = torchrun(str(ref), cwd=str(tmp_path)).stdout  # status 0: exit() is a normal end
    assert "this example needs 2 GPUs, found 0 (2 epochs asked)" in said

    script = tmp_path / "prog.py"
    script.write_text(_program(EXIT_EARLY, script, outs["dist_run"]))
    run_cell(ip, f"%dist_run {script}")

    cell = nbdist.current().run(_program(EXIT_EARLY, script, outs["pasted"]))
    assert cell.ok and cell.exited == {0: 0, 1: 0}, cell  # status 0 on both ranks: success, and said
    assert "exited with status 0 at cell line 22" in repr(cell)
    for way in outs:  # every way ends at exit(): the branch ran, main() never did
        for rank in (0, 1):
            assert os.path.exists(f"{outs[way]}-rank{rank}.exited"), (way, rank)
            assert not os.path.exists(f"{outs[way]}-rank{rank}.trained"), (way, rank)
    # the magic says where the code ended, once for the world; the ranks live on
    run_cell(ip, f"%%distributed\n{_program(EXIT_EARLY, script, outs['pasted'])}")
    out = capsys.readouterr().out
    assert rank_said(out, 0, "this example needs 2 GPUs, found 0 (2 epochs asked)"), out
    assert rank_said(out, 1, "nbdist: the code exited with status 0 at cell line 22"), out
    _world_works(ip)
    assert [r.pid for r in nbdist.current().ranks] == pids


def test_what_torch_refuses_under_torchrun_is_refused_on_the_world_with_its_message(world, tmp_path):
    ip, _ = world
    outs = {way: tmp_path / way for way in ("torchrun", "dist_run", "pasted")}
    ref = tmp_path / "ref.py"
    ref.write_text(_program(REFUSALS, ref, outs["torchrun"]))
    torchrun(str(ref), cwd=str(tmp_path))
    script = tmp_path / "prog.py"
    script.write_text(_program(REFUSALS, script, outs["dist_run"]))
    run_cell(ip, f"%dist_run {script}")
    run_cell(ip, f"%%distributed\n{_program(REFUSALS, script, outs['pasted'])}")
    said = {way: [json.loads(open(f"{out}-rank{r}.json").read()) for r in (0, 1)] for way, out in outs.items()}
    reference = said["torchrun"][0]
    assert said["torchrun"][1] == reference and "accepted" not in reference.values(), reference
    assert reference["device_id the CPU"].startswith("ValueError: init_process_group device_id parameter must be")
    for way in ("dist_run", "pasted"):
        for rank in (0, 1):
            assert said[way][rank] == reference, (way, rank, said[way][rank])
    _world_works(ip)


def test_a_rank_that_exits_releases_the_ranks_waiting_for_it(world):
    ip, pids = world
    cell = "if dist.get_rank() == 1:\n    exit()\nt = torch.ones(1)\ndist.all_reduce(t)\n"
    result = nbdist.current().run(cell, timeout=HANG_S)
    assert result.exited == {1: 0} and str(result[1].status) == "ok", result
    assert str(result[0].status) == "interrupted" and str(result.released) == "exited", result
    assert any("waited in a collective" in n for n in result.notes), result.notes
    _world_works(ip)
    assert [r.pid for r in nbdist.current().ranks] == pids


def test_children_a_cell_starts_keep_working_and_one_that_fails_fails_the_cell(world, tmp_path, capsys):
    ip, pids = world
    # DataLoader workers: the loader's own processes, untouched
    run_cell(
        ip,
        "%%distributed\nfrom torch.utils.data import DataLoader, TensorDataset\n"
        "_dl = DataLoader(TensorDataset(torch.arange(16.)), batch_size=4, num_workers=2)\n"
        "_total = sum(b[0].sum().item() for b in _dl)",
    )
    assert nbdist.current().pull("_total") == [120.0, 120.0]
    # a process of the cell's own that joins no process group is a real child
    done = tmp_path / "child"
    run_cell(
        ip,
        "%%distributed\nimport multiprocessing, os\n"
        f"def _write(rank):\n    open({str(done)!r} + f'-{{rank}}-{{os.getpid()}}', 'w').close()\n"
        "_p = multiprocessing.Process(target=_write, args=(dist.get_rank(),)); _p.start(); _p.join()\n"
        "_child = (_p.pid, _p.exitcode)",
    )
    for rank, (pid, code) in enumerate(nbdist.current().pull("_child")):
        assert code == 0 and pid not in pids and os.path.exists(f"{done}-{rank}-{pid}")
    # ... and one that fails fails the cell, named, though the cell's own code went on
    with pytest.raises(RankError) as err:
        run_cell(
            ip,
            "%%distributed\nimport multiprocessing\n"
            "def _bad():\n    raise SystemExit(4)\n"
            "_q = multiprocessing.Process(target=_bad); _q.start(); _q.join(); print('joined', _q.exitcode)",
        )
    text = str(err.value)
    assert "raised ChildProcessError" in text and "that this cell started exited with status 4" in text, text
    assert rank_said(capsys.readouterr().out, 0, "joined 4")
    # what a child printed is shown, under a line naming it; a child whose joining nbdist cannot see in its
    # code (looked up by name) is refused at once, not left to hang in the world its rank is in (or to use the
    # rank's sockets), and the refusal is the cell's error
    with pytest.raises(RankError, match="that this cell started exited with status 1: RuntimeError: init_process_g"):
        run_cell(
            ip,
            "%%distributed\nimport multiprocessing\n"
            "def _sneaky():\n    print('child here')\n    getattr(dist, 'init_process_group')('gloo')\n"
            "_s = multiprocessing.Process(target=_sneaky); _s.start(); _s.join(timeout=60); print('alive', _s.is_alive())",
        )
    out = capsys.readouterr().out
    assert rank_said(out, 0, "alive False") and rank_said(out, 1, "child here"), out
    assert "its children cannot join it. Call the process's target in the cell instead" in out
    _world_works(ip)


CHILD = """
import multiprocessing, os, sys


def work(path):
    open(path, "w").write(str(os.getpid()))


if __name__ == "__main__":
    p = multiprocessing.get_context("forkserver").Process(target=work, args=(sys.argv[1] + os.environ.get("RANK", ""),))
    p.start()
    p.join()
    print("child exit code", p.exitcode)
"""


def test_a_process_started_with_forkserver_finds_a_scripts_function_and_a_cells_is_refused_in_one_line(
    world, tmp_path, capsys
):
    """Python 3.14 starts processes with forkserver: the child imports the main module to find its target.
    ``python prog.py`` and ``%dist_run prog.py`` both work (the child imports prog.py); a function defined in a
    cell has no module a new process could import, so its start is refused in one line naming the fix (in a plain
    kernel the child dies with an AttributeError printed to the server's terminal, and the notebook shows nothing)."""
    ip, pids = world
    script = tmp_path / "prog.py"
    script.write_text(CHILD)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "python")], capture_output=True, text=True, timeout=HANG_S
    )
    assert "child exit code 0" in done.stdout and (tmp_path / "python").exists(), done.stdout + done.stderr
    capsys.readouterr()
    run_cell(ip, f"%dist_run {script} {tmp_path / 'dist_run'}")
    out = capsys.readouterr().out
    assert rank_said(out, 0, "child exit code 0") and rank_said(out, 1, "child exit code 0"), out
    for rank in (0, 1):
        child = int((tmp_path / f"dist_run{rank}").read_text())
        assert child not in pids
    with pytest.raises(RankError) as err:
        run_cell(
            ip,
            "%%distributed\n"
            + CHILD.replace('if __name__ == "__main__":', "if True:").replace(
                "sys.argv[1]", repr(str(tmp_path / "cell"))
            ),
        )
    lines = str(err.value).splitlines()
    assert len(lines) == 2 and all(f"rank {r} " in ln for r, ln in enumerate(lines)), lines
    assert "Process(target=work) starts with 'forkserver': the new process finds work by importing" in lines[0]
    assert "Put work in a .py file beside the notebook and import it from there" in lines[0], lines[0]
    assert not list(tmp_path.glob("cell*"))
    _world_works(ip)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to build a stand-in driver library")
def test_a_child_forked_after_the_gpu_driver_loaded_says_torchs_spawn_error_and_dataloaders_still_fork(world, tmp_path):
    """pytorch/pytorch#190708: a rank that asked the GPU by a path torch does not mark (its driver loaded,
    torch.cuda.is_initialized() False) forks a child; using CUDA there died with 'CUDA error: initialization
    error'. The child is marked as torch marks a CUDA process's children: torch's own one-line error naming the
    'spawn' start method. The rank may still fork: a DataLoader's workers load as before. Here a library named
    as NVIDIA's driver is built and loaded on the ranks (no GPU); the GPU tier does it with the real call."""
    ip, pids = world
    lib = stand_in_driver(tmp_path)
    use_cuda = (
        "%%distributed\nimport multiprocessing\n"
        "def _use_gpu():\n    torch.zeros(1, device='cuda')\n"
        "_g = multiprocessing.get_context('fork').Process(target=_use_gpu); _g.start(); _g.join()"
    )
    with pytest.raises(RankError) as err:  # before the driver is loaded: CPU torch's own answer
        run_cell(ip, use_cuda)
    if torch.version.cuda is None:  # a CUDA build marks the fork itself once a rank asked torch.cuda.is_available()
        assert "Torch not compiled with CUDA enabled" in str(err.value), str(err.value)
    run_cell(ip, f"%%distributed\nimport ctypes\n_drv = ctypes.CDLL({lib!r}); _drv.cuInit(0)")
    with pytest.raises(RankError) as err:
        run_cell(ip, use_cuda)
    lines = str(err.value).splitlines()
    assert len(lines) == 2, lines
    for line in lines:
        assert "Cannot re-initialize CUDA in forked subprocess" in line and "'spawn' start method" in line, line
    run_cell(
        ip,
        "%%distributed\nfrom torch.utils.data import DataLoader, TensorDataset\n"
        "_total = sum(b[0].sum().item() for b in DataLoader(TensorDataset(torch.arange(8.)), batch_size=2, num_workers=2))",
    )
    assert nbdist.current().pull("_total") == [28.0, 28.0]
    _world_works(ip)
    assert [r.pid for r in nbdist.current().ranks] == pids


def test_bad_input_is_one_line_naming_the_value_and_the_fix_and_the_world_stays(world):
    ip, pids = world
    run_cell(ip, "%%distributed\nimport torch.multiprocessing as mp\ndef _fn(rank, x):\n    return None\n")
    cases = {
        "mp.spawn(_fn, args=(1,), nprocs=4)": "would start 4 processes on each rank, but this world has 2 ranks",
        "mp.spawn(_fn, args=(1,), nprocs=2, join=False)": "with join=False hands back processes",
        "mp.start_processes(_fn, args=(1,), nprocs=2, start_method='thread')": "start_method='thread' is not one",
        "mp.spawn(lambda rank, x: None, args=(1,), nprocs=2)": "<lambda> cannot be pickled",
        "mp.set_start_method('threads')": "start_method='threads' is not one this platform has",
        "exit('bad config')": "the code exited with message 'bad config' at cell line 1 (status 1",
        "exit(3.5)": "exit(3.5) at cell line 1: float is not a status, so Python counts it as status 1",
        "import sys; sys.exit(3)": "the code exited with status 3 at cell line 1",
    }
    for code, expected in cases.items():
        with pytest.raises(RankError) as err:
            run_cell(ip, f"%%distributed\n{code}")
        lines = str(err.value).splitlines()
        assert len(lines) == 2 and all(
            ln.startswith(f"rank {r} ") and "(engine" not in ln for r, ln in enumerate(lines)
        ), lines
        assert expected in lines[0], (code, lines[0])
    # argparse in a cell sees no engine arguments (parse_args() of a parser with defaults works); a required
    # argument missing says why and the fix
    run_cell(ip, "%%distributed\nimport argparse, sys\n_a = (vars(argparse.ArgumentParser().parse_args()), sys.argv)")
    assert nbdist.current().pull("_a") == [({}, ["<cell>"])] * 2
    with pytest.raises(RankError, match=r"a cell has no command line \(sys.argv is \['<cell>'\]\); pass the"):
        run_cell(
            ip,
            "%%distributed\nimport argparse\n_p = argparse.ArgumentParser()\n_p.add_argument('--steps', required=True)\n_p.parse_args()",
        )
    # set_start_method on the world: checked, and the rank's own method (fork) left for its DataLoaders
    run_cell(
        ip, "%%distributed\nmp.set_start_method('spawn')\nmp.set_start_method('spawn')\n_m = mp.get_start_method()"
    )
    assert nbdist.current().pull("_m") == ["fork", "fork"]
    # an exception in fn fails the cell with fn's own traceback
    with pytest.raises(RankError, match=r"raised ZeroDivisionError") as err:
        run_cell(ip, "%%distributed\ndef _boom(rank):\n    return 1 / 0\nmp.spawn(_boom, nprocs=2)")
    assert any("1 / 0" in line for f in err.value.failures for line in f.traceback)
    _world_works(ip)
    assert [r.pid for r in nbdist.current().ranks] == pids
