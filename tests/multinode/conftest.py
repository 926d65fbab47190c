"""A real two-node Slurm cluster (tests/slurmnodes.py) for the multi-node tests; root only."""

from __future__ import annotations

import os

import pytest

from tests.slurmnodes import TwoNodeSlurm, unavailable


@pytest.fixture(scope="session")
def two_nodes():
    why = unavailable()
    if why:
        pytest.skip(why)
    nodes = TwoNodeSlurm().up()
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = nodes.conf
    try:
        yield nodes
    finally:
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
        nodes.down()


@pytest.fixture
def slurm(two_nodes):
    """The cluster, with no job left behind by the test (checked, then cancelled by id)."""
    yield two_nodes
    left = two_nodes.wait_empty(timeout=20)
    two_nodes.cancel_all_jobs()
    assert not left, f"Slurm jobs outlived the test: {left}"
