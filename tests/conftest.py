"""Shared fixtures: a real 2-engine cluster (gloo) and an IPython shell that raises on error."""

from __future__ import annotations

import os
import signal

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


@pytest.fixture(scope="session", autouse=True)
def no_leaked_processes():
    """Fail the run if any controller or engine started during it outlives it (orphans included)."""
    import time

    import psutil

    before = _nbdist_processes()
    yield
    import nbdist.launch.pool

    nbdist.launch.pool.shutdown()  # warm engines nobody took (started by %load_ext) end with the session
    deadline = time.monotonic() + 10
    leaked = _nbdist_processes() - before
    while leaked and time.monotonic() < deadline:
        time.sleep(0.2)
        leaked = {p for p in _nbdist_processes() - before if psutil.pid_exists(p)}
    assert not leaked, f"nbdist processes outlived the tests: {sorted(leaked)}"


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
