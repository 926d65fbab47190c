"""``--launcher ray`` on a real two-node Ray cluster (tests/raynodes.py: the head on rnode1, a worker on rnode2,
each in its own network namespace, 2 CPUs each); the notebook side reaches it through Ray Client, as a Zero to
JupyterHub pod reaches a KubeRay cluster. Nothing here is mocked: Ray places the ranks, gloo runs between the
namespaces, and what Ray still holds afterwards is asked of Ray's own GCS. HANG_S only catches hangs."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest
import torch

import nbdist
from nbdist.errors import ClusterError, RankError
from nbdist.launch.ray import CONNECT_LIMIT_S
from tests.helpers import check_ddp_against_one_process, poll, run_cell

HANG_S = 120.0

# What Ray's GCS holds: actors not dead, and placement groups not removed (asked on the head node).
LEFT = """
from ray._private import state
actors = [a for a in state.actors().values() if a["State"] != "DEAD"]
groups = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
print(len(actors), len(groups))
"""


# Ray Client sessions (drivers) begun since SINCE (ms since the epoch, this machine's clock: the nodes share it).
# A Ray world's later engine sets (%dist_restart, recovery) are started by its first driver, warm, instead of
# each connecting to Ray again.
DRIVERS = """
from ray._private import state
me = ray.get_runtime_context().get_job_id()  # this query (its code names the client server too)
print(sum(1 for j in state.jobs() if "ray.util.client.server" in j["Entrypoint"] and j["StartTime"] >= SINCE
          and j["JobID"] != me))
"""


# Another job that asks for one CPU while the world runs: whether Ray placed it within 15 s.
COMPETITOR = """
from ray.util.placement_group import placement_group
group = placement_group([{"CPU": 1}])
print("placed" if ray.wait([group.ready()], timeout=15)[0] else "waited")
"""


def _drivers_since(ray_nodes, since_ms: int) -> int:
    return int(ray_nodes.query(DRIVERS.replace("SINCE", str(since_ms))))


def _warm_parent(pid: int) -> int:
    """The pid of the node's warm process that forked this engine (it fails where the engine started cold)."""
    parent = psutil.Process(pid).parent()
    assert parent is not None and "nbdist.engine.warm" in " ".join(parent.cmdline()), f"engine {pid} started cold"
    return parent.pid


def _started_cold(pid: int) -> bool:
    """Whether this engine is its actor's own child (a fresh interpreter), not a fork of a warm process: its parent
    is a Ray worker, whose title is its actor's ('ray::Engine')."""
    parent = psutil.Process(pid).parent()
    return parent is not None and " ".join(parent.cmdline()).startswith("ray::Engine")


def _node(pid: int) -> str:
    """The network namespace a process runs in: which test Ray node it is on."""
    return os.readlink(f"/proc/{pid}/ns/net")


def _driver_output(cluster) -> str:
    """What the world's Ray driver has written (ipyparallel keeps an engine set's output in its profile's log)."""
    import glob

    return "".join(open(f).read() for f in glob.glob(f"{cluster.membership.workdir}/profile/log/ipengine-*.log"))


def _held(ray_nodes) -> tuple[int, int]:
    """Actors alive and placement groups not removed, now."""
    actors, groups = (int(x) for x in ray_nodes.query(LEFT).split())
    return actors, groups


def _left(ray_nodes) -> tuple[int, int]:
    """Actors alive and placement groups not removed, once Ray has had a moment to end what was let go."""
    deadline, said = time.monotonic() + 30, (0, 0)
    while time.monotonic() < deadline:
        said = _held(ray_nodes)
        if said == (0, 0):
            break
        time.sleep(1)
    return said


def test_four_ranks_over_both_ray_nodes_train_as_one_process_and_stop_leaves_nothing(ray_nodes, ip, capsys):
    """%dist_start -n 4 --launcher ray --address ray://...: 2 ranks on each node (the placement group packs a
    node's ranks together, in rank order); DDP equals one process on the shards' union; %dist_stop leaves no
    actor, placement group or engine."""
    run_cell(ip, f"%dist_start -n 4 --launcher ray --address {ray_nodes.address} --timeout 90")
    said = capsys.readouterr().out
    assert "4 ranks ready on 2 hosts (rnode1, rnode2)" in said, said
    cluster = nbdist.current()
    try:
        assert [r.host for r in cluster.ranks] == ["rnode1", "rnode1", "rnode2", "rnode2"]
        check_ddp_against_one_process(cluster)
        # the first engines start cold, each in its actor (no warm process on the start's path)
        assert all(_started_cold(r.pid) for r in cluster.ranks), "a first rank waited for a warm process"
        # once the world formed: one actor per rank and one per node (its warm process, for ranks started there
        # later), and the world's placement group, while it lives
        poll(lambda: _held(ray_nodes) == (6, 1), within=HANG_S)
        # each engine's own output reaches the driver's (where the kernel reads an engine's last lines when it did
        # not start), through files in the cluster's directory rather than Ray's relay
        poll(lambda: _driver_output(cluster).count("Completed registration with id") == 4, within=HANG_S)
    finally:
        run_cell(ip, "%dist_stop")
    assert _left(ray_nodes) == (0, 0), "actors or placement groups outlived %dist_stop"


def test_ctrl_c_in_a_collective_releases_every_rank_and_a_killed_rank_restarts_on_its_node(ray_nodes):
    """One world of 4 ranks, two drills. Rank 3 (rnode2) sleeps while the others wait in all_reduce: Ctrl-C in the
    notebook (SIGINT to the kernel, carried to each rank by ipyparallel's nanny) releases all four, none dies, and
    the world works again. Then rank 3's engine is SIGKILLed: the cell fails naming rank 3 and its host, and
    %dist_restart places its replacement on rnode2 again (the only node with a free CPU); the world trains again."""
    cluster = nbdist.start(4, launcher="ray", address=ray_nodes.address, timeout=90)
    try:
        threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGINT)).start()
        tic = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            cluster.run("import time\nt = torch.ones(1)\nif dist.get_rank() == 3:\n    time.sleep(60)\ndist.all_reduce(t)")
        assert time.monotonic() - tic < 30, "the interrupt did not release the ranks (the sleep ran out instead)"
        assert cluster.dead_ranks() == []
        again = cluster.run("t = torch.ones(1)\ndist.all_reduce(t)\nprint(t.item())", quiet=True).raise_for_error()
        assert again.ranks[0].stdout == "4.0\n"

        # %dist_where: the ranks on both nodes say where they are (SIGUSR1 through the nanny on rnode2)
        behind = "import time\nt = torch.ones(1)\nif dist.get_rank() == 3:\n    time.sleep(8)\ndist.all_reduce(t)"
        pending = cluster.run(behind, block=False)

        def said() -> str:
            text = "\n".join(cluster.where())
            waiting = text.count(", in all_reduce (inside torch.distributed)") == 3  # ranks 0-2, all of them
            return text if waiting and "time.sleep(8)" in text else ""

        text = poll(said, within=HANG_S)
        rank3 = text[text.index("rank 3 (on rnode2)") :]
        assert "rnode2" in rank3.splitlines()[0] and "<-- behind: rank(s) 0, 1, 2 entered all_reduce" in rank3, text
        pending.wait(timeout=HANG_S, show=False)

        victim = cluster.ranks[3]
        assert victim.host == "rnode2"
        node, since = _node(victim.pid), int(time.time() * 1000)
        os.kill(victim.pid, signal.SIGKILL)  # the namespaces share one pid space
        result = cluster.run("import time\nt = torch.ones(1)\ntime.sleep(1)\ndist.all_reduce(t)", timeout=HANG_S)
        with pytest.raises(RankError) as err:
            result.raise_for_error()
        assert "rank 3" in str(err.value) and "rnode2" in str(err.value), str(err.value)
        assert any("rank(s) 3 (on rnode2) died; %dist_restart --ranks 3 brings them back" in n for n in result.notes)
        # another job asks Ray for the CPU rank 3 held: the world keeps its reservation, so that job waits, and the
        # replacement takes the CPU (before, the CPU went back to Ray with the dead rank's actor, and whoever
        # asked first took it)
        competitor: list[str] = []
        other = threading.Thread(target=lambda: competitor.append(ray_nodes.query(COMPETITOR)), daemon=True)
        other.start()
        poll(lambda: _held(ray_nodes)[1] == 2, within=HANG_S)  # its placement group is asked for, and waits
        cluster.restart([3])
        assert [r.host for r in cluster.ranks] == ["rnode1", "rnode1", "rnode2", "rnode2"]
        # the replacement was started by the world's own driver (no second connection to Ray), and forked from
        # rnode2's warm process (the rank it replaces started cold, with the world)
        assert _drivers_since(ray_nodes, since) == 0 and _node(_warm_parent(cluster.ranks[3].pid)) == node
        other.join(timeout=HANG_S)
        assert competitor == ["waited\n"], competitor
        check_ddp_against_one_process(cluster)
    finally:
        cluster.stop()
    assert _left(ray_nodes) == (0, 0)


def test_more_ranks_than_the_ray_cluster_holds_fail_at_once_naming_what_is_missing(ray_nodes):
    """-n 6 on 4 CPUs: one line that says what is missing, long before the --timeout (300 s) would end a wait
    (the start itself, Ray Client's connection included, took 47 s once on the loaded CI machine); nothing left."""
    tic = time.monotonic()
    with pytest.raises(ClusterError) as err:
        nbdist.start(6, launcher="ray", address=ray_nodes.address, timeout=300)
    took = time.monotonic() - tic
    message = str(err.value)
    assert "the Ray cluster cannot hold 6 rank(s) of 1 CPU each: it lacks 2 CPU (it has 4 of the 6 asked). Start fewer ranks (-n), add Ray nodes." in message, message
    assert took < 150, f"{took:.0f} s: it waited instead of failing at once"
    assert _left(ray_nodes) == (0, 0)


def test_an_unreachable_ray_address_fails_in_one_line(ray_nodes):
    with pytest.raises(ClusterError) as err:
        nbdist.start(2, launcher="ray", address="ray://10.79.0.9:10001", timeout=60)
    assert "cannot reach the Ray cluster at ray://10.79.0.9:10001: No route to host (no host answers" in str(err.value)
    with pytest.raises(ClusterError) as err:  # the head, another port
        nbdist.start(2, launcher="ray", address=ray_nodes.address.replace("10001", "10002"), timeout=60)
    assert "Connection refused (the host is there but nothing listens on that port" in str(err.value), str(err.value)
    assert _left(ray_nodes) == (0, 0)


def test_a_killed_kernel_leaves_no_actor_placement_group_or_engine(ray_nodes):
    """The kernel SIGKILLed with 2 ranks up: the Ray driver it started sees it gone and ends its engines and
    actors; Ray holds nothing of the world afterwards, and no engine process is left on either node."""
    import subprocess
    import sys

    import psutil

    kernel = subprocess.Popen(
        [sys.executable, "-c", "import nbdist, time\n"
         f"c = nbdist.start(2, launcher='ray', address={ray_nodes.address!r}, timeout=90)\n"
         "print(' '.join(str(r.pid) for r in c.ranks), flush=True)\ntime.sleep(600)"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        # the start's progress lines come first ('connecting to the Ray cluster at ...; waited 3 s'), then the pids
        lines = kernel.stdout  # type: ignore[union-attr]
        pids = [int(p) for p in next(line for line in lines if line[:1].isdigit()).split()]
        assert len(pids) == 2, "the world did not start"
        # two ranks on rnode1 (the placement packs them) and, once the world formed, its warm process
        poll(lambda: _held(ray_nodes)[0] == 3, within=HANG_S)
    finally:
        kernel.kill()
        kernel.wait()
    assert _left(ray_nodes) == (0, 0), "actors or placement groups outlived the kernel"
    deadline = time.monotonic() + 30
    while any(psutil.pid_exists(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(psutil.pid_exists(p) for p in pids), "an engine outlived the kernel"


def test_the_multinode_notebook_runs_its_cells_on_the_ray_cluster(ray_nodes, monkeypatch, tmp_path):
    """Notebook 07 where no Slurm answers and RAY_ADDRESS names a Ray cluster (as Zero to JupyterHub's values
    set it): the same cells on --launcher ray, 2 ranks on one node for the baseline, 4 over both nodes for the
    rest, and DDP across them equal to one process; %dist_stop leaves Ray nothing."""
    from tests.notebooks.test_notebooks import MULTINODE, _execute

    with monkeypatch.context() as env:  # for the notebook's kernel only
        env.setenv("PATH", ":".join(p for p in os.environ["PATH"].split(":") if not os.path.exists(f"{p}/sbatch")))
        env.setenv("RAY_ADDRESS", ray_nodes.address)
        _, text = _execute(MULTINODE, tmp_path, others=tuple(proc.pid for proc in ray_nodes.nodes.values()))
    assert "Slurm reachable: False" in text and f"Ray cluster named: True {ray_nodes.address}" in text
    assert "#SBATCH" not in text  # not the laptop's fallback
    assert "hosts by rank: ['rnode1', 'rnode1', 'rnode2', 'rnode2']" in text, text
    assert "DDP across 2 host(s) == one process" in text
    assert _left(ray_nodes) == (0, 0)


KEPT = """
import json, sys, time, nbdist
c = nbdist.start(n=N, launcher="ray", address=sys.argv[1], timeout=90, keep=KEEP)
c.run("kept_value = 1000 + dist.get_rank()").raise_for_error()
print(json.dumps({"pids": [r.pid for r in c.ranks]}), flush=True)
time.sleep(600)
"""


def _start_and_kill_kernel(code: str, address: str) -> dict:
    """A 'kernel' that starts a world and prints its pids, then SIGKILLed (no cleanup can run)."""
    import json
    import subprocess
    import sys

    kernel = subprocess.Popen([sys.executable, "-c", code, address], stdout=subprocess.PIPE, text=True)
    try:
        return next(json.loads(line) for line in kernel.stdout if line.startswith("{"))
    finally:
        kernel.kill()
        kernel.wait()


def test_a_kept_ray_world_is_attached_from_another_process_and_ends_by_itself_when_idle(ray_nodes, monkeypatch, tmp_path):
    """--keep with the Ray launcher: the kernel dies and the world's actors stay; another process attaches to the
    4 ranks on both nodes and finds their variables, and its %dist_stop leaves Ray nothing; a second kept world,
    left idle past its time, ends by itself, actors and placement group too."""
    monkeypatch.setenv("NBDIST_KEPT_DIR", str(tmp_path / "kept"))
    tic = time.monotonic()
    _start_and_kill_kernel(KEPT.replace("KEEP", "180").replace("N", "4"), ray_nodes.address)  # ended by stop below
    print(f"kept world started and its kernel killed: {time.monotonic() - tic:.1f} s")
    time.sleep(2)  # past the moment a driver that watched its kernel would have ended the world
    assert _held(ray_nodes) == (6, 1), "kept: the ranks' actors (and the nodes' warm ones) outlive the kernel"
    # a second kept world whose kernel dies while Ray still waits for CPUs (the first holds them all): its driver
    # has nothing placed to keep, so it ends and removes its placement group
    import subprocess
    import sys

    stopped = False
    try:
        said = tmp_path / "second-kernel.log"
        with open(said, "w") as out:
            waiting = subprocess.Popen(
                [sys.executable, "-c", KEPT.replace("KEEP", "30").replace("N", "2"), ray_nodes.address],
                stdout=out, stderr=subprocess.STDOUT,
            )
        asked = time.monotonic()
        try:
            seen: list[tuple[int, int]] = []

            def second_group_waits() -> bool:
                seen.append(_held(ray_nodes))
                if seen[-1] != (6, 2) and waiting.poll() is not None:
                    raise AssertionError("the second kernel ended before its group was asked for")
                return seen[-1] == (6, 2)

            # its group waits beside the first world's, once its driver connected: Ray Client may refuse a second
            # client's server and be tried again (faults row 97), which the driver bounds at CONNECT_LIMIT_S
            try:
                poll(second_group_waits, within=CONNECT_LIMIT_S + HANG_S)
            except BaseException as e:
                raise AssertionError(
                    f"Ray held (actors, groups) {sorted(set(seen))}, never (6, 2) ({e!r}); the second kernel "
                    f"({'running' if waiting.poll() is None else f'ended {waiting.returncode}'}) said:\n"
                    + said.read_text()[-3000:]
                ) from None
            print(f"the second world's group waited beside the first's: {time.monotonic() - asked:.1f} s after its start")
        finally:
            waiting.kill()
            waiting.wait()
        poll(lambda: _held(ray_nodes) == (6, 1), within=HANG_S)
        cluster = nbdist.attach()
        try:
            # each engine's own output reaches the driver's (where the kernel reads an engine's last lines when it
            # did not start), through files in the cluster's directory rather than Ray's relay
            poll(lambda: _driver_output(cluster).count("Completed registration with id") == 4, within=HANG_S)
            assert [r.host for r in cluster.ranks] == ["rnode1", "rnode1", "rnode2", "rnode2"]
            cluster.run("t = torch.ones(1) * kept_value\ndist.all_reduce(t)\nsummed = t.item()").raise_for_error()
            assert cluster.pull("summed") == [4006.0] * 4
        finally:
            cluster.stop()
            stopped = True
    finally:
        if not stopped:  # the kept world would hold every CPU of the Ray cluster for the module's next tests
            nbdist.attach().stop()
    assert _left(ray_nodes) == (0, 0), "%dist_stop in the attached process ends the kept world's actors"
    print(f"attached, used and stopped: {time.monotonic() - tic:.1f} s")
    _start_and_kill_kernel(KEPT.replace("KEEP", "3").replace("N", "2"), ray_nodes.address)
    print(f"a second kept world started and its kernel killed: {time.monotonic() - tic:.1f} s")
    assert _left(ray_nodes) == (0, 0), "an idle kept world ends by itself, and lets Ray go"
    print(f"it ended by itself: {time.monotonic() - tic:.1f} s")


def test_a_rank_killed_mid_training_is_recovered_on_its_node_from_a_living_peer(ray_nodes, tmp_path):
    """--max-restarts 1 on Ray: rank 3's engine (rnode2) SIGKILLed from outside mid-loop; the cell still succeeds:
    a replacement actor on rnode2 takes the state from a living rank's memory, nothing is computed twice, and
    the 4 replicas end equal. (That the result equals an uninterrupted run is tested on local ranks:
    tests/integration/test_peer_recovery.py.)"""
    from tests.helpers import poll
    from tests.integration.test_peer_recovery import SETUP, STEPS, TRAIN, _progress

    progress = str(tmp_path / "progress")  # the nodes share this filesystem
    cluster = nbdist.start(4, launcher="ray", address=ray_nodes.address, timeout=90, max_restarts=1)
    try:
        cluster.run(f"PROGRESS = {progress!r}\n{SETUP}", setup=True).raise_for_error()
        victim = cluster.ranks[3]
        node = _node(victim.pid)

        def kill() -> None:
            poll(lambda: _progress(progress, 3) >= 10, within=HANG_S, every=0.005)
            os.kill(victim.pid, signal.SIGKILL)

        killer = threading.Thread(target=kill, daemon=True)
        killer.start()
        result = cluster.run(TRAIN, timeout=2 * HANG_S).raise_for_error()
        killer.join(timeout=HANG_S)
        [line] = result.recovered
        assert line.startswith("rank(s) 3 died during the cell") and "(nothing recomputed)" in line, line
        assert [r.host for r in cluster.ranks] == ["rnode1", "rnode1", "rnode2", "rnode2"]
        # forked from rnode2's warm process
        assert cluster.ranks[3].pid != victim.pid and _node(_warm_parent(cluster.ranks[3].pid)) == node
        assert all(_progress(progress, r) == STEPS - 1 for r in range(4))  # every rank to the last step
        cluster.run("n_params = len(list(model.parameters()))").raise_for_error()
        final, params = cluster.pull("final"), cluster.pull("n_params")[0]
        for rank in range(1, 4):  # the replicas' parameters (each rank's BatchNorm statistics are its own)
            for mine, theirs in zip(final[rank][:params], final[0][:params], strict=True):
                assert torch.equal(mine, theirs), rank
    finally:
        cluster.stop()
    assert _left(ray_nodes) == (0, 0)


def test_a_cold_world_restarts_a_killed_rank_in_the_bundle_it_holds(ray_nodes, monkeypatch):
    """NBDIST_WARM=0 (every rank a fresh interpreter): %dist_restart --ranks 3 is still started by the world's driver,
    in the bundle the world holds for the dead rank. Before, the replacement was a driver of its own that asked Ray
    for a CPU the world kept, and waited for good (benchmarks/multinode.py hung there)."""
    monkeypatch.setenv("NBDIST_WARM", "0")
    cluster = nbdist.start(4, launcher="ray", address=ray_nodes.address, timeout=300)
    try:
        assert [r.host for r in cluster.ranks] == ["rnode1", "rnode1", "rnode2", "rnode2"]
        os.kill(cluster.ranks[3].pid, signal.SIGKILL)
        with pytest.raises(RankError, match="rank 3"):
            cluster.run("t = torch.ones(1)\ndist.all_reduce(t)", timeout=HANG_S).raise_for_error()
        done: list[float] = []
        restarting = threading.Thread(target=lambda: done.append(cluster.restart([3])), daemon=True)
        restarting.start()
        restarting.join(timeout=HANG_S)
        assert done, "the restart still waits: for a CPU the world itself holds?"
        assert [r.host for r in cluster.ranks] == ["rnode1", "rnode1", "rnode2", "rnode2"]
        assert "nbdist.engine.warm" not in " ".join(psutil.Process(cluster.ranks[3].pid).parent().cmdline())
        cluster.run("t = torch.ones(1)\ndist.all_reduce(t)\nsummed = t.item()").raise_for_error()
        assert cluster.pull("summed") == [4.0] * 4
    finally:
        cluster.stop()
    assert _left(ray_nodes) == (0, 0)
