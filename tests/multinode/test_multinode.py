"""Ranks on two hosts: a real Slurm with two slurmd in their own network namespaces (tests/slurmnodes.py).

Every test ends the clusters and jobs it starts; the ``slurm`` fixture fails a test that
leaves a job in the queue. Times are bounded only to catch hangs (HANG_S).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import nbdist
from nbdist.errors import ClusterError, RankError
from tests import trackers
from tests.helpers import check_ddp_against_one_process, poll, run_cell, touch_code, wait_for, wait_gone
from tests.slurmnodes import HOST_ADDR, NODES, UNROUTED
from tests.sockets import listening, outside, tree

HANG_S = 120
START_64_S = 420  # 64 engines importing torch at once on 2 cores: 2-4 minutes here (237 s of test in a CI run)
PY = sys.executable
REPORT = textwrap.dedent(
    """
    import os, socket
    x = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(x)
    env = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "SLURM_PROCID",
                                          "SLURM_LOCALID", "SLURM_NODEID", "GLOO_SOCKET_IFNAME")}
    report = dict(env, host=socket.gethostname(), total=x.item())
    """
)


def check_listens_only_where_the_nodes_meet(cluster: nbdist.Cluster) -> None:
    """Every socket the controller, the engines and their nannies listen on is on the bridge the nodes
    share (or loopback): none on a wildcard address (issue 31). Rank 0's store among them."""
    import psutil

    nannies = [psutil.Process(r.pid).ppid() for r in cluster.ranks]
    sockets = listening(tree(*cluster.pids(), *nannies))
    wrong = outside(sockets, {HOST_ADDR, *NODES.values(), "127.0.0.1"})
    assert not wrong, f"listening beyond the nodes' bridge: {wrong}"
    owners = {pid for _, _, pid, _ in sockets}
    assert {r.pid for r in cluster.ranks} <= owners, f"a rank listens on nothing: {sockets}"
    store = (cluster.master_addr, cluster.master_port, cluster.ranks[0].pid, "tcp")
    assert store in sockets, f"rank 0's store is not on {cluster.master_addr}:{cluster.master_port}: {sockets}"


def test_slurm_launcher_puts_ranks_on_two_nodes_and_trains_like_one_process(ip, slurm, capsys):
    run_cell(ip, "%dist_start --launcher slurm -n 2 --nodes 2 --timeout 90")
    cluster = nbdist.current()
    try:
        out = capsys.readouterr().out
        assert "2 ranks ready on 2 hosts (node1, node2)" in out
        jobs = cluster.engines.job_ids()
        assert len(jobs) == 1 and slurm.jobs() == jobs
        engine_pids = [r.pid for r in cluster.ranks]

        cluster.run(REPORT, quiet=True).raise_for_error()
        reports = cluster.pull("report")
        assert {r["host"] for r in reports} == set(NODES), "one rank per node"
        for rank, rep in enumerate(reports):
            assert rep["total"] == 3.0  # 1 + 2
            # torch's rank is Slurm's task id, not the order engines registered in
            assert rep["RANK"] == rep["SLURM_PROCID"] == str(rank)
            assert rep["LOCAL_RANK"] == rep["SLURM_LOCALID"] == "0"
            assert rep["NODE_RANK"] == rep["SLURM_NODEID"]
            # rank 0's address as the other node reaches it, and gloo on the interface that gets there
            assert rep["MASTER_ADDR"] == NODES[reports[0]["host"]]
            assert rep["GLOO_SOCKET_IFNAME"] == "eth0"
        check_listens_only_where_the_nodes_meet(cluster)

        check_ddp_against_one_process(cluster)

        run_cell(ip, "%dist_status")
        status = capsys.readouterr().out
        assert "node1" in status and "node2" in status

        # One rank raises while the other waits in a collective on the other host: released, named.
        code = "if dist.get_rank() == 1:\n    raise ValueError('bad batch')\ndist.all_reduce(torch.ones(1))"
        tic = time.monotonic()
        with pytest.raises(RankError) as info:
            cluster.run(code).raise_for_error()
        assert time.monotonic() - tic < HANG_S
        host1 = reports[1]["host"]
        assert f"rank 1 (on {host1}) raised ValueError" in str(info.value)
        cluster.run("dist.all_reduce(torch.ones(1))").raise_for_error()  # the world works again

        # Ctrl-C while both ranks, on two hosts, block in mismatched collectives: both released.
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
        tic = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            cluster.run("if dist.get_rank() == 0:\n    dist.all_reduce(torch.ones(1))\nelse:\n    dist.barrier()")
        assert time.monotonic() - tic < HANG_S
        assert cluster.dead_ranks() == []
        cluster.run("dist.all_reduce(torch.ones(1))").raise_for_error()
    finally:
        run_cell(ip, "%dist_stop")
    assert f"cancelled Slurm job(s) {jobs[0]}" in capsys.readouterr().out
    assert slurm.wait_empty(30) == []
    assert wait_gone(engine_pids, 30) == [], "no engine may outlive %dist_stop"
    assert not os.path.exists("slurm_engine.sbatch"), "the batch script stays in the cluster's directory"


def test_a_world_on_two_slurm_nodes_is_one_run_in_each_tracker(ip, slurm, tmp_path, monkeypatch):
    """Ranks on node1 and node2, tracked by each tracker in turn (%dist_track KIND, a cell run twice, %dist_track
    off): one run each, written from the notebook, every rank's steps once each and in order, the world's the mean.
    (The shrink and the grow of a two-node world, tracked: the lost-node test below.)"""
    monkeypatch.setenv("WANDB_MODE", "offline")
    log = "%%distributed\nimport nbdist\nfor step in range(10):\n    nbdist.log(step=step, loss=float(dist.get_rank() * 100 + step))"
    run_cell(ip, "%dist_start --launcher slurm -n 2 --nodes 2 --timeout 90")
    try:
        assert sorted(r.host for r in nbdist.current().ranks) == ["node1", "node2"]
        for kind in trackers.KINDS:
            for cell in (f"%dist_track {kind} nodes {trackers.flags(kind, tmp_path / kind)}", log, log, "%dist_track off"):
                run_cell(ip, cell)
    finally:
        run_cell(ip, "%dist_stop")
    assert slurm.wait_empty(30) == []
    for kind in trackers.KINDS:
        got = trackers.read(kind, tmp_path / kind, "nodes")
        assert got["runs"] == 1, kind
        for rank in (0, 1):
            assert got[f"rank{rank}/loss"] == [(s, float(rank * 100 + s % 10)) for s in range(20)], (kind, rank)
        assert got["loss"] == [(s, 50.0 + s % 10) for s in range(20)], kind
        assert got["world/size"] == [(0, 2.0)] and got["cells"] == [0, 10], (kind, got["world/size"], got["cells"])
        assert got["params"]["launcher"] == "slurm" and got["params"]["nodes"] in (2, "2"), (kind, got["params"])


def test_a_rank_killed_on_node2_is_named_with_its_host_and_restarts_through_slurm(ip, slurm, tmp_path):
    run_cell(ip, "%dist_start --launcher slurm -n 2 --nodes 2 --timeout 90")
    cluster = nbdist.current()
    try:
        victim = next(r for r in cluster.ranks if r.host == "node2")
        here = tmp_path / "sleeping"
        pending = cluster.run(
            f"import time\nif dist.get_rank() == {victim.rank}:\n    {touch_code(here, per_rank=False).strip()}\n"
            "    time.sleep(60)\ndist.all_reduce(torch.ones(1))",
            block=False,
        )
        wait_for(here)  # the victim is in its cell (the nodes share this filesystem)
        os.kill(victim.pid, signal.SIGKILL)  # kill -9 on node2 (the namespaces share one pid space)
        tic = time.monotonic()
        result = pending.wait(show=False)
        assert time.monotonic() - tic < HANG_S
        with pytest.raises(RankError) as info:
            result.raise_for_error()
        assert f"rank {victim.rank} (on node2) died" in str(info.value)

        run_cell(ip, f"%dist_restart --ranks {victim.rank}")
        assert len(cluster.engines.job_ids()) == 2, "the restarted rank comes from a new job of the same launcher"
        cluster.run(REPORT, quiet=True).raise_for_error()
        assert [r["total"] for r in cluster.pull("report")] == [3.0, 3.0]
        check_listens_only_where_the_nodes_meet(cluster)
    finally:
        run_cell(ip, "%dist_stop")
    assert slurm.wait_empty(30) == []


def _kernel_in_allocation(slurm, tmp_path, salloc: list[str], body: str) -> tuple[dict, str]:
    """Run an IPython kernel in a one-task step of a new allocation (as batchspawner runs the notebook):
    %load_ext nbdist, %dist_start with no arguments, then ``body`` (which sets ``result``), then %dist_stop.
    Returns (result, what the kernel printed)."""
    script = tmp_path / "kernel.ipy"
    lines = ["%load_ext nbdist", "%dist_start --timeout 90", "import json, nbdist", "c = nbdist.current()"]
    lines += [*textwrap.dedent(body).strip().splitlines(), 'print("RESULT", json.dumps(result))', "%dist_stop"]
    script.write_text("\n".join(lines) + "\n")
    ipython = [PY, "-m", "IPython", "--quick", "--no-banner", "--colors=nocolor", str(script)]
    done = slurm.run("salloc", *salloc, "srun", "-N1", "-n1", *ipython, check=False, timeout=HANG_S)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), "")
    assert line, f"no result: {done.stdout[-2000:]} {done.stderr[-2000:]}"
    return json.loads(line[len("RESULT ") :]), done.stdout


def test_inside_an_allocation_dist_start_uses_it_through_srun_overlap(slurm, tmp_path):
    """The kernel runs in a step of a 2-node allocation (as batchspawner runs it), so a plain srun would
    queue behind it forever; %dist_start with no -n must use the allocation through srun --overlap."""
    body = """
        args = [el.args for el in c.engines._ipp.engines.values()][0]
        c.run("x = torch.ones(1); dist.all_reduce(x); import socket; host = socket.gethostname()").raise_for_error()
        result = {"hosts": c.pull("host"), "sums": [t.item() for t in c.pull("x")], "launcher": c.config.launcher,
                  "args": args}
    """
    result, out = _kernel_in_allocation(slurm, tmp_path, ["-N2", "-n2"], body)
    assert "2 ranks = 2 tasks allocated on node1,node2 (Slurm job " in out
    assert "engines via srun --overlap; backend gloo" in out
    assert result["launcher"] == "srun" and "--overlap" in result["args"]
    assert sorted(result["hosts"]) == ["node1", "node2"]
    assert result["sums"] == [2.0, 2.0]


def test_in_a_gpu_allocation_dist_start_starts_one_rank_per_gpu_across_the_nodes(slurm, tmp_path):
    """A job of 2 nodes x 1 task holding 2 GPUs per node (Slurm's bookkeeping GPUs: tests/slurmnodes.py):
    %dist_start with no arguments counts the GPUs of both nodes (SLURM_GPUS_ON_NODE alone says 2),
    puts 2 ranks on each node, each sees its node's GPUs, and the line says why. These GPUs cannot run
    CUDA, so the ranks fall back to gloo, and the line says that too (a CPU build of torch on a GPU node)."""
    body = f"""
        c.run({REPORT!r} + "report['cuda'] = os.environ.get('CUDA_VISIBLE_DEVICES')").raise_for_error()
        result = {{"reports": c.pull("report"), "chosen": c.chosen, "status": c.status()}}
    """
    result, out = _kernel_in_allocation(slurm, tmp_path, ["-N2", "--ntasks-per-node=1", "--gpus-per-node=2"], body)
    assert result["chosen"].startswith("4 ranks = 4 GPUs allocated on node1,node2 (Slurm job ")
    assert "backend gloo (the ranks see no CUDA device of their own: is torch a CPU build?" in result["chosen"]
    assert result["chosen"] in out  # %dist_start printed it
    reports = result["reports"]
    assert [r["host"] for r in reports] == ["node1", "node1", "node2", "node2"]
    assert [r["LOCAL_RANK"] for r in reports] == ["0", "1", "0", "1"]
    assert [r["SLURM_LOCALID"] for r in reports] == ["0", "1", "0", "1"]
    assert {r["cuda"] for r in reports} == {"0,1"}  # each rank sees its node's two GPUs
    assert [r["total"] for r in reports] == [10.0] * 4
    assert [row["device"] for row in result["status"]] == ["cpu"] * 4


def test_mpi_launcher_ranks_are_mpi_ranks(ip, slurm):
    run_cell(ip, "%dist_start --launcher mpi -n 2 --timeout 90")
    cluster = nbdist.current()
    try:
        cluster.run("import os\nmpi_rank = int(os.environ['OMPI_COMM_WORLD_RANK'])").raise_for_error()
        assert cluster.pull("mpi_rank") == [0, 1]
        cluster.run("x = torch.ones(1); dist.all_reduce(x)").raise_for_error()
        assert [t.item() for t in cluster.pull("x")] == [2.0, 2.0]
    finally:
        run_cell(ip, "%dist_stop")


def test_an_unreachable_controller_address_gives_one_line_within_the_timeout(slurm):
    tic = time.monotonic()
    with pytest.raises(ClusterError) as info:
        nbdist.start(n=2, launcher="slurm", nodes=2, ip=UNROUTED, timeout=60, progress=lambda line: None)
    assert time.monotonic() - tic < 60
    text = str(info.value)
    assert "\n" not in text
    assert f"cannot reach the controller at {UNROUTED}:" in text
    assert "node1" in text or "node2" in text
    assert "--ip" in text and "10.77.0.1" in text, "the fix names the address the nodes do reach"


KERNEL = textwrap.dedent(
    """
    import json, sys, time, nbdist
    c = nbdist.start(n=2, launcher="slurm", nodes=2, timeout=90)
    print(json.dumps({"pids": [r.pid for r in c.ranks], "jobs": c.engines.job_ids(), "dir": c.engines.workdir}),
          flush=True)
    time.sleep(600)
    """
)


def _start_and_kill_kernel(code: str) -> dict:
    """Run a 'kernel' that starts a cluster and prints its pids, then SIGKILL it (no cleanup can run)."""
    kernel = subprocess.Popen([PY, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        info = next(json.loads(line) for line in kernel.stdout if line.startswith("{"))
    finally:
        kernel.kill()
        kernel.wait()
    return info


def test_engines_on_the_nodes_end_when_the_kernel_dies(slurm):
    """The controller watches the kernel and cancels the Slurm job (by id) when it is gone."""
    info = _start_and_kill_kernel(KERNEL)
    assert wait_gone(info["pids"], 30) == [], "engines on the nodes must end within 30 s of the kernel"
    assert slurm.wait_empty(30) == []
    assert not os.path.exists(info["dir"]), "the controller removes the cluster's directory"


def test_engines_that_lose_the_controller_end_by_themselves(slurm):
    """No job to cancel (mpiexec): the engines notice the controller's heartbeat stopped."""
    code = KERNEL.replace('launcher="slurm", nodes=2', 'launcher="mpi"').replace(
        '"jobs": c.engines.job_ids()', '"jobs": []'
    )
    info = _start_and_kill_kernel(code)
    assert wait_gone(info["pids"], 30) == [], "engines must end within 30 s of losing the controller"


KEPT = textwrap.dedent(
    """
    import json, sys, time, nbdist
    c = nbdist.start(n=2, launcher="slurm", nodes=2, timeout=90, keep=KEEP)
    c.run("kept_value = 1000 + dist.get_rank()").raise_for_error()
    print(json.dumps({"pids": [r.pid for r in c.ranks], "jobs": c.engines.job_ids(), "dir": c.engines.workdir}),
          flush=True)
    time.sleep(600)
    """
)


def test_a_kept_slurm_world_is_attached_from_another_process_and_its_job_ends_by_itself(slurm, tmp_path, monkeypatch):
    """--keep with the slurm launcher: the kernel dies, another process attaches to the ranks on the nodes and
    finds their variables; a second kept world, left idle, ends by itself and its job is cancelled (by id)."""
    monkeypatch.setenv("NBDIST_KEPT_DIR", str(tmp_path / "kept"))
    info = _start_and_kill_kernel(KEPT.replace("KEEP", "20"))
    try:
        assert slurm.jobs() == info["jobs"], "kept: its job still runs after the kernel died"
        cluster = nbdist.attach()
        assert sorted({r.host for r in cluster.ranks}) == sorted(NODES), "the ranks on both nodes, found again"
        result = cluster.run("t = torch.ones(1) * kept_value\ndist.all_reduce(t)\nsummed = t.item()")
        result.raise_for_error()
        assert cluster.pull("summed") == [2001.0, 2001.0]
        cluster.stop()
        assert slurm.wait_empty(30) == [], "%dist_stop in the attached process cancels the kept job"
        idle = _start_and_kill_kernel(KEPT.replace("KEEP", "3"))
        assert slurm.jobs() == idle["jobs"], "kept: its job still runs after the kernel died"
        assert slurm.wait_empty(60) == [], "the idle kept world cancels its own job"
    finally:
        slurm.cancel_all_jobs()


PENDING = textwrap.dedent(
    """
    import nbdist
    nbdist.start(n=2, launcher="slurm", nodes=2, timeout=30)
    """
)


def test_a_pending_job_shows_its_state_and_ctrl_c_cancels_it(slurm):
    blocker = slurm.run(
        "sbatch", "-N2", "--exclusive", "--parsable", "--output=/dev/null", "--wrap", "sleep 600"
    ).stdout.strip()  # its output file would land in the working directory (the checkout)
    try:
        waiting = subprocess.Popen(
            [PY, "-u", "-c", PENDING], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        lines = []
        try:
            for line in waiting.stdout:
                lines.append(line)
                if "PENDING (Resources)" in line:
                    break
            assert any("Ctrl-C cancels it" in ln for ln in lines), lines
            ours = [j for j in slurm.jobs() if j != blocker]
            assert len(ours) == 1
            waiting.send_signal(signal.SIGINT)
            rest = waiting.communicate(timeout=HANG_S)[0]
        finally:
            waiting.kill()
        assert f"interrupted: cancelled Slurm job(s) {ours[0]}" in rest
        deadline = time.monotonic() + 30
        while slurm.jobs() != [blocker] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert slurm.jobs() == [blocker], "Ctrl-C cancels nbdist's job and nothing else"
    finally:
        slurm.run("scancel", blocker, check=False)


@pytest.mark.timeout(START_64_S + 180)  # past the start's own timeout: a start that stalls says where each engine waits
def test_64_ranks_over_two_slurm_nodes_are_ready_and_reduce(slurm):
    """64 ranks behind one controller, 32 on each node (8 nodes of 8 GPUs is where GPU users are): every engine
    registers (world/registration.py learns those the client missed; the controller keeps those whose heart is slow
    to start, docs/faults.md row 119), the world reduces, the job ends with it. The test nodes have 2 CPUs each:
    --overcommit lets Slurm place 32 tasks on each; 64 engines importing torch at once take about 2 minutes here."""
    cluster = nbdist.start(n=64, launcher="slurm", nodes=2, sbatch_args=["--overcommit"], timeout=START_64_S)
    try:
        jobs = cluster.engines.job_ids()
        assert {r.host for r in cluster.ranks} == set(NODES) and cluster.world_size == 64
        assert sorted(sum(r.host == h for r in cluster.ranks) for h in NODES) == [32, 32]
        cluster.run("t = torch.ones(1)\ndist.all_reduce(t)\nv = t.item()", quiet=True).raise_for_error()
        assert cluster.pull("v") == [64.0] * 64
    finally:
        cluster.stop()
    assert cluster.membership.cancelled == jobs
    assert slurm.wait_empty(60) == []


ELASTIC_SETUP = """
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from nbdist.parallel import shard
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
X = torch.randn(512, 8, generator=torch.Generator().manual_seed(1))
loader = shard(torch.utils.data.TensorDataset(X, X.sum(1, keepdim=True)), batch_size=8, seed=2)
"""
ELASTIC_TRAIN = """
import time
for step, (x, y) in loader.steps(STEPS):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    open(PROGRESS + f"-{dist.get_rank()}", "w").write(str(step))
    time.sleep(0.05)
final = [p.detach().clone() for p in model.parameters()]
"""


def _step(path: str) -> int:
    try:
        return int(open(path).read() or -1)
    except (OSError, ValueError):
        return -1


def test_a_lost_node_shrinks_the_world_to_node1_and_it_grows_back_when_node2_returns(slurm, tmp_path, ip, capsys):
    """node2's ranks killed mid-training and node2 drained: their replacement job waits in the queue past
    --timeout, so the world goes on with node1's 2 ranks and the job stays queued. node2 back (resumed) while the
    next cell trains: the job starts there and its 2 ranks join at a step boundary of that cell's loop, which goes
    on with 4 ranks. The world is tracked (%dist_track tensorboard): one run through the shrink and the grow, each
    step once, the world's size where it changed, written from the notebook (the ranks on the nodes open none)."""
    progress = str(tmp_path / "progress")
    said: list[tuple[float, str]] = []
    cluster = nbdist.start(
        n=4, launcher="slurm", nodes=2, max_restarts=1, min_ranks=2, timeout=40,
        progress=lambda line: said.append((time.time(), line)),
    )
    train = ELASTIC_TRAIN.replace("    time.sleep(0.05)\n", "    nbdist.log(step=step, loss=loss.item())\n    time.sleep(0.05)\n")
    try:
        assert sorted(r.host for r in cluster.ranks) == ["node1", "node1", "node2", "node2"]
        nbdist.track("tensorboard", "elastic", str(tmp_path / "runs"))
        cluster.run(f"PROGRESS, STEPS = {progress!r}, 40\nimport nbdist\n{ELASTIC_SETUP}", setup=True).raise_for_error()
        lost = [r for r in cluster.ranks if r.host == "node2"]

        def lose_node2() -> None:
            poll(lambda: _step(f"{progress}-{lost[0].rank}") >= 5, within=HANG_S, every=0.01)
            slurm.drain("node2", "lost for the test")
            for r in lost:
                os.kill(r.pid, signal.SIGKILL)  # the namespaces share one pid space

        threading.Thread(target=lose_node2, daemon=True).start()
        result = cluster.run(train)
        result.raise_for_error()
        [line] = result.recovered
        print(line)
        listed = ", ".join(str(r.rank) for r in lost)
        assert line.startswith(f"rank(s) {listed} died during the cell; could not replace them ("), line
        assert "PENDING" in line, line  # why: the replacement's job waited in the queue (node1 full, node2 drained)
        assert "continuing with 2 of 4 ranks" in line and "memory (nothing recomputed)" in line, line
        job = cluster.engines.job_ids()[0]
        assert f"Slurm job {job} gave back node2" in line, line  # so that the queued job can have node2 again
        queued = re.search(r"Slurm job (\d+) stays queued: 2 rank\(s\) join at a step boundary once it starts", line)
        assert queued, line
        assert [r.host for r in cluster.ranks] == ["node1", "node1"] and cluster.world_size == 2
        finals = cluster.pull("final")
        assert all(torch.equal(a, b) for a, b in zip(*finals, strict=True))
        capsys.readouterr()
        run_cell(ip, "%dist_status")
        status = capsys.readouterr().out
        assert "world size: 4 ranks, then 2 from step" in status, status
        assert f"Slurm job {queued.group(1)} stays queued: 2 rank(s) join at a step boundary once it starts." in status

        # node2 comes back while the next cell trains: the queued job starts, its ranks join in the loop. (Its steps
        # are not STEPS: the grow replays the setup cell, which sets STEPS = 40, before the loop goes on.)
        back: list[float] = []

        def node2_back() -> None:
            poll(lambda: _step(f"{progress}-0") >= 45, within=HANG_S, every=0.01)
            back.append(time.time())
            slurm.resume("node2")

        threading.Thread(target=node2_back, daemon=True).start()
        result = cluster.run("start = loader.step\n" + train.replace("loader.steps(STEPS)", "loader.steps(1000)").replace(
            "    time.sleep(0.05)\n", "    time.sleep(0.05)\n    if dist.get_world_size() == 4 and step >= start + 10:\n        break\n"
        ))
        result.raise_for_error()
        grew = [(t, s) for t, s in said if s.startswith("grew the world from 2 to 4 ranks")]
        assert grew and result.recovered == [grew[0][1]], (said, result.recovered)
        line = grew[0][1]
        print(line, f"({grew[0][0] - back[0]:.1f} s after node2 was resumed)")
        assert f"rank(s) 2, 3 joined from Slurm job {queued.group(1)}, queued since the world shrank" in line, line
        assert "memory (nothing recomputed)" in line, line
        assert sorted(r.host for r in cluster.ranks) == ["node1", "node1", "node2", "node2"]
        assert [r.rank for r in result.ranks] == [0, 1, 2, 3]  # the cell went on with 4 ranks
        grown = [row["step"] for row in result.metrics[2] if "loss" in row]  # a joined rank's rows, in the result
        finals = cluster.pull("final")
        assert all(torch.equal(finals[0][i], f[i]) for f in finals[1:] for i in range(len(finals[0])))
        assert "then 2 from step" in cluster.membership.sizes_line() and "(2 rank(s) added" in (
            cluster.membership.sizes_line()
        )
    finally:
        cluster.stop()  # ends the run too
        slurm.run("scontrol", "update", "nodename=node2", "state=resume", check=False)
    assert slurm.wait_empty(60) == []
    got = trackers.read("tensorboard", tmp_path / "runs", "elastic")
    assert got["runs"] == 1 and got["cells"] == [0, 0, 40], got["cells"]  # setup, a loop, a loop counting on
    for rank in range(4):  # node2's ranks may have died before they sent a row
        steps = [s for s, _ in got.get(f"rank{rank}/loss", [])]
        assert steps == sorted(set(steps)), (rank, steps)  # in order, none twice
    assert [s for s, _ in got["rank0/loss"]] == list(range(len(got["rank0/loss"])))  # node1's ranks: every step
    lost_at, grown_at = [s for s, _ in got["world/size"]][1:]
    assert [v for _, v in got["world/size"]] == [4.0, 2.0, 4.0] and 5 <= lost_at < 40 <= grown_at, got["world/size"]
    # rank 2: node2's old rank 2 to the shrink, then the joined rank 2 from the grow; none while it was gone
    assert all(s <= lost_at or s >= grown_at for s, _ in got["rank2/loss"]), (lost_at, grown_at, got["rank2/loss"])
    for rank in range(4):  # the loop went on after the grow: every rank's rows from there, node2's joined ranks too
        assert any(s >= grown_at for s, _ in got[f"rank{rank}/loss"]), (rank, grown_at, got[f"rank{rank}/loss"][-5:])
    assert grown == list(range(grown_at, grown_at + 11)), (grown_at, grown)  # 10 steps past where the cell began again
