"""Start, restart, stop and the process-level faults (docs/faults.md, rows 4-7), each with its own cluster.

Time bounds here catch hangs only; benchmarks/faults.py measures how fast each drill is handled.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time

import psutil
import pytest
from IPython.core.error import UsageError

import nbdist
from nbdist.errors import ClusterError
from tests.helpers import run_cell, touch_code, wait_for, wait_gone


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def test_fault4_killed_rank_is_named_and_restart_brings_the_world_back(ip, tmp_path, capsys):
    before = _children()
    run_cell(ip, "%dist_start -n 2")
    cluster = nbdist.current()
    try:
        ckpt = tmp_path / "w.pt"
        cluster.push({"ckpt": str(ckpt)})
        run_cell(
            ip,
            "%%distributed\nw = torch.arange(4.0) + dist.get_rank()\nif dist.get_rank() == 0:\n    torch.save(w, ckpt)\ndist.barrier()",
        )
        old_engine = cluster.ranks[1].engine_id
        victim = cluster.ranks[1].pid

        here = tmp_path / "sleeping"
        killed_at: list[float] = []

        def kill():
            wait_for(here)  # rank 1 is about to sleep; rank 0 waits in all_reduce for it
            killed_at.append(time.perf_counter())
            os.kill(victim, signal.SIGKILL)

        threading.Thread(target=kill, daemon=True).start()
        r = cluster.run(
            "import time\nif dist.get_rank() == 0:\n    dist.all_reduce(torch.ones(1))\nelse:\n"
            f"    {touch_code(here, per_rank=False).strip()}\n    time.sleep(60)"
        )
        named_after = time.perf_counter() - killed_at[0]
        assert r[1].status == "dead"
        assert named_after < 30, f"the cell waited {named_after:.0f} s for a dead rank (rank 1 would sleep 60 s)"
        assert any("rank(s) 1 died; %dist_restart --ranks 1 brings them back" in n for n in r.notes), r.notes
        assert cluster.dead_ranks() == [1]
        with pytest.raises(Exception, match="rank 1 is dead; run %dist_restart --ranks 1 "):
            run_cell(ip, "%%distributed\n1")
        run_cell(ip, "%dist_status")
        assert "dead" in capsys.readouterr().out

        run_cell(ip, "%dist_restart")
        assert [r.rank for r in cluster.ranks] == [0, 1]
        assert cluster.ranks[1].engine_id != old_engine
        assert cluster.dead_ranks() == []
        cluster.push({"ckpt": str(ckpt)})
        run_cell(
            ip,
            "%%distributed\nw = torch.load(ckpt, weights_only=True)\ndist.all_reduce(w)\nafter = (dist.get_rank(), w.tolist())",
        )
        assert cluster.pull("after") == [(0, [0.0, 2.0, 4.0, 6.0]), (1, [0.0, 2.0, 4.0, 6.0])]
    finally:
        pids = cluster.pids()
        run_cell(ip, "%dist_stop")
    assert wait_gone(pids, 5) == []
    assert _children() - before == set(), "stop must leave no process behind"


KERNEL_CODE = """
import nbdist, nbdist.launch.pool, json
from nbdist.config import default_threads
nbdist.launch.pool.warm(3, default_threads(2))  # two serve the engines, one stays warm
c = nbdist.start(n=2)
print(json.dumps([c.pids() + nbdist.launch.pool.pids(), c.membership.workdir]))
"""


def test_fault5_engines_and_controller_end_with_the_kernel():
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3")
    outputs: list[dict] = []
    try:
        reply = kc.execute_interactive(KERNEL_CODE, timeout=120, output_hook=lambda m: outputs.append(m))
        assert reply["content"]["status"] == "ok"
        text = "".join(m["content"].get("text", "") for m in outputs if m["msg_type"] == "stream")
        pids, workdir = json.loads(text.strip().splitlines()[-1])
        assert len(pids) >= 5  # controller, its heart monitor, two engines, one warm process
        assert all(psutil.pid_exists(p) for p in pids)
        kernel_pid = km.provisioner.pid
        os.kill(kernel_pid, signal.SIGKILL)
        left = wait_gone(pids, 60)  # ipyparallel alone leaves them running for minutes
        assert left == [], f"processes outlived the kernel: {left}"
        assert not os.path.exists(workdir), "the controller removes the world's directory the kernel cannot"
    finally:
        kc.stop_channels()
        km.cleanup_resources()


def test_fault5_a_kernel_shut_down_as_a_page_shuts_it_down_ends_its_world_and_removes_its_directory():
    """The Jupyter server ends a kernel (a page's shutdown, a notebook run to its end) with a shutdown request: the
    kernel exits through its own exit hooks, not by a signal. The world ends with it as %dist_stop ends it, and
    its directory (transcripts, the ranks' steps, the controller's profile) goes too. The SIGKILL test above is the
    other way a kernel ends."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", env={**os.environ, "OMP_NUM_THREADS": "1"})
    outputs: list[dict] = []
    try:
        code = "import nbdist, json\nc = nbdist.start(n=2)\nprint(json.dumps([c.pids(), c.membership.workdir]))"
        reply = kc.execute_interactive(code, timeout=120, output_hook=lambda m: outputs.append(m))
        assert reply["content"]["status"] == "ok", reply["content"]
        text = "".join(m["content"].get("text", "") for m in outputs if m["msg_type"] == "stream")
        pids, workdir = json.loads(text.strip().splitlines()[-1])
        assert os.path.isdir(os.path.join(workdir, "profile")) and all(psutil.pid_exists(p) for p in pids)
        km.shutdown_kernel(now=False)  # what DELETE /api/kernels/<id> does
        assert wait_gone(pids, 60) == [], "processes outlived the kernel"
        assert not os.path.exists(workdir), f"the world's directory outlived the kernel: {os.listdir(workdir)}"
    finally:
        kc.stop_channels()
        if km.has_kernel:
            km.shutdown_kernel(now=True)
        km.cleanup_resources()


def test_fault6_taken_rendezvous_port_is_avoided(monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    monkeypatch.setenv("MASTER_PORT", str(port))  # what a user's environment might say
    try:
        with nbdist.start(n=2) as cluster:
            assert cluster.master_port not in (0, port)
            cluster.run("t = torch.ones(1)\ndist.all_reduce(t)\nv = t.item()").raise_for_error()
            assert cluster.pull("v") == [2.0, 2.0]
            assert cluster.pull("__import__('os').environ['MASTER_PORT']") == [str(cluster.master_port)] * 2
    finally:
        taken.close()


def test_fault7_missing_rank_is_named_within_the_start_timeout(tmp_path, monkeypatch):
    monkeypatch.setenv("NBDIST_FAULT_EXIT_ONE", str(tmp_path / "one-engine-fails"))
    before = _children()
    with pytest.raises(ClusterError) as info:
        nbdist.start(n=2, timeout=120)
    msg = str(info.value)
    assert "1 of 2 engine(s) did not start, so rank(s) 1 have no engine" in msg
    # reported because the engine exited, not because the start timeout ran out
    assert "1 engine process(es) exited while starting" in msg and "did not register within" not in msg
    assert wait_gone(list(_children() - before), 5) == []


def test_launchers_for_many_hosts_name_what_is_missing(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch, srun or mpiexec here
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(nbdist.ConfigError, match="--launcher slurm needs Slurm's sbatch"):
        nbdist.start(n=2, launcher="slurm")
    with pytest.raises(nbdist.ConfigError, match="SLURM_JOB_ID is not set"):
        nbdist.start(n=2, launcher="srun")
    with pytest.raises(nbdist.ConfigError, match="--launcher mpi needs mpiexec"):
        nbdist.start(n=2, launcher="mpi")


def test_a_slurm_that_refuses_the_job_is_quoted(monkeypatch, tmp_path):
    """sbatch is there but Slurm is not configured: its own words, not a CalledProcessError."""
    fake = tmp_path / "sbatch"
    fake.write_text("#!/bin/sh\necho 'sbatch: error: invalid partition specified: gpu' >&2\nexit 1\n")
    fake.chmod(0o755)
    for tool in ("squeue", "sinfo", "scancel"):
        (tmp_path / tool).symlink_to("/bin/true")
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    with pytest.raises(nbdist.ClusterError, match="sbatch refused the job: sbatch: error: invalid partition"):
        nbdist.start(n=2, launcher="slurm", ip="127.0.0.1", timeout=20)


def test_context_manager_stops_everything():
    before = _children()
    with nbdist.start(n=2) as cluster:
        pids = cluster.pids()
        assert len(pids) == 4  # controller, its forked heart monitor, two engines
        cluster.run("x = 1").raise_for_error()
    assert wait_gone(pids, 5) == []
    assert _children() - before == set()
    with pytest.raises(ClusterError, match="no cluster is running"):
        nbdist.current()


if sys.platform != "linux":  # pragma: no cover
    pytestmark = pytest.mark.skip("the fault drills use Linux process semantics")


def test_no_pin_leaves_every_core_to_every_rank():
    import os

    with nbdist.start(n=2, pin=False) as c:
        c.run("import os\nmine = sorted(os.sched_getaffinity(0))").raise_for_error()
        assert c.pull("mine") == [sorted(os.sched_getaffinity(0))] * 2
        assert [r["cpus"] for r in c.status()] == ["all", "all"]


def test_the_first_cell_run_again_keeps_the_world_and_another_start_asks_for_restart(ip, capsys):
    """The first cell (``%dist_start -n 2``) run again: the world and its variables are kept and it says so; a start
    of another shape changes nothing and names the difference and the two ways on; ``--restart`` replaces it."""
    run_cell(ip, "%dist_start -n 2")
    cluster = nbdist.current()
    try:
        pids = cluster.pids()
        run_cell(ip, "%%distributed\nmodel_weight = 40 + dist.get_rank()")
        capsys.readouterr()
        run_cell(ip, "%dist_start -n 2  # the first cell, run again")
        said = capsys.readouterr().out
        assert said.strip() == (
            "a world of 2 ranks runs already, started the same way: kept as it is (its ranks' variables too). "
            "%dist_start --restart replaces it; %dist_stop ends it."
        ), said
        assert nbdist.current() is cluster and cluster.pids() == pids
        assert cluster.pull("model_weight") == [40, 41]
        with pytest.raises(UsageError) as refused:
            run_cell(ip, "%dist_start -n 3 --oversubscribe")
        assert str(refused.value) == (
            "a world of 2 ranks runs already, started another way: -n 3 (running: 2), --oversubscribe True (running: "
            "False). Nothing was changed. `%dist_start -n 3 --oversubscribe --restart` replaces it (its ranks' "
            "variables are lost), or %dist_stop ends it first."
        )
        assert nbdist.current() is cluster and cluster.pull("model_weight") == [40, 41]
        run_cell(ip, "%dist_start -n 3 --oversubscribe --restart")
        assert "stopping the running world (2 ranks) first: --restart" in capsys.readouterr().out
        assert nbdist.current().world_size == 3 and wait_gone(pids, 30) == []
    finally:
        run_cell(ip, "%dist_stop")


# A rank's store connection: the port of rank 0's store, and which object in which process (a replaced rank forked
# from the same warm process may hold its new store at the address its predecessor's had).
STORE = (
    "(__import__('os').environ['MASTER_PORT'], __import__('os').getpid(), "
    "id(__import__('nbdist.engine.state', fromlist=['STATE']).STATE.store))"
)
SUM = "__import__('torch').distributed.all_reduce(t := __import__('torch').ones(1) * (dist.get_rank() + 1)) or t.item()"


def test_a_world_formed_again_keeps_its_store_and_connects_only_its_new_ranks():
    """A rebuilt group, a replaced rank: the ranks keep their connection to rank 0's store (a new prefix of keys
    each forming, so nothing of the last one is read); a new rank 0 opens a new store and every rank connects."""
    with nbdist.start(3, oversubscribe=True) as c:
        first = c.pull(STORE)
        c.rebuild_world()
        c.rebuild_world()  # twice: a forming that read the last one's keys would pair the ranks wrongly, or hang
        assert c.pull(STORE) == first
        c.restart([2])
        after = c.pull(STORE)
        assert after[:2] == first[:2] and after[2][0] == first[2][0], (first, after)
        assert c.pull(SUM) == [6.0] * 3
        hung = c.run("if dist.get_rank() == 0:\n    dist.barrier()", timeout=3)  # the release shuts the group on rank 0
        assert hung.released and c.pull(STORE) == after  # the store's connections were not the group's
        assert c.pull(SUM) == [6.0] * 3
        c.restart([0])
        moved = c.pull(STORE)
        assert len({port for port, _, _ in moved}) == 1 and moved[0][0] != first[0][0], (first, moved)
        assert all(m[1:] != a[1:] for m, a in zip(moved, after, strict=True)), (after, moved)
        assert c.pull(SUM) == [6.0] * 3
