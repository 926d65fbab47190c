"""A launcher whose engines cannot start once their node is gone, for the elastic world's tests and benchmark.

"gone-node" starts every engine as a fresh process of a small script (ipyparallel's own local engine-set
launcher, no warm fork) that runs nbdist's engine, until the flag file exists: from then on each engine
exits at once, as an engine on a lost node never comes. Everything else is nbdist's own.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import sys
import textwrap
from collections.abc import Iterator

from nbdist.config import LauncherSpec, launchers

GONE_ENGINE = """
import os, sys
if os.path.exists({flag!r}):
    sys.exit("nbdist test: this engine's node is gone")
os.execv(sys.executable, [sys.executable, "-m", "nbdist.engine", *sys.argv[1:]])
"""


@contextlib.contextmanager
def gone_node(tmp_path: pathlib.Path) -> Iterator[pathlib.Path]:
    """Register the "gone-node" launcher while the block runs; yield the flag file that marks the node gone. No
    spare engine (nbdist/world/spare.py) meanwhile: it would be a replacement that came, where these drills are about
    a world that must go on without one (on a real cluster of several hosts a world keeps none)."""
    from ipyparallel.cluster.launcher import LocalEngineSetLauncher

    from nbdist.launch.launchers import Launcher, build_cluster
    from nbdist.launch.net import LOOPBACK

    flag = tmp_path / "node-gone"
    script = tmp_path / "gone_engine.py"
    script.write_text(textwrap.dedent(GONE_ENGINE.format(flag=str(flag))))

    class GoneNodeLauncher(Launcher):
        spec = LauncherSpec("gone-node", "engines that cannot start once their node is gone", multi_host=False)

        def cluster(self, config, profile_dir, fresh=True):
            cluster, engines = build_cluster(
                config,
                profile_dir,
                fresh=fresh,
                ip=LOOPBACK,
                engines=LocalEngineSetLauncher,
                engine_args=["--IPEngine.enable_nanny=False"],
            )
            engines.engine_cmd = [sys.executable, str(script)]
            engines.delay = 0.0
            return cluster

    launchers.register(GoneNodeLauncher)
    spare = os.environ.get("NBDIST_SPARE")
    os.environ["NBDIST_SPARE"] = "0"
    try:
        yield flag
    finally:
        launchers.forget("gone-node")
        if spare is None:
            os.environ.pop("NBDIST_SPARE", None)
        else:
            os.environ["NBDIST_SPARE"] = spare
