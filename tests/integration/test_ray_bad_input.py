"""``--launcher ray`` where the kernel's Python has no Ray, or a Ray outside the tested range: the start fails
at once in one line naming the version or the missing package and the fix, and leaves nothing running. The
real driver (``python -m nbdist.launch.ray``, started by the real engine set) meets the real import: a
directory put first on PYTHONPATH holds the ``ray`` it finds, one that is not installed (its import fails as a
missing package's does) or an old one (a ``ray`` whose version is 2.30.0). No Ray cluster is needed."""

from __future__ import annotations

import os
import time

import psutil
import pytest

import nbdist
from nbdist.errors import ClusterError

HANG_S = 60.0

NOT_INSTALLED = "raise ModuleNotFoundError(\"No module named 'ray'\", name='ray')\n"
TOO_OLD = "__version__ = '2.30.0'\n"


@pytest.mark.parametrize(
    ("module", "said"),
    [
        (NOT_INSTALLED, "--launcher ray needs Ray in the kernel's Python"),
        (TOO_OLD, "Ray 2.30.0 is outside the versions --launcher ray is tested with (2.40 up to, not with, 3.0)"),
    ],
    ids=["not-installed", "too-old"],
)
def test_no_ray_or_an_old_one_fails_at_once_naming_the_fix(tmp_path, monkeypatch, module, said):
    shadow = tmp_path / "shadow" / "ray"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(module)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(shadow.parent), os.environ.get("PYTHONPATH", "")]))
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    tic = time.monotonic()
    with pytest.raises(ClusterError) as failed:
        nbdist.start(n=2, launcher="ray", address="ray://127.0.0.1:10001", timeout=HANG_S, progress=lambda line: None)
    seconds = time.monotonic() - tic
    line = str(failed.value)
    assert said in line, line
    assert "pip install 'ray[client]>=2.40,<3.0'" in line, line
    assert seconds < HANG_S / 2, f"it waited {seconds:.0f} s instead of failing at once"
    with pytest.raises(ClusterError):
        nbdist.current()  # no world was left half-started
    deadline = time.monotonic() + 10  # the controller and the Ray driver end; nothing else was started
    while (left := {c.pid for c in psutil.Process().children(recursive=True)} - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, [psutil.Process(p).cmdline() for p in left if psutil.pid_exists(p)]
