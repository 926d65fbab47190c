"""Shared fixtures: a real 2-engine cluster (gloo) and an IPython shell that raises on error."""

from __future__ import annotations

import importlib.util
import os
import signal
import sys

import pytest

from tests.slurmnodes import TwoNodeSlurm, unavailable

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Ctrl-C is KeyboardInterrupt here, as in a notebook or a terminal, however the suite was started: a
# shell without job control starts background jobs with SIGINT ignored, which Python and every
# process started from it would inherit (the fault drills that press Ctrl-C would then hang).
signal.signal(signal.SIGINT, signal.default_int_handler)


def _nbdist_processes() -> set[int]:
    import psutil

    found = set()
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info.get("cmdline") or [])
        if "nbdist.engine" in cmd:
            found.add(proc.pid)
    return found


def _in_a_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")  # an xdist worker; the controller (or a plain run) has none


def pytest_sessionstart(session: pytest.Session) -> None:
    if not _in_a_worker(session.config):
        session.config.stash[_BEFORE] = _nbdist_processes()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if any controller or engine started during it outlives it (orphans included). Checked once,
    by the process that ran the session (the xdist controller, after every worker has ended)."""
    import time

    import psutil

    before = session.config.stash.get(_BEFORE, None)
    if before is None:
        return
    deadline = time.monotonic() + 10
    leaked = _nbdist_processes() - before
    while leaked and time.monotonic() < deadline:
        time.sleep(0.2)
        leaked = {p for p in _nbdist_processes() - before if psutil.pid_exists(p)}
    if leaked:
        said = f"nbdist processes outlived the tests: {sorted(leaked)}"
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line("")
            reporter.write_sep("=", said, red=True)
        else:
            print(said, file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_BEFORE = pytest.StashKey[set]()
_STDERR = pytest.StashKey[object]()
# pytest-timeout's signal ends a test that runs past its timeout, but only once Python runs again: a test stuck in
# C (a lock, a collective) would hold the run until CI's own limit (stop 77: 80 minutes in one unit test, with no
# word of where). Past the timeout and this margin, every thread's stack is printed and the run ends.
STUCK_MARGIN_S = 120


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_STDERR] = os.fdopen(os.dup(2), "w")  # the real stderr: a test's own is captured


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    import faulthandler

    marker = item.get_closest_marker("timeout")
    given = getattr(item.config.option, "timeout", None) or item.config.getini("timeout")  # --timeout, else the ini's
    timeout = float(marker.args[0]) if marker and marker.args else float(given or 0)
    if timeout > 0:
        # "Timeout (h:mm:ss)!", then each thread's stack: the main thread's names the test
        faulthandler.dump_traceback_later(timeout + STUCK_MARGIN_S, exit=True, file=item.config.stash[_STDERR])
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="session", autouse=True)
def _warm_engines_end_with_the_session():
    """Warm engines nobody took (started by %load_ext in this process) end with its session."""
    yield
    import nbdist.launch.pool

    nbdist.launch.pool.shutdown()


# ---------------------------------------------------------------- two workers (make test: pytest -n 2)

# What runs on one worker, one test after another: the tests that share one set of nodes (they exist once per
# machine: fixed namespaces, bridges and state files), and each module whose tests share a module fixture (a
# cluster, a built wheel). pytest-xdist's xdist_group marks cannot say this: on pytest 9.2 the worker's renamed node
# ids no longer reach its scheduler (pytest-dev/pytest-xdist#1386), and tests of one group ran on both workers.
SHARED_NODES = {
    "tests/multinode/test_multinode.py": "the two Slurm nodes",
    "tests/hub/test_jupyterhub.py": "the two Slurm nodes",
    "tests/notebooks/test_notebooks.py::test_multinode_notebook_on_a_two_node_slurm": "the two Slurm nodes",
    "tests/multinode/test_ray.py": "the two Ray nodes",
    "tests/multinode/test_ray_node_leaves.py": "the two Ray nodes",
}
EACH_ALONE = ("tests/notebooks/", "tests/browser/")  # no module fixture: each test may go to either worker
# The longest first, so that neither worker is left with a long one at the end (seconds in CI, serial: the
# two Ray nodes 420, the Slurm nodes 300, a notebook 15-42, a browser test 20-133, a packaging test 184 in all).
FIRST = (
    "tests/multinode/test_ray.py",
    "tests/multinode/test_ray_node_leaves.py",
    "tests/multinode/test_multinode.py",
    "tests/hub/test_jupyterhub.py",
    "tests/notebooks/test_notebooks.py::test_multinode_notebook_on_a_two_node_slurm",
    "tests/packaging/",
    "tests/browser/test_first_hour_walk.py",
    "tests/integration/test_elastic.py",
    "tests/interop/",
    "tests/browser/",
    "tests/notebooks/",
    "tests/integration/test_resume.py",
)


def scope_of(nodeid: str) -> str:
    """The unit one worker runs: the nodes a test shares with others, else its module (or itself)."""
    for key, nodes in SHARED_NODES.items():
        if nodeid == key or nodeid.startswith(key + "::"):
            return nodes
    return nodeid if nodeid.startswith(EACH_ALONE) else nodeid.split("::", 1)[0]


def _longest_first(nodeid: str) -> int:
    return next((i for i, prefix in enumerate(FIRST) if nodeid.startswith(prefix)), len(FIRST))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _in_a_worker(config):  # the order the scheduler hands the units out in (the same on every worker)
        items.sort(key=lambda item: _longest_first(item.nodeid))


if importlib.util.find_spec("xdist") is not None:  # the hook exists only where pytest-xdist is installed

    def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
        from xdist.scheduler import LoadScopeScheduling

        class ByModuleAndNodes(LoadScopeScheduling):  # type: ignore[misc]
            def _split_scope(self, nodeid: str) -> str:  # xdist's documented way to choose the unit
                return scope_of(nodeid)

        config.option.loadscopereorder = False  # in the order collected (longest first), not by count
        return ByModuleAndNodes(config, log)


@pytest.fixture(scope="module")
def cluster():
    import nbdist

    c = nbdist.start(n=2, timeout=60)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="session")
def ip():
    from IPython.testing.globalipapp import start_ipython

    shell = start_ipython()
    shell.run_line_magic("load_ext", "nbdist")
    return shell


# ---------------------------------------------------------------- a real two-node Slurm (root only)


@pytest.fixture(scope="session")
def two_nodes():
    why = unavailable()
    if why:
        pytest.skip(why)
    nodes = TwoNodeSlurm().up()
    try:
        yield nodes
    finally:
        nodes.down()


@pytest.fixture
def slurm(two_nodes, monkeypatch):
    """The cluster, for this test's processes (SLURM_CONF), with no job left behind by the test
    (checked, then cancelled by id)."""
    monkeypatch.setenv("SLURM_CONF", two_nodes.conf)
    yield two_nodes
    left = two_nodes.wait_empty(timeout=20)
    two_nodes.cancel_all_jobs()
    assert not left, f"Slurm jobs outlived the test: {left}"


# ---------------------------------------------------------------- a real two-node Ray cluster (root only)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test on the two-node Ray cluster shows the head's Ray Client logs beside its own output."""
    outcome = yield
    report = outcome.get_result()
    nodes = getattr(item, "funcargs", {}).get("ray_nodes")
    if report.failed and nodes is not None and nodes.workdir:
        report.sections.append(("Ray head's client server and GCS logs", nodes.logs_tail()))


@pytest.fixture(scope="module")
def ray_nodes():
    from tests.raynodes import TwoNodeRay
    from tests.raynodes import unavailable as ray_unavailable

    why = ray_unavailable()
    if why:
        pytest.skip(why)
    nodes = TwoNodeRay().up()
    try:
        yield nodes
    finally:
        nodes.down()
