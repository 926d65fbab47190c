"""A launcher is one file: a package adds one through the ``nbdist.launchers`` entry point group, touching no
other launcher, and ``nbdist.start(launcher=...)`` and ``%dist_start --launcher`` start a real 2-rank world with it.

The launcher here ("cold") starts every engine as a fresh process with ipyparallel's own local engine-set
launcher (no warm fork), on nbdist's ``build_cluster``; it is installed as a real distribution's metadata
(a ``.dist-info`` with ``entry_points.txt``) on ``sys.path``, found by ``importlib.metadata`` as pip's would be.
Time bounds only catch hangs.
"""

from __future__ import annotations

import logging
import sys
import textwrap

import pytest

import nbdist
from nbdist.config import LAUNCHERS
from nbdist.errors import ConfigError
from nbdist.launch import registry
from tests.helpers import run_cell

PLUGIN = '''
"""nbdist_cold: every rank a fresh engine process on this machine (no warm fork): a launcher in one file."""
from ipyparallel.cluster.launcher import LocalEngineSetLauncher

from nbdist.config import LauncherSpec
from nbdist.launch.launchers import Launcher, build_cluster
from nbdist.launch.net import LOOPBACK


class ColdLauncher(Launcher):
    spec = LauncherSpec("cold", "every rank a fresh engine process on this machine", multi_host=False)

    def cluster(self, config, profile_dir, fresh=True):
        cluster, engines = build_cluster(
            config, profile_dir, fresh=fresh, ip=LOOPBACK, engines=LocalEngineSetLauncher,
            engine_args=["--IPEngine.enable_nanny=False"],
        )
        engines.delay = 0.0
        return cluster


class Broken:
    """Not a launcher: loading it is said in one warning, and the others work."""
'''


@pytest.fixture
def installed(tmp_path):
    """The plugin as an installed distribution: its module and its metadata on sys.path."""
    (tmp_path / "nbdist_cold.py").write_text(textwrap.dedent(PLUGIN))
    meta = tmp_path / "nbdist_cold-0.1.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: nbdist-cold\nVersion: 0.1\n")
    (meta / "entry_points.txt").write_text(
        "[nbdist.launchers]\ncold = nbdist_cold:ColdLauncher\nbroken = nbdist_cold:Broken\n"
    )
    sys.path.insert(0, str(tmp_path))
    before = dict(LAUNCHERS), dict(registry.LAUNCHER_CLASSES)
    try:
        yield
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("nbdist_cold", None)
        LAUNCHERS.clear()
        LAUNCHERS.update(before[0])
        registry.LAUNCHER_CLASSES.clear()
        registry.LAUNCHER_CLASSES.update(before[1])


def test_a_launcher_from_one_file_and_its_entry_point_starts_a_real_world(installed, ip, caplog, capsys):
    assert "cold" not in LAUNCHERS
    with caplog.at_level(logging.WARNING, logger="nbdist"):
        registry.load()
    assert "cold" in LAUNCHERS and registry.LAUNCHER_CLASSES["cold"].__module__ == "nbdist_cold"
    assert "the launcher 'broken' (nbdist_cold:Broken) was not loaded" in caplog.text and "broken" not in LAUNCHERS
    with nbdist.start(n=2, launcher="cold", timeout=60) as cluster:
        result = cluster.run("t = torch.ones(1) * (dist.get_rank() + 1)\ndist.all_reduce(t)\nx = t.item()")
        result.raise_for_error()
        assert cluster.pull("x") == [3.0, 3.0]
        assert all("nbdist.engine.warm" not in _parent(r.pid) for r in cluster.ranks)  # fresh, not forked
    # the magic takes it like nbdist's own
    run_cell(ip, "%dist_start -n 2 --launcher cold")
    try:
        run_cell(ip, "%%distributed\nt = torch.ones(1)\ndist.all_reduce(t)\nprint('sum', t.item())")
        assert "sum 2.0" in capsys.readouterr().out
    finally:
        run_cell(ip, "%dist_stop")


def test_a_second_launcher_of_the_same_name_is_refused_in_one_line(installed):
    registry.load()

    class Twin(registry.LAUNCHER_CLASSES["cold"]):  # type: ignore[misc, valid-type]
        pass

    with pytest.raises(ConfigError, match=r"two launchers are named 'cold' \(nbdist_cold.ColdLauncher and .*Twin\)"):
        registry.register(Twin)
    with pytest.raises(ConfigError, match="is not a launcher: subclass nbdist.launch.launchers.Launcher"):
        registry.register(int)  # type: ignore[arg-type]


def _parent(pid: int) -> str:
    import psutil

    try:
        return " ".join(psutil.Process(pid).parent().cmdline())
    except Exception:
        return ""
