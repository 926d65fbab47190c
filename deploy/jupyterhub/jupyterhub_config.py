"""JupyterHub on a Slurm cluster for nbdist notebooks: batchspawner's SlurmSpawner behind
wrapspawner's ProfilesSpawner. docs/jupyterhub.md explains every choice.

tests/hub/test_jupyterhub.py runs a real hub with this file (on the two-node test Slurm; it
adds only what a test needs: ports, a dummy authenticator, SLURM_CONF) and checks every profile
below. Site-specific values come from the environment so that this file stays as it is:

    NBDIST_HUB_CLUSTER_IP   this host's address on the network the compute nodes reach it by
    NBDIST_GPU_PARTITION    the partition with GPU nodes (default: gpu)
    NBDIST_NOTEBOOK_BIN     bin/ of the notebook environment on the shared filesystem: python with
                            torch and nbdist, jupyterhub-singleuser, batchspawner-singleuser
                            (default: the hub's own environment)
"""

import os
import sys

import batchspawner  # noqa: F401  (registers /hub/api/batchspawner, where the server reports its port)

c = get_config()  # type: ignore[name-defined]  # noqa: F821 (JupyterHub provides it)

# ---------------------------------------------------------------- the hub, seen from the nodes
# The single-user server runs on a compute node and calls the hub's API from there:
# listen on the cluster network (not every interface) and tell the servers that address.
cluster_ip = os.environ.get("NBDIST_HUB_CLUSTER_IP", "")
if cluster_ip:
    c.JupyterHub.hub_ip = cluster_ip
    c.JupyterHub.hub_connect_ip = cluster_ip

# ---------------------------------------------------------------- spawning on Slurm
c.JupyterHub.spawner_class = "wrapspawner.ProfilesSpawner"
c.Spawner.start_timeout = 600  # a job may wait in the queue
c.Spawner.http_timeout = 120  # from RUNNING to the server answering (imports on a cold node)
c.Spawner.default_url = "/lab"

# sudo (batchspawner runs sbatch as the user through it) resets PATH to its secure_path, and the
# job inherits sbatch's environment: put the notebook environment first again inside the job.
notebook_bin = os.environ.get("NBDIST_NOTEBOOK_BIN") or os.path.dirname(sys.executable)
c.BatchSpawnerBase.req_prologue = f'export PATH="{notebook_bin}:$PATH"'

GPU_PARTITION = os.environ.get("NBDIST_GPU_PARTITION", "gpu")
SLURM = "batchspawner.SlurmSpawner"


def slurm_profile(nodes: int, tasks_per_node: int, gpus_per_node: int = 0, **extra: str) -> dict:
    """SlurmSpawner settings for one job shape.

    - the server runs in the batch step on the first node (req_srun=""): batchspawner's default
      ``srun`` would start one server per task, and nbdist puts the ranks on every node with
      its own ``srun --overlap`` step;
    - one task per GPU (``--ntasks-per-node`` = ``--gpus-per-node``), so %dist_start with no
      arguments starts one rank per GPU on every node; ``--gpus-per-node``, never ``--gpus=N``,
      which Slurm may spread unevenly over the nodes.
    """
    options = f"--nodes={nodes} --ntasks-per-node={tasks_per_node}"
    if gpus_per_node:
        options += f" --gpus-per-node={gpus_per_node}"
    return dict(req_srun="", req_options=options, **extra)


c.ProfilesSpawner.profiles = [
    # (label shown to the user, key, spawner, its settings)
    ("CPU: 2 nodes x 1 task, 1 hour", "cpu-2x1", SLURM, slurm_profile(2, 1, req_runtime="1:00:00", req_memory="1G")),
    (
        "1 GPU node, 4 GPUs, 4 hours",
        "gpu-1x4",
        SLURM,
        slurm_profile(
            1, 4, 4, req_partition=GPU_PARTITION, req_runtime="4:00:00", req_memory="128G", req_nprocs="8"
        ),
    ),
    (
        "2 GPU nodes, 4 GPUs each, 4 hours",
        "gpu-2x4",
        SLURM,
        slurm_profile(
            2, 4, 4, req_partition=GPU_PARTITION, req_runtime="4:00:00", req_memory="128G", req_nprocs="8"
        ),
    ),
]
