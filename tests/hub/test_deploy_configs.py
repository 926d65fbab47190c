"""The deployment files docs/jupyterhub.md shows, checked as a site would use them.

deploy/jupyterhub/jupyterhub_config.py also runs for real in test_jupyterhub.py (its CPU profile);
here every profile's batch script is rendered with batchspawner's own template and checked for the
traps the guide names. deploy/kubernetes/z2jh-values.yaml is parsed and checked the same way, and
nbdist's no-argument choice is worked out for the pod its GPU profile makes.
"""

from __future__ import annotations

import re
import socket

import pytest
import yaml

from nbdist.launch import defaults, gpus
from tests.hubsetup import DEPLOY_CONFIG, ROOT

batchspawner = pytest.importorskip("batchspawner", reason="batchspawner is a dev dependency (pip install -e '.[dev]')")


def _load_hub_config(monkeypatch) -> object:
    from traitlets.config.loader import PyFileConfigLoader

    monkeypatch.setenv("NBDIST_GPU_PARTITION", "a100")
    loader = PyFileConfigLoader(DEPLOY_CONFIG.name, path=str(DEPLOY_CONFIG.parent))
    return loader.load_config()


def _batch_script(config, profile: dict) -> str:
    from batchspawner import SlurmSpawner
    from batchspawner.batchspawner import format_template

    subvars = {
        name[4:]: trait.default_value for name, trait in SlurmSpawner.class_traits().items() if name.startswith("req_")
    }
    subvars.update(prologue=config.BatchSpawnerBase.req_prologue, homedir="/home/ada", keepvars="PATH", username="ada")
    subvars.update({k[4:]: v for k, v in profile.items() if k.startswith("req_")})
    subvars["cmd"] = "batchspawner-singleuser jupyterhub-singleuser"
    return format_template(SlurmSpawner.batch_script.default_value, **subvars)


def test_every_slurm_profile_runs_one_server_and_one_task_per_gpu(monkeypatch):
    config = _load_hub_config(monkeypatch)
    assert config.JupyterHub.spawner_class == "wrapspawner.ProfilesSpawner"
    profiles = config.ProfilesSpawner.profiles
    assert {key for _, key, _, _ in profiles} == {"cpu-2x1", "gpu-1x4", "gpu-2x4"}
    for label, key, spawner, settings in profiles:
        assert spawner == "batchspawner.SlurmSpawner", key
        script = _batch_script(config, settings)
        options = dict(re.findall(r"--([a-z-]+)=(\S+)", script))
        lines = script.splitlines()
        command = lines[next(i for i, line in enumerate(lines) if line.startswith("export PATH=")) + 1]
        # the server starts once, in the batch step (batchspawner's default srun would start one per task)
        assert command == "batchspawner-singleuser jupyterhub-singleuser", (key, command)
        assert "--gpus=" not in script  # a job-wide count may land unevenly on the nodes
        assert int(options["nodes"]) >= 1 and int(options["ntasks-per-node"]) >= 1
        if key.startswith("gpu"):
            assert options["gpus-per-node"] == options["ntasks-per-node"], key  # one task (rank) per GPU
            assert options["partition"] == "a100" and "cpus-per-task" in options and "mem" in options
            assert f"{options['gpus-per-node']} GPUs" in label and f"{options['nodes']} GPU node" in label


def test_the_kubernetes_gpu_profile_gives_the_pod_gpus_and_a_real_dev_shm(monkeypatch):
    values = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "z2jh-values.yaml").read_text())
    single = values["singleuser"]
    gpu_profiles = [p for p in single["profileList"] if "extra_resource_limits" in p["kubespawner_override"]]
    assert gpu_profiles
    for profile in gpu_profiles:
        count = int(profile["kubespawner_override"]["extra_resource_limits"]["nvidia.com/gpu"])
        assert count >= 1 and f"{count} GPUs" in profile["display_name"]
        # the device plugin shows the pod its GPUs through nvidia-smi; nbdist starts one rank per GPU
        smi = "".join(f"GPU {i}: NVIDIA A100-SXM4-80GB (UUID: GPU-{i:04d})\n" for i in range(count))
        monkeypatch.setattr(gpus, "_nvidia_smi", lambda smi=smi: smi)
        choice = defaults.choose(None, None, env={})  # no Slurm, no CUDA_VISIBLE_DEVICES: as in the pod
        assert (choice.n, choice.launcher) == (count, "local")
        assert choice.line("nccl").endswith(
            f"GPUs visible on {socket.gethostname().split('.')[0]} (nvidia-smi -L); backend nccl"
        )
    shm = [v for v in single["storage"]["extraVolumes"] if v["name"] == "shm"]
    assert shm and shm[0]["emptyDir"]["medium"] == "Memory" and shm[0]["emptyDir"]["sizeLimit"]
    mounts = {m["name"]: m["mountPath"] for m in single["storage"]["extraVolumeMounts"]}
    assert mounts["shm"] == "/dev/shm"
