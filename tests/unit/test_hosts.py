"""The pure parts of the multi-node launchers: options, allocations, ranks per node, addresses, the batch script."""

from __future__ import annotations

import socket

import pytest

from nbdist import net, slurm
from nbdist.config import StartConfig
from nbdist.errors import ConfigError
from nbdist.hosts import batch_script, default_launch
from nbdist.rendezvous import plan_local_ranks, plan_node_ranks


@pytest.mark.parametrize(
    "options, message",
    [
        ({"launcher": "local", "ip": "10.0.0.1"}, "--ip 10.0.0.1 is for launchers on several hosts"),
        ({"launcher": "local", "partition": "gpu"}, "--partition 'gpu' is an sbatch option; it needs --launcher slurm"),
        ({"launcher": "mpi", "time": "10"}, "--time '10' is an sbatch option"),
        ({"launcher": "srun", "sbatch_args": ["--mem=1G"]}, "--sbatch-arg"),
        ({"launcher": "slurm", "mpi_args": ["-x"]}, "--mpi-arg ['-x'] needs --launcher mpi"),
        ({"launcher": "local", "nodes": 2}, "--nodes 2 needs --launcher slurm or srun"),
        ({"launcher": "slurm", "nodes": 3}, "--nodes 3 must be between 1 and the number of ranks (2)"),
        ({"launcher": "slurm", "gpus_per_node": -1}, "--gpus-per-node (-1) must be 0 or more"),
        ({"launcher": "sluurm"}, "did you mean 'slurm'?"),
    ],
)
def test_options_for_several_hosts_name_their_launcher(options, message):
    with pytest.raises(ConfigError) as info:
        StartConfig(n=2, **options)
    assert message in str(info.value)


def test_many_ranks_on_few_nodes_are_not_refused_for_this_hosts_cores():
    cfg = StartConfig(n=64, launcher="slurm", nodes=8, cores=16)
    assert cfg.threads == 2  # 8 ranks per node share its 16 cores


def test_node_and_local_ranks_follow_slurms_block_and_cyclic_layouts():
    block = ["a", "a", "b", "b"]
    assert plan_node_ranks(block) == [0, 0, 1, 1]
    assert plan_local_ranks(block) == [(0, 2), (1, 2), (0, 2), (1, 2)]
    cyclic = ["a", "b", "a", "b"]  # srun --distribution=cyclic: SLURM_LOCALID 0, 0, 1, 1
    assert plan_node_ranks(cyclic) == [0, 1, 0, 1]
    assert [lr for lr, _ in plan_local_ranks(cyclic)] == [0, 0, 1, 1]


def test_an_allocation_is_read_from_slurms_environment():
    assert slurm.allocation({}) is None
    env = {"SLURM_JOB_ID": "42", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "gpu1"}
    alloc = slurm.allocation(env)
    assert alloc is not None and (alloc.job_id, alloc.ntasks, alloc.nodes) == ("42", 4, ("gpu1",))
    assert alloc.ranks() == 4
    gpus = slurm.allocation(dict(env, SLURM_GPUS_ON_NODE="2"))
    assert gpus is not None and gpus.ranks() == 2 and "2 GPU(s) per node" in gpus.describe()


def test_inside_an_allocation_no_n_means_the_allocation_through_srun(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_NTASKS", "3")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n1")
    monkeypatch.delenv("SLURM_STEP_NUM_TASKS", raising=False)
    n, launcher, why = default_launch(None, None)
    assert (n, launcher) == (3, "srun") and why.startswith("3 ranks = Slurm job 7")
    assert default_launch(2, None) == (2, "local", "")  # -n keeps the laptop behaviour
    monkeypatch.delenv("SLURM_JOB_ID")
    assert default_launch(None, None) == (2, "local", "")


def test_the_batch_script_carries_every_option_and_runs_engines_through_srun():
    cfg = StartConfig(
        n=4,
        launcher="slurm",
        nodes=2,
        partition="gpu",
        time="30",
        account="proj",
        gpus_per_node=2,
        sbatch_args=["--mem=8G"],
    )
    text = batch_script(cfg)
    for line in (
        "#SBATCH --ntasks=4",
        "#SBATCH --nodes=2",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=30",
        "#SBATCH --account=proj",
        "#SBATCH --gpus-per-node=2",
        "#SBATCH --mem=8G",
    ):
        assert line in text.splitlines(), line
    assert "exec srun --kill-on-bad-exit=0" in text and "-m nbdist.engine" in text
    assert "--IPEngine.max_heartbeat_misses=" in text
    # a restart of one rank asks for one node, not two
    one = batch_script(StartConfig(n=1, launcher="slurm", nodes=1))
    assert "#SBATCH --nodes=1" in one


def test_addresses_on_this_host():
    assert net.route_source("127.0.0.1") == "127.0.0.1"
    assert net.interface_of("127.0.0.1") == "lo"
    assert net.is_local("127.0.0.1") and not net.is_local("192.0.2.1")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: refused
        reason = net.connect_error("127.0.0.1", port, timeout=2)
    assert "refused" in reason.lower()
    assert "loopback" in net.likely_fix(reason)
    assert "wrong interface" in net.likely_fix("Network is unreachable")


def test_a_rank_that_cannot_reach_master_addr_says_so_in_one_line():
    from nbdist.engine import runtime

    addr = next((ip for ip in net.interfaces().values() if not ip.startswith("127.")), None)
    if addr is None:
        pytest.skip("this host has no address but loopback")
    with socket.socket() as sock:
        sock.bind((addr, 0))
        port = sock.getsockname()[1]  # bound, not listening: refused
        old = dict(runtime.STATE)
        runtime.STATE.update(rank=1, world_size=2, store=None)
        try:
            with pytest.raises(ConnectionError) as info:
                runtime.join_world(master_addr=addr, port=port, backend="gloo", timeout=2, pg_timeout=10)
        finally:
            runtime.STATE.clear()
            runtime.STATE.update(old)
    text = str(info.value)
    assert "\n" not in text
    assert f"cannot reach MASTER_ADDR {addr}:{port} (" in text and "refused" in text.lower()
    assert "--ip" in text
