"""Pure functions: rank specs, configs, env planning, backend choice."""

from __future__ import annotations

import pytest

from nbdist.config import StartConfig, default_threads, did_you_mean, parse_ranks
from nbdist.engine.launched import worker_env, world_env
from nbdist.errors import ConfigError
from nbdist.launch.launchers import LocalLauncher
from nbdist.world.rendezvous import choose_backend, plan_cpus, plan_gpus, plan_local_ranks


@pytest.mark.parametrize(
    "spec, expected",
    [
        (None, [0, 1, 2, 3]),
        ("all", [0, 1, 2, 3]),
        (0, [0]),
        ("0", [0]),
        ("0,2", [0, 2]),
        ("1-3", [1, 2, 3]),
        ("0, 2-3", [0, 2, 3]),
        ("3,1,1", [1, 3]),
        ([2, 0], [0, 2]),
        (range(2), [0, 1]),
    ],
)
def test_parse_ranks_accepts(spec, expected):
    assert parse_ranks(spec, 4) == expected


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("4", "rank 4 is outside this world of 4 rank(s); use ranks 0-3"),
        ("-1", "not a rank spec"),
        ("a", "not a rank spec"),
        ("3-1", "runs backwards; write it as '1-3'"),
        (True, "must be a rank spec"),
        ([], "names no rank"),
    ],
)
def test_parse_ranks_rejects_with_fix(spec, fragment):
    with pytest.raises(ConfigError) as info:
        parse_ranks(spec, 4)
    assert fragment in str(info.value)


def test_start_config_defaults_share_cores():
    cfg = StartConfig.of(n=2, cores=2)
    assert cfg.world.threads == 1
    assert StartConfig.of(n=2, cores=8).world.threads == 4
    assert default_threads(3, 2) == 1


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"n": 4, "cores": 2}, "n (4) is more than this machine's 2 cores; use -n 2, or pass --oversubscribe."),
        ({"n": 0}, "must be at least 1"),
        ({"n": "2"}, "must be a whole number"),
        ({"backend": "glo"}, "did you mean 'gloo'?"),
        ({"launcher": "slurmm"}, "did you mean 'slurm'?"),
        ({"timeout": -1}, "positive number of seconds"),
        ({"heartbeat_ms": 1}, "too small"),
    ],
)
def test_start_config_errors_name_value_and_fix(kwargs, fragment):
    with pytest.raises(ConfigError) as info:
        StartConfig.of(**kwargs)
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"min_ranks": 5, "max_restarts": 1}, "min_ranks (5) must be a whole number from 1 to n (4)"),
        ({"min_ranks": 0, "max_restarts": 1}, "min_ranks (0) must be a whole number from 1 to n (4)"),
        ({"min_ranks": True, "max_restarts": 1}, "min_ranks (True) must be a whole number"),
        ({"min_ranks": 2}, "min_ranks (2) needs max_restarts: going on with fewer ranks is an automatic recovery"),
    ],
)
def test_min_ranks_is_checked_in_one_line(kwargs, fragment):
    with pytest.raises(ConfigError) as info:
        StartConfig.of(n=4, oversubscribe=True, **kwargs)
    assert fragment in str(info.value) and "\n" not in str(info.value)
    assert StartConfig.of(n=4, oversubscribe=True, max_restarts=3, min_ranks=2).recovery.min_ranks == 2


def test_oversubscribe_allows_more_ranks_than_cores():
    assert StartConfig.of(n=4, cores=2, oversubscribe=True).world.threads == 1


def test_did_you_mean_lists_choices_when_nothing_is_close():
    assert did_you_mean("zzz", ("gloo", "nccl")) == "choose one of 'gloo', 'nccl'."


def test_plan_cpus_gives_each_local_rank_its_own_cores():
    assert [plan_cpus([0, 1], r, 2) for r in range(2)] == [[0], [1]]
    assert [plan_cpus(list(range(8)), r, 2) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [plan_cpus([2, 5, 7], r, 2) for r in range(2)] == [[2], [5]]  # a cgroup's cores; one stays free
    assert plan_cpus([0, 1], 2, 3) is None  # more ranks than cores (--oversubscribe): not pinned


def test_plan_local_ranks_groups_by_host():
    assert plan_local_ranks(["a", "a"]) == [(0, 2), (1, 2)]
    assert plan_local_ranks(["a", "b", "a", "b", "b"]) == [(0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]


def test_choose_backend():
    assert choose_backend(None, [None, None]) == "gloo"
    assert choose_backend(None, [0, 1]) == "nccl"
    assert choose_backend(None, [0, None]) == "gloo"
    assert choose_backend("gloo", [0, 1]) == "gloo"
    with pytest.raises(ConfigError, match="rank 1 has none of its own; use --backend gloo"):
        choose_backend("nccl", [0, None])


def test_plan_gpus_binds_local_rank_or_a_tasks_own_single_gpu():
    two = ["GPU-a", "GPU-b"]
    assert plan_gpus(["h", "h"], [0, 1], [two, two]) == [0, 1]  # every rank sees both: LOCAL_RANK
    assert plan_gpus(["h", "h"], [0, 1], [[], []]) == [None, None]  # no CUDA
    assert plan_gpus(["h", "h"], [0, 1], [["GPU-a"], ["GPU-b"]]) == [0, 0]  # srun --gpus-per-task=1
    assert plan_gpus(["h", "h"], [0, 1], [["GPU-a"], ["GPU-a"]]) == [None, None]  # one GPU, two ranks
    assert plan_gpus(["h", "h", "h"], [0, 1, 2], [two, two, two]) == [0, 1, None]  # more ranks than GPUs
    assert plan_gpus(["n1", "n2"], [0, 0], [["GPU-a"], ["GPU-a"]]) == [0, 0]  # same name, other hosts


def test_worker_env_is_torchruns_and_the_local_store_stays_on_loopback():
    """worker_env is what runtime.configure applies (tests/interop reads it back on real ranks, against
    torchrun's own); here its shape: torchrun's names, strings, no agent store."""
    env = worker_env(
        rank=3,
        world_size=4,
        local_rank=1,
        local_world_size=2,
        node_rank=1,
        master_addr="10.0.0.1",
        threads=1,
        max_restarts=2,
    )
    assert env == {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "NODE_RANK": "1",
        "GROUP_WORLD_SIZE": "2",
        "ROLE_RANK": "3",
        "ROLE_WORLD_SIZE": "4",
        "ROLE_NAME": "default",
        "MASTER_ADDR": "10.0.0.1",
        "TORCHELASTIC_RUN_ID": "nbdist",
        "TORCHELASTIC_MAX_RESTARTS": "2",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "OMP_NUM_THREADS": "1",
        "NUMBA_NUM_THREADS": "1",
    }
    assert world_env(master_addr="a", port=5, restarts=1, cpu_only=True) == {
        "MASTER_ADDR": "a",
        "MASTER_PORT": "5",
        "TORCHELASTIC_RESTART_COUNT": "1",
        "ACCELERATE_USE_CPU": "true",
    }
    assert "ACCELERATE_USE_CPU" not in world_env(master_addr="a", port=5, restarts=0, cpu_only=False)
    assert LocalLauncher().master_address("node7") == "127.0.0.1"


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_max_restarts_must_be_a_whole_number_and_the_error_says_how(bad):
    with pytest.raises(
        ConfigError, match=r"max_restarts .* must be a whole number, 0 or more, such as --max-restarts 1"
    ):
        StartConfig.of(n=2, max_restarts=bad)


def test_a_launcher_is_found_by_name_whatever_was_imported_before():
    """No import order matters: a fresh process that imports only the config finds every launcher by name, and
    a launcher's options land in its own section, typed by the class it declared."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from nbdist.config import StartConfig\n"
        "assert not [m for m in sys.modules if m.startswith('nbdist.launch')]\n"
        "c = StartConfig.of(n=2, launcher='ray', address='ray://h:10001', gpus_per_rank=0.5)\n"
        "print(c.launcher, type(c.options).__name__, c.options.address, c.world.n, c.recovery.max_restarts)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ray", "RayOptions", "ray://h:10001", "2", "0"]


def test_flat_keywords_round_trip_through_the_sections():
    """A kept world's record is the flat keywords; StartConfig.of takes them back to the same config."""
    config = StartConfig.of(n=4, launcher="slurm", nodes=2, cores=16, partition="gpu", max_restarts=2, keep="30m")
    assert (config.world.threads, config.world.keep, config.recovery.max_restarts) == (8, 1800.0, 2)
    assert StartConfig.of(**config.flat()) == config
    with pytest.raises(ConfigError, match=r"'nodse' is not an option of nbdist.start; did you mean 'nodes'\?"):
        StartConfig.of(n=2, launcher="slurm", nodse=2)


@pytest.mark.parametrize(("n", "misses"), [(2, 10), (20, 10), (64, 32), (1024, 512)])
def test_the_controller_lets_a_bigger_world_miss_more_heartbeats_before_it_calls_a_rank_dead(tmp_path, n, misses):
    """ipyparallel's HeartMonitor reads max_heartmonitor_misses (not ..._heartbeat_misses, the engine's own)."""
    from ipyparallel.cluster.launcher import LocalEngineSetLauncher
    from ipyparallel.controller.heartmonitor import HeartMonitor

    from nbdist.launch.launchers import build_cluster

    cluster, _ = build_cluster(
        StartConfig.of(n=n, oversubscribe=True), str(tmp_path), fresh=False, ip="127.0.0.1", engines=LocalEngineSetLauncher, engine_args=[]
    )
    assert "max_heartmonitor_misses" in HeartMonitor.class_trait_names()
    assert f"--HeartMonitor.max_heartmonitor_misses={misses}" in cluster.controller_args, cluster.controller_args
    assert "--HeartMonitor.period=100" in cluster.controller_args
