"""A launcher is one file: a package adds one through the ``nbdist.launchers`` entry point group, touching no
other launcher, and ``nbdist.start(launcher=...)`` and ``%dist_start --launcher`` start a real 2-rank world with it.
It brings an option of its own (``--spacing``), which ``%dist_start --help`` lists, ``StartConfig`` checks, and the
launcher reads: nothing in nbdist names it.

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
from nbdist.config import StartConfig, launchers
from nbdist.errors import ConfigError
from tests.helpers import run_cell

PLUGIN = '''
"""nbdist_cold: every rank a fresh engine process on this machine (no warm fork): a launcher in one file."""
from dataclasses import dataclass

from ipyparallel.cluster.launcher import LocalEngineSetLauncher

from nbdist.config import LauncherOptions, LauncherSpec, option
from nbdist.errors import ConfigError
from nbdist.launch.launchers import Launcher, build_cluster
from nbdist.launch.net import LOOPBACK


@dataclass(kw_only=True)
class ColdOptions(LauncherOptions):
    spacing: float = option(0.0, help="seconds between two engines' starts", metavar="S")

    def check(self, n):
        if not 0 <= self.spacing <= 5:
            raise ConfigError(f"--spacing {self.spacing!r} must be from 0 to 5 seconds, e.g. --spacing 0.1.")


class ColdLauncher(Launcher):
    spec = LauncherSpec("cold", "every rank a fresh engine process on this machine", multi_host=False,
                        options=ColdOptions)

    def cluster(self, config, profile_dir, fresh=True):
        cluster, engines = build_cluster(
            config, profile_dir, fresh=fresh, ip=LOOPBACK, engines=LocalEngineSetLauncher,
            engine_args=["--IPEngine.enable_nanny=False"],
        )
        engines.delay = config.options_as(ColdOptions).spacing
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
    launchers.known()  # nbdist's own, looked up before the package is installed
    sys.path.insert(0, str(tmp_path))
    try:
        yield
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("nbdist_cold", None)
        launchers.forget("cold")


def test_a_launcher_from_one_file_and_its_entry_point_starts_a_real_world(installed, ip, caplog, capsys):
    assert "cold" not in launchers.known()  # nbdist's own were loaded before the package was installed
    with caplog.at_level(logging.WARNING, logger="nbdist"):
        config = StartConfig.of(n=2, launcher="cold", spacing=0.2)  # a name not known yet: looked for again
    assert launchers.launcher_class("cold").__module__ == "nbdist_cold" and config.options.spacing == 0.2
    assert "the launcher 'broken' (nbdist_cold:Broken) was not loaded" in caplog.text
    assert "broken" not in launchers.known()
    # its option is checked by it, and refused to the other launchers by name
    with pytest.raises(ConfigError, match=r"--spacing 9.0 must be from 0 to 5 seconds"):
        StartConfig.of(n=2, launcher="cold", spacing=9.0)
    with pytest.raises(
        ConfigError, match=r"--spacing 0.5 needs --launcher cold \(every rank a fresh .*\); this is 'local'"
    ):
        StartConfig.of(n=2, spacing=0.5)
    # %dist_start --help lists it with its help and the launcher that takes it, and starts nothing
    run_cell(ip, "%dist_start --help")
    shown = " ".join(capsys.readouterr().out.split())
    assert "--spacing S seconds between two engines' starts (cold)" in shown
    assert "--launcher" in shown and "cold (every rank a fresh engine process on this machine)" in shown
    with nbdist.start(n=2, launcher="cold", timeout=60, spacing=0.2) as cluster:
        result = cluster.run("t = torch.ones(1) * (dist.get_rank() + 1)\ndist.all_reduce(t)\nx = t.item()")
        result.raise_for_error()
        assert cluster.pull("x") == [3.0, 3.0]
        assert all("nbdist.engine.warm" not in _parent(r.pid) for r in cluster.ranks)  # fresh, not forked
    # the magic takes it like nbdist's own
    run_cell(ip, "%dist_start -n 2 --launcher cold --spacing 0.1")
    try:
        run_cell(ip, "%%distributed\nt = torch.ones(1)\ndist.all_reduce(t)\nprint('sum', t.item())")
        assert "sum 2.0" in capsys.readouterr().out
    finally:
        run_cell(ip, "%dist_stop")


def test_a_second_launcher_of_the_same_name_is_refused_in_one_line(installed):
    launchers.load()

    class Twin(launchers.launcher_class("cold")):  # type: ignore[misc, valid-type]
        pass

    with pytest.raises(ConfigError, match=r"two launchers are named 'cold' \(nbdist_cold.ColdLauncher and .*Twin\)"):
        launchers.register(Twin)
    with pytest.raises(ConfigError, match="is not a launcher: subclass nbdist.launch.launchers.Launcher"):
        launchers.register(int)


def test_an_option_two_launchers_declare_with_two_types_is_refused(installed):
    """A plug-in may share an option with another launcher (as slurm and srun share --nodes), of the same type."""
    from dataclasses import dataclass

    from nbdist.config import LauncherOptions, LauncherSpec, option
    from nbdist.launch.launchers import LocalLauncher

    @dataclass(kw_only=True)
    class Clash(LauncherOptions):
        nodes: str | None = option(help="a list of nodes")

    class Odd(LocalLauncher):
        spec = LauncherSpec("odd", "a launcher whose --nodes is text", multi_host=False, options=Clash)

    with pytest.raises(
        ConfigError, match="launcher 'odd' declares option 'nodes' as str, but launcher '(slurm|srun)' has it as int"
    ):
        launchers.register(Odd)
    assert "odd" not in launchers.known()


def _parent(pid: int) -> str:
    import psutil

    try:
        return " ".join(psutil.Process(pid).parent().cmdline())
    except Exception:
        return ""


def test_the_magic_outlives_a_launcher_that_is_gone(installed):
    """%dist_start's parser is shared by the session: a plug-in's flag, made while it was known, stays in it. Once
    the plug-in is gone, %dist_start without that flag works as before, and with it says it is not an option."""
    from nbdist.magics import DistMagics
    from nbdist.magics.common import given_options, parse, with_launcher_options

    StartConfig.of(n=1, launcher="cold")  # known now: its --spacing goes into the magic's parser
    func = with_launcher_options(DistMagics.dist_start)
    assert "--spacing" in func.parser.format_help()
    launchers.forget("cold")
    config = StartConfig.of(**given_options(func, parse(func, "-n 2")))
    assert (config.world.n, config.launcher) == (2, "local")
    with pytest.raises(ConfigError, match="'spacing' is not an option of nbdist.start"):
        StartConfig.of(**given_options(func, parse(func, "-n 2 --spacing 0.5")))
