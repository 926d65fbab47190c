"""--launcher ray's checks that need no Ray cluster (the cluster itself: tests/multinode/test_ray.py)."""

from __future__ import annotations

import pytest

from nbdist.config import StartConfig
from nbdist.errors import ConfigError
from nbdist.launch import ray as raylaunch
from nbdist.launch.registry import launcher_for


def test_ray_versions_outside_the_tested_range_are_named_with_the_fix():
    assert raylaunch.check_version("2.60.0") == ""
    said = raylaunch.check_version("1.13.0")
    assert said.startswith("Ray 1.13.0 is outside the versions --launcher ray is tested with (2.40 up to") and (
        "pip install 'ray[client]>=2.40,<3.0'" in said
    )
    assert raylaunch.check_version("3.1.0")


def test_what_the_ray_cluster_lacks_is_said_against_its_whole_size():
    assert raylaunch.missing({"CPU": 6, "GPU": 0}, {"CPU": 4.0}) == "6 CPU (it has 4)"
    assert raylaunch.missing({"CPU": 2, "GPU": 2}, {"CPU": 4.0, "GPU": 1.0}) == "2 GPU (it has 1)"
    assert raylaunch.missing({"CPU": 4, "GPU": 0}, {"CPU": 4.0}) == ""


def test_ray_options_need_the_ray_launcher_and_sane_values():
    with pytest.raises(ConfigError, match=r"--address 'ray://h:10001' needs --launcher ray"):
        StartConfig(n=2, address="ray://h:10001")
    with pytest.raises(ConfigError, match=r"--gpus-per-rank \(-1\) must be from 0 to 8"):
        StartConfig(n=2, launcher="ray", gpus_per_rank=-1)
    config = StartConfig(n=4, launcher="ray", address="ray://10.0.0.7:10001", gpus_per_rank=1)
    launcher = launcher_for(config)
    assert isinstance(launcher, raylaunch.RayLauncher)
    assert launcher.node_addresses(config) == ["10.0.0.7"]  # the controller binds the interface that reaches it
    assert launcher.node_addresses(StartConfig(n=2, launcher="ray", address="10.0.0.8:6379")) == ["10.0.0.8"]
