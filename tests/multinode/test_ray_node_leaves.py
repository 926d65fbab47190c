"""A Ray node that leaves while nbdist places or starts ranks (#52's bad input), on a real two-node Ray cluster of
its own (tests/raynodes.py): each test ends rnode2, so the module does not share test_ray.py's cluster, and a test
that finds rnode2 gone brings the cluster up again. A node "leaves" as its raylet does when its machine fails: it
stops answering (SIGSTOP of `ray start --block`'s process group: the raylet and its agents), then is killed, and
Ray's GCS calls it dead (about 15 s). HANG_S only catches hangs."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

import nbdist
from nbdist.errors import ClusterError, RankError
from tests.helpers import poll
from tests.multinode.test_ray import HANG_S, _left

# The placement groups Ray's GCS has not removed, with their state, and its alive nodes.
GROUPS = """
groups = [g["state"] for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
print(" ".join(groups) or "-", sum(1 for node in ray.nodes() if node["Alive"]))
"""

# The actors Ray's GCS is creating (neither alive nor dead yet).
CREATING = """
from ray._private import state
print(sum(1 for a in state.actors().values() if a["State"] not in ("ALIVE", "DEAD")))
"""


def _whole(ray_nodes) -> None:
    """Both nodes up: the cluster again when a test before this one ended rnode2."""
    if any(proc.poll() is not None for proc in ray_nodes.nodes.values()):
        ray_nodes.down()
        ray_nodes.up()


def _in_thread(call, outcome: dict) -> threading.Thread:
    """``call()`` in a thread; ``outcome["error"]``: what it raised, or None."""

    def run() -> None:
        try:
            call()
            outcome["error"] = None
        except BaseException as exc:  # noqa: BLE001 (the test reads it)
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_node_that_leaves_while_the_ranks_are_placed_fails_the_start_in_one_line_and_the_rest_still_serves(ray_nodes):
    """rnode2 stops answering (SIGSTOP, as a node whose network failed) before -n 4 asks for both nodes' CPUs:
    Ray cannot finish the placement and nbdist waits for it; rnode2 is then killed, and Ray calls it dead. The
    start fails in one line that names the node and what the cluster now lacks, nothing is left in Ray, and a
    world that fits the node left starts and runs."""
    _whole(ray_nodes)
    node = ray_nodes.nodes["rnode2"]  # `ray start --block` in a session of its own: its process group is the node
    os.killpg(node.pid, signal.SIGSTOP)
    outcome: dict[str, BaseException | None] = {}
    starting = _in_thread(lambda: nbdist.start(4, launcher="ray", address=ray_nodes.address, timeout=300).stop(), outcome)
    killed = False
    try:

        def placement_waits() -> bool:
            """a placement group of nbdist's, not yet placed, while rnode2 is still called alive"""
            groups, alive = ray_nodes.query(GROUPS).split()
            return groups not in ("-", "CREATED") and alive == "2"

        poll(placement_waits, within=HANG_S, every=1.0)
        assert starting.is_alive(), outcome  # nbdist waits for the placement
        os.killpg(node.pid, signal.SIGKILL)  # the node leaves for good
        killed, tic = True, time.monotonic()
        starting.join(timeout=HANG_S)
        print(f"rnode2 killed -> the start's error: {time.monotonic() - tic:.1f} s")
        assert not starting.is_alive(), "the start still waits, after rnode2 left"
    finally:
        if not killed:
            os.killpg(node.pid, signal.SIGKILL)
        node.wait()
    error = outcome["error"]
    assert isinstance(error, ClusterError), repr(error)
    said = str(error)
    assert (
        "Ray node rnode2 (10.79.0.3) left the cluster while 4 rank(s) were being placed; none started. The Ray "
        "cluster now cannot hold 4 rank(s) of 1 CPU each: it lacks 2 CPU (it has 2 of the 4 asked). Start fewer "
        "ranks (-n), add Ray nodes." in said
    ), said
    assert _left(ray_nodes) == (0, 0), "the failed start left an actor or a placement group"
    cluster = nbdist.start(2, launcher="ray", address=ray_nodes.address, timeout=300)
    try:
        assert [r.host for r in cluster.ranks] == ["rnode1", "rnode1"]
        cluster.run("t = torch.ones(1)\ndist.all_reduce(t)\nsummed = t.item()").raise_for_error()
        assert cluster.pull("summed") == [2.0, 2.0]
    finally:
        cluster.stop()
    assert _left(ray_nodes) == (0, 0)



def test_a_node_that_leaves_while_a_rank_is_restarted_on_it_fails_the_restart_in_one_line_and_says_the_world_is_short(
    ray_nodes,
):
    """4 ranks over both nodes; rank 3 (rnode2) is killed and its bundle stays the world's, on rnode2. rnode2 stops
    answering, %dist_restart --ranks 3 creates the replacement's actor in that bundle, and Ray cannot; rnode2 is
    killed. The restart fails in one line naming the node, never hangs; the next cell is refused, naming the ranks
    the world lost (rank 2 died with its node); ranks 0 and 1 keep their variables."""
    _whole(ray_nodes)
    cluster = nbdist.start(4, launcher="ray", address=ray_nodes.address, timeout=300)
    node, killed = ray_nodes.nodes["rnode2"], False
    try:
        assert [r.host for r in cluster.ranks] == ["rnode1", "rnode1", "rnode2", "rnode2"]
        cluster.run("kept = dist.get_rank() + 10").raise_for_error()
        os.kill(cluster.ranks[3].pid, signal.SIGKILL)
        with pytest.raises(RankError, match="rank 3"):
            cluster.run("t = torch.ones(1)\ndist.all_reduce(t)", timeout=HANG_S).raise_for_error()
        os.killpg(node.pid, signal.SIGSTOP)
        outcome: dict[str, BaseException | None] = {}
        restarting = _in_thread(lambda: cluster.restart([3]), outcome)

        def actor_is_created() -> bool:
            """the replacement's actor, which Ray cannot create on the frozen node"""
            return int(ray_nodes.query(CREATING)) > 0

        poll(actor_is_created, within=HANG_S, every=1.0)
        assert restarting.is_alive(), outcome
        os.killpg(node.pid, signal.SIGKILL)
        killed, tic = True, time.monotonic()
        restarting.join(timeout=HANG_S)
        print(f"rnode2 killed -> the restart's error: {time.monotonic() - tic:.1f} s")
        assert not restarting.is_alive(), "the restart still waits, after rnode2 left"
        error = outcome["error"]
        assert isinstance(error, ClusterError), repr(error)
        assert (
            "Ray node rnode2 (10.79.0.3) left the cluster while 1 rank(s) were being started; none started. The "
            "nodes left could hold them: start them again once Ray has the CPUs free" in str(error)
        ), str(error)
        with pytest.raises(ClusterError) as err:
            cluster.run("t = torch.ones(1)", timeout=HANG_S)
        assert "rank 2 (on rnode2) is dead; run %dist_restart --ranks 2,3" in str(err.value), str(err.value)
        assert cluster.pull("kept", ranks=[0, 1]) == [10, 11]
    finally:
        if not killed:
            os.killpg(node.pid, signal.SIGKILL)
        node.wait()
        cluster.stop()
    assert _left(ray_nodes) == (0, 0)
