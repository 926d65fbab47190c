"""--launcher ray's checks that need no Ray cluster (the cluster itself: tests/multinode/test_ray.py)."""

from __future__ import annotations

import threading

import pytest

from nbdist.config import StartConfig
from nbdist.errors import ConfigError
from nbdist.launch import ray as raylaunch
from nbdist.launch.launchers import launcher_for


def test_ray_versions_outside_the_tested_range_are_named_with_the_fix():
    assert raylaunch.check_version("2.60.0") == ""
    said = raylaunch.check_version("1.13.0")
    assert said.startswith("Ray 1.13.0 is outside the versions --launcher ray is tested with (2.40 up to") and (
        "pip install 'ray[client]>=2.40,<3.0'" in said
    )
    assert raylaunch.check_version("3.1.0")


def test_what_the_ray_cluster_lacks_is_said_against_its_whole_size():
    assert raylaunch.missing({"CPU": 6, "GPU": 0}, {"CPU": 4.0}) == "2 CPU (it has 4 of the 6 asked)"
    assert raylaunch.missing({"CPU": 2, "GPU": 2}, {"CPU": 4.0, "GPU": 1.0}) == "1 GPU (it has 1 of the 2 asked)"
    assert raylaunch.missing({"CPU": 4, "GPU": 0}, {"CPU": 4.0}) == ""


def _refused(reason: str) -> ConnectionAbortedError:
    """Ray Client's own words (ray/util/client/worker.py, _server_init): its first line, then the head's traceback
    (ray/util/client/server/proxier.py, Datapath)."""
    import traceback

    try:
        raise RuntimeError(reason)
    except RuntimeError:
        return ConnectionAbortedError(f"Initialization failure from server:\n{traceback.format_exc()}")


def test_a_ray_client_server_that_could_not_serve_the_driver_is_said_with_its_reason_not_as_unreachable():
    said = raylaunch.connect_failure(_refused("Proxy failed to Connect to backend! Check `ray_client_server.err`"))
    assert said.startswith(
        "its Ray Client server answered but could not serve this client (RuntimeError: Proxy failed to Connect to "
        "backend! Check `ray_client_server.err`): the head's ray_client_server*.err"
    ), said
    assert "--address" not in said and "GRPC_ENABLE_FORK_SUPPORT" not in said  # it was reached; another fault
    died = raylaunch.connect_failure(
        _refused("Starting Ray client server failed. See ray_client_server_23000.err for detailed logs.")
    )
    assert "(RuntimeError: Starting Ray client server failed. See ray_client_server_23000.err" in died, died
    assert died.endswith("start the head with GRPC_ENABLE_FORK_SUPPORT=0 in its environment."), died
    unreachable = raylaunch.connect_failure(ConnectionError("ray client connection timeout\nmore"))
    assert unreachable.startswith("ray client connection timeout. Name its head with --address ray://HEAD:10001")


def test_ray_options_need_the_ray_launcher_and_sane_values():
    with pytest.raises(ConfigError, match=r"--address 'ray://h:10001' needs --launcher ray"):
        StartConfig.of(n=2, address="ray://h:10001")
    with pytest.raises(ConfigError, match=r"--gpus-per-rank \(-1\) must be from 0 to 8"):
        StartConfig.of(n=2, launcher="ray", gpus_per_rank=-1)
    config = StartConfig.of(n=4, launcher="ray", address="ray://10.0.0.7:10001", gpus_per_rank=1)
    launcher = launcher_for(config)
    assert isinstance(launcher, raylaunch.RayLauncher)
    assert launcher.node_addresses(config) == ["10.0.0.7"]  # the controller binds the interface that reaches it
    assert launcher.node_addresses(StartConfig.of(n=2, launcher="ray", address="10.0.0.8:6379")) == ["10.0.0.8"]


class _Groups:
    """The part of rayworld.World that the world's driver serves later engine sets from, over its real socket:
    a group 'starts' at once, and says so as the real one does."""

    def __init__(self, short: str = "") -> None:
        self.short, self.stopped, self.started = short, [], []
        self.warm_asked = threading.Event()

    def cannot_hold(self, n: int) -> str:
        return self.short

    def start(self, n, command, say, waiting, gone, env) -> int:
        assert env == {"NBDIST_CLUSTER_DIR": "/w"}  # the asking engine set's own
        waiting("Ray has not placed the 1 rank(s) yet")
        say(f"nbdist: launch rank 0 on rnode2, pid 4242 ({' '.join(command)})")
        self.started.append(n)
        return 7

    def stop_group(self, gid: int) -> None:
        self.stopped.append(gid)



def test_a_later_engine_set_is_served_by_the_worlds_driver_and_its_ranks_end_with_it(tmp_path):
    """rayserve over its real Unix socket: what the asker hears, its ranks' exit code, its ranks ended when it
    leaves first, the cluster's 'cannot hold' line, and no driver (or a dead one's socket) means 'start them
    yourself'. The socket is the user's only (0600)."""
    import os
    import socket
    import stat
    import threading

    from nbdist.launch import rayserve

    heard: list[str] = []

    def ask(**how):
        return rayserve.ask(
            str(tmp_path),
            1,
            ["python", "-m", "nbdist.engine"],
            {"NBDIST_CLUSTER_DIR": "/w"},
            say=heard.append,
            waiting=heard.append,
            preflight=lambda line: heard.append("PREFLIGHT " + line),
            **how,
        )

    assert ask() is None  # no driver serves this world: the engine set connects to Ray itself
    world = _Groups()
    server = rayserve.Server(str(tmp_path), world)
    try:
        assert stat.S_IMODE(os.stat(rayserve.path(str(tmp_path))).st_mode) == 0o600
        threading.Timer(0.5, server.finished, (7, 3)).start()  # its rank's engine ends with code 3
        assert ask() == 3 and world.started == [1]
        assert heard == [
            "Ray has not placed the 1 rank(s) yet",
            "nbdist: launch rank 0 on rnode2, pid 4242 (python -m nbdist.engine)",
        ]
        assert world.stopped == []  # it ended by itself: nothing to stop

        # the asker leaves while its rank runs (%dist_stop, Ctrl-C): the world's driver ends that rank
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(rayserve.path(str(tmp_path)))
        conn.sendall(b'{"n": 1, "command": ["python"], "env": {"NBDIST_CLUSTER_DIR": "/w"}}\n')
        said = conn.makefile("rb")
        assert [said.readline() for _ in range(3)][2] == b'{"started": true}\n'
        said.close()
        conn.close()
        from tests.helpers import poll

        poll(lambda: world.stopped == [7], within=10)

        # the kernel's world formed: the driver makes its nodes' warm processes (the kernel does not wait)
        rayserve.ahead(str(tmp_path))
        poll(world.warm_asked.is_set, within=10)
        assert world.started == [1, 1]  # nothing else was started

        world.short = "the Ray cluster cannot hold 1 rank(s) of 1 CPU each: it lacks 1 CPU (it has 0)."
        heard.clear()
        assert ask() == 2 and heard == ["PREFLIGHT " + world.short]
    finally:
        server.close()
    assert not os.path.exists(rayserve.path(str(tmp_path)))
    assert not server.accepting.is_alive(), "the thread that accepted askers outlived close()"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # a driver SIGKILLed leaves its socket behind
    dead.bind(rayserve.path(str(tmp_path)))
    dead.close()
    assert ask() is None
    rayserve.ahead(str(tmp_path))  # nor does the kernel's word that its world formed fail there
    rayserve.ahead("")


def test_the_engines_output_is_relayed_whole_lines_once_each(tmp_path):
    """The Ray driver relays each engine's output file (in the cluster's directory) to its own output, where the
    kernel reads an engine's last lines: each whole line once, in order, a line still being written only once it
    ends; a world without a cluster directory writes to its actors' own output instead."""
    from nbdist.launch.rayworld import Logs

    logs, said = Logs(), []
    assert logs.add({}, "ray-engine-0-0.log") == ""
    first = logs.add({"NBDIST_CLUSTER_DIR": str(tmp_path)}, "ray-engine-0-0.log")
    second = logs.add({"NBDIST_CLUSTER_DIR": str(tmp_path)}, "ray-engine-1-0.log")
    assert first == str(tmp_path / "ray-engine-0-0.log")
    logs.relay(said.append)  # nothing written yet (the files do not exist)
    assert said == []
    with open(first, "w") as fh:
        fh.write("Loading connection file\nRegister")
    logs.relay(said.append)
    assert said == ["Loading connection file"]
    with open(first, "a") as fh:
        fh.write("ing with controller\n")
    with open(second, "w") as fh:
        fh.write("ImportError: no torch \u2713\n")
    logs.relay(said.append)
    logs.relay(said.append)
    assert said == ["Loading connection file", "Registering with controller", "ImportError: no torch \u2713"]


def test_a_preflight_line_is_never_seen_created_and_still_empty(tmp_path, monkeypatch):
    """CI saw ClusterError(''): the Ray launcher created its preflight file, and the notebook's registration read
    it before the line was written. A reader polling as the notebook does sees the line whole or no file."""
    import os
    import threading
    import time

    from nbdist.errors import ClusterError
    from nbdist.launch import ray as raylaunch
    from nbdist.world.registration import check_preflight

    monkeypatch.setenv("NBDIST_CLUSTER_DIR", str(tmp_path))
    (tmp_path / "preflight-n1-0.txt.99.tmp").write_text("")  # a writer's temporary name is not read
    engines = type("E", (), {"workdir": str(tmp_path), "launcher": type("L", (), {"unreachable_hint": str})()})()
    check_preflight(engines)  # nothing to say yet
    seen: list[str] = []
    polls = [0]
    stop = threading.Event()

    def poll() -> None:  # as the notebook's registration polls
        while not stop.is_set():
            try:
                check_preflight(engines)
            except ClusterError as err:
                seen.append(str(err))
            polls[0] += 1

    reader = threading.Thread(target=poll)
    reader.start()
    try:
        for i in range(300):
            raylaunch.say_preflight(f"cannot reach the Ray cluster, try {i}")
            # the reader polls through each write; two more polls mean one began after it, and saw the line
            # (on 2 busy cores it could otherwise miss every line, and the test prove nothing)
            until, deadline = polls[0] + 2, time.monotonic() + 10  # the bound only catches a hang
            while polls[0] < until and time.monotonic() < deadline:
                time.sleep(0)
            os.unlink(tmp_path / raylaunch.PREFLIGHT)
    finally:
        stop.set()
        reader.join()
    assert len(seen) >= 300 and all(s.startswith("cannot reach the Ray cluster, try ") for s in seen), sorted(set(seen))[:3]
    raylaunch.say_preflight("the line")
    assert oct((tmp_path / raylaunch.PREFLIGHT).stat().st_mode & 0o777) == "0o600"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([raylaunch.PREFLIGHT, "preflight-n1-0.txt.99.tmp"])


def test_a_rank_whose_actor_is_slow_to_answer_is_asked_again_and_one_that_died_is_let_go():
    """World.poll with Ray's own exceptions: a poll that timed out (a loaded node) or failed in Ray Client keeps the
    rank, until MISSES polls in a row failed; an actor Ray says died, or one on a node Ray calls dead, is let go at
    once. (Before, any failed poll let the actor go, and with it a living rank's engine.)"""
    from ray.exceptions import ActorDiedError, GetTimeoutError

    from nbdist.launch import rayworld

    class Ref:
        def __init__(self, answer):
            self.answer = answer

    class Actor:
        def __init__(self, answers):
            self.answers = list(answers)
            self.poll = self

        def remote(self):
            return Ref(self.answers.pop(0))

    class Ray:  # the calls World.poll makes, answered as Ray answers them
        killed: list = []
        alive = {"n1": True, "n2": True}

        def get(self, ref, timeout):
            if isinstance(ref.answer, BaseException):
                raise ref.answer
            return ref.answer

        def kill(self, actor):
            self.killed.append(actor)

        def nodes(self):
            return [{"NodeID": node, "Alive": alive} for node, alive in self.alive.items()]

    ray = Ray()
    world = rayworld.World(ray, 1.0, 0.0, {})
    slow = Actor([GetTimeoutError("timed out"), RuntimeError("Ray Client: connection reset"), None] + [GetTimeoutError("x")] * 3)
    died = Actor([ActorDiedError()])
    on_dead_node = Actor([GetTimeoutError("timed out")])
    world.groups[0], world.worst[0] = {0: slow, 1: died, 2: on_dead_node}, 0
    for rank, actor in enumerate((slow, died, on_dead_node)):
        world.bundle[id(actor)] = rayworld.Slot(None, rank, "n2" if actor is on_dead_node else "n1")
    ray.alive["n2"] = False
    said: list[str] = []
    world.poll(said.append)
    assert ray.killed == [died, on_dead_node] and list(world.groups[0]) == [0], said
    assert "rank 0's actor did not answer (GetTimeoutError); asked again" in said[0], said
    world.poll(said.append)  # a second failure in a row, of another kind
    world.poll(said.append)  # it answers: alive, and its count starts again
    assert list(world.groups[0]) == [0] and ray.killed == [died, on_dead_node]
    for _ in range(rayworld.MISSES - 1):
        world.poll(said.append)
    assert list(world.groups[0]) == [0], said  # the failures before its answer no longer count
    world.poll(said.append)
    assert ray.killed == [died, on_dead_node, slow], said  # MISSES polls in a row unanswered: taken for gone
    assert world.groups == {}, world.groups  # its group ended with it


def test_a_group_whose_start_failed_while_its_rank_was_polled_leaves_the_other_groups_ranks_alone():
    """The world's driver polls every group's actors (its main thread) while a later group is started (the serve
    thread). A restart's actor that Ray cannot create on a node that left: its poll fails with ActorDiedError when
    Ray calls the node dead, and at the same moment the start fails (NodeLeft) and stop_group ends that group. The
    poll then lets the actor go: the group is gone already. Before, that raised KeyError out of the driver's loop,
    whose clean-up ended every rank of the world (CI: test_ray_node_leaves, ranks 0 and 1 died with rnode2)."""
    from ray.exceptions import ActorDiedError

    from nbdist.launch import rayworld

    class Actor:
        def __init__(self, answer):
            self.answer, self.poll, self.stop = answer, self, self

        def remote(self):
            return self

    class Ray:
        killed: list = []

        def get(self, ref, timeout):
            if isinstance(ref.answer, BaseException):
                world.stop_group(1)  # the start's thread, while this poll waited on the restart's actor
                raise ref.answer
            return ref.answer

        def kill(self, actor):
            self.killed.append(actor)

        def nodes(self):
            return [{"NodeID": "n1", "Alive": True}]

    ray = Ray()
    world = rayworld.World(ray, 1.0, 0.0, {})
    living, restarted = [Actor(None), Actor(None)], Actor(ActorDiedError())
    world.groups, world.worst = {0: dict(enumerate(living)), 1: {0: restarted}}, {0: 0, 1: 0}
    world.starting.add(1)
    said: list[str] = []
    assert world.poll(said.append) == []
    assert world.groups == {0: dict(enumerate(living))}, said  # the world's ranks are kept
    assert restarted in ray.killed and not set(map(id, living)) & set(map(id, ray.killed)), said
    assert any("rank 0's engine ended (-1); its actor is let go" in line for line in said), said


def test_the_drivers_own_error_in_its_poll_is_said_and_the_ranks_run_on(tmp_path, monkeypatch):
    """keep_polling, the world's driver's loop: a poll that raises (here the KeyError fixed above, as any bug of
    nbdist's or Ray's would) is said once with its traceback and tried again; the ranks are not ended. Before, the
    error left the loop and main's clean-up ended every rank, with no word the notebook showed. A poll that fails
    for ``patience_s`` in a row ends the world, and the line the driver then writes is what the notebook reads."""
    from nbdist.launch import rayserve

    class World:
        def __init__(self, answers):
            self.answers, self.groups, self.polls = list(answers), {0: {0: "actor"}}, 0

        def poll(self, say):
            self.polls += 1
            answer = self.answers.pop(0) if self.answers else KeyError(1)
            if isinstance(answer, BaseException):
                raise answer
            if answer:
                self.groups = {}
            return answer

        def busy(self):
            return bool(self.groups)

    world = World([KeyError(1), KeyError(1), RuntimeError("Ray Client: reset"), [], [(0, 3)]])
    said: list[str] = []
    assert rayserve.keep_polling(world, 0, None, said.append, nap=0.001) == 3  # type: ignore[arg-type]
    assert world.polls == 5 and len(said) == 2, said  # each error once, with its traceback
    assert said[0].startswith("nbdist: launch the driver's poll of its ranks failed (KeyError: 1); they run on"), said
    assert "Traceback (most recent call last)" in said[0] and "raise answer" in said[0], said[0]
    assert "(RuntimeError: Ray Client: reset)" in said[1], said

    stuck = World([])
    with pytest.raises(RuntimeError, match=r"its poll of the ranks failed for 0 s: KeyError: 1"):
        rayserve.keep_polling(stuck, 0, None, said.append, nap=0.001, patience_s=0.05)  # type: ignore[arg-type]
    assert stuck.polls > 1

    monkeypatch.setenv("NBDIST_CLUSTER_DIR", str(tmp_path))
    launcher = raylaunch.RayLauncher()
    launcher.workdir = str(tmp_path)
    assert launcher.why_gone() == ""
    raylaunch.say_ended("the Ray driver that held the world's ranks failed and ended them (RuntimeError: x)")
    assert launcher.why_gone() == "the Ray driver that held the world's ranks failed and ended them (RuntimeError: x)"
    assert oct((tmp_path / raylaunch.ENDED).stat().st_mode & 0o777) == "0o600"
