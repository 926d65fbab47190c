"""engine/quiet.py: whether a core is free, read from /proc/stat on one core this test pins itself (in a child
process) and a spinner to, so that other work on the machine does not decide it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/stat (Linux)")

SCRIPT = r"""
import json, os, subprocess, sys, time
from nbdist.engine.quiet import FREE, Quiet

core = max(os.sched_getaffinity(0))
os.sched_setaffinity(0, {core})


def sampled(quiet, seconds, spin):
    said, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        if spin:
            sum(range(20000))
        else:
            time.sleep(0.1)
        said.append(quiet.free())
    return said


out = {"free": FREE}
quiet = Quiet(window_s=0.3, stale_s=1e9)
out["before_a_window"] = quiet.free()
out["alone"] = sampled(quiet, 1.0, spin=True)[-1], quiet.free_cores  # its own use is not a reason to wait
spinner = subprocess.Popen(
    [sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{core}}})\nwhile True: pass"]
)
try:
    time.sleep(0.3)
    out["shared"] = sampled(quiet, 1.0, spin=True)[-1], quiet.free_cores
    out["busy"] = sampled(quiet, 1.0, spin=False)[-1], quiet.free_cores
    stale = Quiet(window_s=0.3, stale_s=1.0)
    out["stale"] = sampled(stale, 2.5, spin=False)
finally:
    spinner.kill()
    spinner.wait()
end = time.monotonic() + 5
while not quiet.free() and time.monotonic() < end:
    time.sleep(0.1)
out["after"] = quiet.free_cores
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def measured():
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.splitlines()[-1])


def test_no_answer_is_free_before_a_whole_window_was_seen(measured):
    assert measured["before_a_window"] is False


def test_the_process_s_own_use_of_a_core_leaves_it_free(measured):
    free, cores = measured["alone"]
    assert free is True and cores >= measured["free"], measured


def test_a_core_another_process_computes_on_is_not_free_whether_or_not_this_one_computes_too(measured):
    for case in ("shared", "busy"):
        free, cores = measured[case]
        assert free is False and cores < 0.6, (case, measured)


def test_a_core_busy_for_the_stale_time_gives_one_step_and_waits_again(measured):
    stale = measured["stale"]
    assert stale.count(True) in (1, 2) and stale[:8] == [False] * 8 and stale[-1] is False, stale


def test_a_core_freed_is_free_again(measured):
    assert measured["after"] >= measured["free"], measured
