"""The pure parts of the multi-node launchers: options, allocations, ranks per node, addresses, the batch script."""

from __future__ import annotations

import socket

import pytest

from nbdist.config import StartConfig
from nbdist.errors import ConfigError
from nbdist.launch import defaults, gpus, net, slurm
from nbdist.launch.hosts import batch_script
from nbdist.world.rendezvous import plan_local_ranks, plan_node_ranks


@pytest.mark.parametrize(
    "options, message",
    [
        ({"launcher": "local", "ip": "10.0.0.1"}, "--ip 10.0.0.1 is for launchers on several hosts"),
        (
            {"launcher": "local", "partition": "gpu"},
            "--partition 'gpu' needs --launcher slurm (sbatch a job); this is 'local'",
        ),
        ({"launcher": "mpi", "time": "10"}, "--time '10' needs --launcher slurm"),
        ({"launcher": "srun", "sbatch_args": ["--mem=1G"]}, "--sbatch-arg"),
        ({"launcher": "slurm", "mpi_args": ["-x"]}, "--mpi-arg ['-x'] needs --launcher mpi"),
        ({"launcher": "local", "nodes": 2}, "--nodes 2 needs --launcher slurm (sbatch a job) or --launcher srun"),
        ({"launcher": "slurm", "nodes": 3}, "--nodes 3 must be between 1 and the number of ranks (2)"),
        ({"launcher": "slurm", "gpus_per_node": -1}, "--gpus-per-node (-1) must be 0 or more"),
        ({"launcher": "sluurm"}, "did you mean 'slurm'?"),
    ],
)
def test_options_for_several_hosts_name_their_launcher(options, message):
    with pytest.raises(ConfigError) as info:
        StartConfig.of(n=2, **options)
    assert message in str(info.value)


def test_many_ranks_on_few_nodes_are_not_refused_for_this_hosts_cores():
    cfg = StartConfig.of(n=64, launcher="slurm", nodes=8, cores=16)
    assert cfg.world.threads == 2  # 8 ranks per node share its 16 cores


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
    assert alloc.ranks() == 4 and alloc.describe() == "4 tasks allocated on gpu1 (Slurm job 42)"
    # scontrol does not know job 42 here: every node is taken to have what this one has
    gpus = slurm.allocation(dict(env, SLURM_GPUS_ON_NODE="2"))
    assert gpus is not None and gpus.gpus == (2,) and gpus.ranks() == 2
    assert gpus.describe() == "2 GPUs allocated on gpu1 (Slurm job 42)"


SCONTROL_D = """JobId=7 JobName=spawner-jupyterhub
   NumNodes=3 NumCPUs=3 NumTasks=3 CPUs/Task=1 ReqB:S:C:T=0:0:*:*
     Nodes=gpu[1-2] CPU_IDs=0 Mem=0 GRES=gpu:a100:4(IDX:0-3)
     Nodes=gpu3 CPU_IDs=0 Mem=0 GRES=gpu:2(IDX:0-1),gres/shard:0
   MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0
"""


def test_gpus_per_node_come_from_scontrol_detail_lines():
    expand = {"gpu[1-2]": ["gpu1", "gpu2"], "gpu3": ["gpu3"]}.__getitem__
    assert slurm.parse_node_gpus(SCONTROL_D, expand) == {"gpu1": 4, "gpu2": 4, "gpu3": 2}
    assert slurm.parse_node_gpus("JobId=8\n     Nodes=c1 CPU_IDs=0 Mem=0 GRES=\n", lambda s: [s]) == {"c1": 0}
    uneven = slurm.Allocation("7", 3, ("gpu1", "gpu2", "gpu3"), (4, 4, 2))
    assert uneven.ranks() == 10 and uneven.gpus_per_node() == 0
    assert slurm.Allocation("7", 2, ("a", "b"), (2, 2)).gpus_per_node() == 2


def test_visible_gpus_without_touching_cuda():
    assert gpus.parse_visible("0,1,2") == ["0", "1", "2"]
    assert gpus.parse_visible("1,-1,2") == ["1"]  # CUDA stops at the first invalid id
    assert gpus.parse_visible("") == [] and gpus.parse_visible("NoDevFiles") == []
    smi = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1a2b)\nGPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-3c4d)\n"
    assert gpus.parse_nvidia_smi(smi) == ["0", "1"]
    mig = "GPU 0: NVIDIA A100 (UUID: GPU-1)\n  MIG 3g.20gb     Device  0: (UUID: MIG-aa)\n  MIG 3g.20gb     Device  1: (UUID: MIG-bb)\n"
    assert gpus.parse_nvidia_smi(mig) == ["MIG-aa", "MIG-bb"]
    assert gpus.visible({"CUDA_VISIBLE_DEVICES": "2,3"}) == (["2", "3"], "CUDA_VISIBLE_DEVICES")


def test_inside_an_allocation_no_n_means_the_allocation_through_srun(monkeypatch):
    env = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "3", "SLURM_JOB_NODELIST": "n1"}
    choice = defaults.choose(None, None, env)
    assert (choice.n, choice.launcher, choice.gpus) == (3, "srun", 0)
    assert (
        choice.line("gloo")
        == "3 ranks = 3 tasks allocated on n1 (Slurm job 7); engines via srun --overlap; backend gloo"
    )
    assert defaults.choose(2, None, env) == defaults.Choice(2, "local")  # -n keeps the laptop behaviour
    assert defaults.choose(None, None, {"CUDA_VISIBLE_DEVICES": ""}) == defaults.Choice(2, "local")
    assert defaults.choose(None, None, {"CUDA_VISIBLE_DEVICES": "0"}) == defaults.Choice(2, "local")


def test_with_gpus_one_rank_per_gpu_and_the_line_says_why(monkeypatch):
    pod = defaults.choose(None, None, {"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    assert (pod.n, pod.launcher, pod.gpus) == (4, "local", 4)
    assert pod.line("nccl").startswith("4 ranks = 4 GPUs visible on ") and pod.line("nccl").endswith(
        "(CUDA_VISIBLE_DEVICES); backend nccl"
    )
    assert "the ranks see no CUDA device of their own: is torch a CPU build?" in pod.line("gloo")
    monkeypatch.setattr(slurm, "node_gpus", lambda job: {"g1": 2, "g2": 2})
    env = {"SLURM_JOB_ID": "9", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "g1", "SLURM_GPUS_ON_NODE": "2"}
    monkeypatch.setattr(slurm, "hostnames", lambda nodelist: ["g1", "g2"])
    job = defaults.choose(None, None, env)
    assert (job.n, job.launcher, job.gpus, job.ranks_per_node) == (4, "srun", 4, 2)
    assert job.line("nccl") == (
        "4 ranks = 4 GPUs allocated on g1,g2 (Slurm job 9); engines via srun --overlap; backend nccl"
    )
    monkeypatch.setattr(slurm, "node_gpus", lambda job: {"g1": 3, "g2": 1})
    uneven = defaults.choose(None, None, env)
    assert (uneven.n, uneven.ranks_per_node) == (4, 0) and "uneven GPUs per node: 3+1" in uneven.why


def test_srun_places_ranks_per_node_with_overcommit():
    from nbdist.launch.hosts import _engine_launchers

    steps = _engine_launchers()[1](n=4, mpi_cmd=["srun"], mpi_args=["--overlap"], ranks_per_node=2)
    args = steps.find_args()
    assert args[:6] == ["srun", "--nodes=2", "--ntasks-per-node=2", "--distribution=block", "--overcommit", "-n"]
    with pytest.raises(ConfigError, match="--ranks-per-node 2 needs --launcher srun .*; this is .local."):
        StartConfig.of(n=2, ranks_per_node=2)


def test_the_batch_script_carries_every_option_and_runs_engines_through_srun():
    cfg = StartConfig.of(
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
    one = batch_script(StartConfig.of(n=1, launcher="slurm", nodes=1))
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
    from nbdist.engine import group, runtime

    addr = next((ip for ip in net.interfaces().values() if not ip.startswith("127.")), None)
    if addr is None:
        pytest.skip("this host has no address but loopback")
    with socket.socket() as sock:
        sock.bind((addr, 0))
        port = sock.getsockname()[1]  # bound, not listening: refused
        old = runtime.STATE.values()
        runtime.STATE.update(rank=1, world_size=2, store=None)
        try:
            with pytest.raises(ConnectionError) as info:
                group.join_world(master_addr=addr, port=port, backend="gloo", timeout=2, pg_timeout=10)
        finally:
            runtime.STATE.update(**old)
    text = str(info.value)
    assert "\n" not in text
    assert f"cannot reach MASTER_ADDR {addr}:{port} (" in text and "refused" in text.lower()
    assert "--ip" in text


def test_one_list_of_launchers_names_each_class_the_checks_and_the_help():
    """config/launchers.py is the one list: a class per entry, each carrying its spec; StartConfig takes each
    launcher's options from its class, and %dist_start's flags and help from the same list."""
    from nbdist.config import launchers
    from nbdist.config.launchers import options_of
    from nbdist.launch.launchers import launcher_for
    from nbdist.magics import DistMagics
    from nbdist.magics.common import with_launcher_options

    specs = launchers.known()
    assert set(specs) >= {"local", "slurm", "srun", "mpi", "ray"}
    for name, spec in specs.items():
        launcher = launcher_for(StartConfig.of(n=1, launcher=name))
        assert launcher.spec is spec and launcher.name == name
    help_text = " ".join(with_launcher_options(DistMagics.dist_start).parser.format_help().split())
    for spec in specs.values():
        assert spec.name in help_text and spec.summary in help_text
        for opt in options_of(spec.options):
            assert opt.flag in help_text and opt.help in help_text, opt
    assert "--nodes K nodes to spread the ranks over (slurm, srun)" in help_text
