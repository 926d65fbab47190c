"""Shared fixtures: a real 2-engine cluster (gloo) and an IPython shell that raises on error."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


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


def run_cell(shell, code: str):
    """Run a notebook cell through IPython; raise the cell's error like Run All would stop."""
    result = shell.run_cell(code)
    result.raise_error()
    return result.result
