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


# ------------------------------------------------------------ the KubeRay cluster and the hub values that reach it

KUBE = ROOT / "deploy" / "kubernetes"


def _validate(obj: dict) -> None:
    """Kubernetes' own schema for ``obj`` (strict: an unknown or misspelt field fails), bundled with
    kubernetes-validate for the newest Kubernetes it knows: no cluster, no network."""
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is a dev dependency")
    kv.validate(obj, kv.latest_version(), strict=True)


def _kube_docs() -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all((KUBE / "raycluster.yaml").read_text()) if d}


def _pod(name: str, spec: dict) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def test_the_raycluster_manifest_is_valid_kubernetes():
    """Every core object validates as is. KubeRay's own schema (its CRD) is not on the registries this project
    reaches, so the RayCluster's pod templates, which are core PodTemplateSpecs, are validated as Pods, and its
    own fields are held to the RayCluster v1 fields this manifest uses."""
    docs = _kube_docs()
    assert set(docs) == {"PersistentVolumeClaim", "RayCluster", "NetworkPolicy"}
    for kind in ("PersistentVolumeClaim", "NetworkPolicy"):
        _validate(docs[kind])
    ray = docs["RayCluster"]
    assert ray["apiVersion"] == "ray.io/v1"
    spec = ray["spec"]
    assert set(spec) <= {"rayVersion", "headGroupSpec", "workerGroupSpecs", "enableInTreeAutoscaling"}
    assert set(spec["headGroupSpec"]) <= {"serviceType", "rayStartParams", "template"}
    groups = spec["workerGroupSpecs"]
    for group in groups:
        assert set(group) <= {"groupName", "replicas", "minReplicas", "maxReplicas", "rayStartParams", "template"}
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    for name, group in [("head", spec["headGroupSpec"])] + [(g["groupName"], g) for g in groups]:
        assert all(isinstance(v, str) for v in group["rayStartParams"].values()), name  # KubeRay wants strings
        _validate(_pod(f"nbdist-ray-{name}", group["template"]["spec"]))


def test_the_hub_values_and_the_raycluster_name_the_same_things():
    """What must agree for ``%dist_start --launcher ray`` in a Z2JH notebook to reach the cluster and its ranks to
    reach back: the head's service and port, the labels the policies select, the Ray version, the GPUs per pod,
    the worlds' directory at the same path on both sides; and the overlay keeps the base's /dev/shm."""
    from nbdist.config import StartConfig
    from nbdist.launch.launchers import launcher_for
    from nbdist.launch.ray import check_version

    docs = _kube_docs()
    ray, policy, claim = docs["RayCluster"], docs["NetworkPolicy"], docs["PersistentVolumeClaim"]
    name, spec = ray["metadata"]["name"], ray["spec"]
    overlay = yaml.safe_load((KUBE / "z2jh-ray-values.yaml").read_text())["singleuser"]
    base = yaml.safe_load((KUBE / "z2jh-values.yaml").read_text())["singleuser"]

    # the overlay's parts are valid Kubernetes where they land (env, volumes and mounts in the pod, the rules
    # in the chart's singleuser NetworkPolicy)
    env = [{"name": k, "value": v} for k, v in overlay["extraEnv"].items()]
    container = {"name": "notebook", "image": "x", "env": env, "volumeMounts": overlay["storage"]["extraVolumeMounts"]}
    _validate(_pod("jupyter-ada", {"containers": [container], "volumes": overlay["storage"]["extraVolumes"]}))
    rules = overlay["networkPolicy"]
    _validate(
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "singleuser"},
            "spec": {"podSelector": {}, "policyTypes": ["Ingress", "Egress"], **rules},
        }
    )

    # the notebook names the head's service and its Ray Client port, the one the head listens on
    address = overlay["extraEnv"]["RAY_ADDRESS"]
    config = StartConfig.of(launcher="ray", address=address)
    assert launcher_for(config).node_addresses(config) == [f"{name}-head-svc"]
    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    client = next(p["containerPort"] for p in head["ports"] if p["name"] == "client")
    assert address == f"ray://{name}-head-svc:{client}"
    assert check_version(spec["rayVersion"]) == ""  # a Ray nbdist takes
    base_image = f"{base['image']['name']}:{base['image']['tag']}"
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        image = group["template"]["spec"]["containers"][0]["image"]
        assert image == base_image  # the notebooks' image: Ray Client needs the same Ray and Python

    # the policies select what KubeRay and Z2JH label their pods with, and open the client port both ways
    cluster_pods = {"ray.io/cluster": name}
    assert policy["spec"]["podSelector"]["matchLabels"] == cluster_pods
    froms = [r["from"][0]["podSelector"]["matchLabels"] for r in policy["spec"]["ingress"]]
    assert cluster_pods in froms and {"component": "singleuser-server"} in froms
    notebook_rule = next(r for r in policy["spec"]["ingress"] if r["from"][0]["podSelector"]["matchLabels"] != cluster_pods)
    assert [p["port"] for p in notebook_rule["ports"]] == [client]
    assert rules["ingress"][0]["from"][0]["podSelector"]["matchLabels"] == cluster_pods  # engines -> controller
    assert rules["egress"][0]["to"][0]["podSelector"]["matchLabels"] == cluster_pods
    assert [p["port"] for p in rules["egress"][0]["ports"]] == [client]

    # GPUs: Ray's count per worker pod is the pod's own
    for group in spec["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        limits = pod["containers"][0]["resources"]["limits"]
        assert group["rayStartParams"]["num-gpus"] == limits["nvidia.com/gpu"]
        mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["shm"]["emptyDir"]["medium"] == "Memory" and mounts["shm"] == "/dev/shm"
        # the worlds: the same claim, and the notebook's directory at the same path inside the Ray pods' mount
        assert volumes["worlds"]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
        workdir = overlay["extraEnv"]["NBDIST_WORKDIR"].replace("{username}", "ada")
        notebook_mount = next(m for m in overlay["storage"]["extraVolumeMounts"] if m["name"] == "worlds")
        assert workdir == notebook_mount["mountPath"].replace("{username}", "ada")
        assert workdir.startswith(mounts["worlds"] + "/")
        assert workdir[len(mounts["worlds"]) + 1 :] == notebook_mount["subPath"].replace("{username}", "ada")
    notebook_claim = next(v for v in overlay["storage"]["extraVolumes"] if v["name"] == "worlds")
    assert notebook_claim["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert "ReadWriteMany" in claim["spec"]["accessModes"]

    # Helm replaces lists: the overlay gives the base's volumes and mounts again
    for key in ("extraVolumes", "extraVolumeMounts"):
        for item in base["storage"][key]:
            assert item in overlay["storage"][key], (key, item)
