"""engine/quiet.py: whether a core is free, read from /proc/stat on one core this test pins itself (in a child
process) and a spinner to, so that other work on the machine does not decide it; and in a real cgroup with a quota of
one core (root), where the host's idle cores are not the cgroup's to take (engine/cgroupcpu.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile

import pytest

from nbdist.engine import quiet
from tests.helpers import poll

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
    quiet.release()
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
quiet.release()
out["after"] = quiet.free_cores
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def measured():
    with tempfile.TemporaryDirectory() as turns:  # the host's turn its own: another run's warm process may hold it
        run = subprocess.run(
            [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, env={**os.environ, "TMPDIR": turns}
        )
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


def test_one_process_of_a_host_has_its_turn_at_a_time_until_it_lets_go(tmp_path, monkeypatch):
    """Every warm process of a host reads the same free core at the same moment: only the one holding the host's turn
    (an flock, across processes) is told it is free, until it lets go after its step."""
    path = tmp_path / "turn.lock"
    monkeypatch.setattr(quiet, "_TURN_PATH", str(path))
    first, second = quiet.Quiet(stale_s=0.0), quiet.Quiet(stale_s=0.0)  # stale at once: free but for the turn
    assert first.free() is True
    assert path.stat().st_mode & 0o777 == 0o600
    other = subprocess.run(
        [sys.executable, "-c", "import fcntl, os, sys; fcntl.flock(os.open(sys.argv[1], os.O_RDWR), 6)", str(path)],
        capture_output=True,
    )  # 6: LOCK_EX | LOCK_NB
    assert other.returncode != 0, "another process took the turn that this one holds"
    assert second.free() is False
    first.release()
    assert second.free() is True
    assert first.free() is False
    second.release()


# ------------------------------------------------------------------ a cgroup with a CPU quota (root: a real cgroup)

QUOTA_SCRIPT = r"""
import json, os, subprocess, sys, time
from nbdist.engine import cgroupcpu
from nbdist.engine.quiet import Quiet

for path in sys.argv[1:]:  # into the cgroup (each v1 hierarchy's), before anything is measured
    with open(os.path.join(path, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
found = cgroupcpu.quota()
out = {"cores": found.cores if found else None}


def sampled(quiet, seconds, spin):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if spin:
            sum(range(20000))
        else:
            time.sleep(0.1)
        said = quiet.free()
    quiet.release()
    return said, quiet.free_cores


quiet = Quiet(window_s=0.3, stale_s=1e9)
host = Quiet(window_s=0.3, stale_s=1e9)
host._quota = None  # the host's idle cores alone, as before the quota was read
out["alone"] = sampled(quiet, 1.0, spin=True)  # its own use of the quota is given back
used = found.used_s()
spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # in the cgroup too: it takes the quota
try:
    time.sleep(0.3)
    out["spinner"] = sampled(quiet, 1.0, spin=False)
    out["host"] = sampled(host, 0.5, spin=False)
    out["used_s"] = found.used_s() - used
finally:
    spinner.kill()
    spinner.wait()
print(json.dumps(out))
"""


def _cgroup_with_one_core(tmp_name: str) -> list[str]:
    """A new cgroup with a quota of one core (v2 where the cpu controller is there, else v1's cpu and cpuacct
    hierarchies), its directories; skip where none can be made (not root, no writable cgroup filesystem)."""
    if os.geteuid() != 0:
        pytest.skip("making a cgroup needs root")
    v2 = "/sys/fs/cgroup"
    if os.path.exists(f"{v2}/cgroup.controllers") and "cpu" in open(f"{v2}/cgroup.controllers").read().split():
        made = os.path.join(v2, tmp_name)
        try:
            os.mkdir(made)
            with open(f"{made}/cpu.max", "w") as f:
                f.write("100000 100000")
        except OSError as exc:
            pytest.skip(f"cannot make a cgroup v2 with a CPU quota here: {exc}")
        return [made]
    cpu, acct = "/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpuacct"
    if not (os.path.exists(f"{cpu}/cpu.cfs_quota_us") and os.path.exists(f"{acct}/cpuacct.usage")):
        pytest.skip("no cgroup cpu controller mounted (v2 with cpu, or v1's cpu and cpuacct)")
    made = []
    try:
        for root in (cpu, acct):
            made.append(os.path.join(root, tmp_name))
            os.mkdir(made[-1])
        with open(f"{made[0]}/cpu.cfs_period_us", "w") as f:
            f.write("100000")
        with open(f"{made[0]}/cpu.cfs_quota_us", "w") as f:
            f.write("100000")
    except OSError as exc:
        for path in made:
            if os.path.isdir(path):
                os.rmdir(path)
        pytest.skip(f"cannot make a cgroup v1 with a CPU quota here: {exc}")
    return made


@pytest.fixture(scope="module")
def in_a_quota():
    made = _cgroup_with_one_core(f"nbdist-test-quiet-{os.getpid()}")
    try:
        run = subprocess.run([sys.executable, "-c", QUOTA_SCRIPT, *made], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        yield json.loads(run.stdout.splitlines()[-1])
    finally:
        for path in made:  # the script and its spinner, if a timeout left them: this test's cgroup holds only them
            for pid in open(os.path.join(path, "cgroup.procs")).read().split():
                os.kill(int(pid), signal.SIGKILL)
        for path in made:
            poll(lambda path=path: not open(os.path.join(path, "cgroup.procs")).read().strip(), 10)
            os.rmdir(path)


def test_the_quota_of_the_process_s_cgroup_is_read_in_cores(in_a_quota):
    assert in_a_quota["cores"] == 1.0, in_a_quota


def test_the_process_s_own_use_of_its_quota_leaves_it_free(in_a_quota):
    free, cores = in_a_quota["alone"]
    assert free is True and cores >= 0.8, in_a_quota


def test_a_quota_another_process_of_the_cgroup_takes_is_not_free_though_the_host_has_idle_cores(in_a_quota):
    free, cores = in_a_quota["spinner"]
    assert free is False and cores < 0.3 and in_a_quota["used_s"] > 0.5, in_a_quota
    if len(os.sched_getaffinity(0)) >= 2:  # where the host has a core the spinner leaves idle, it would say free
        assert in_a_quota["host"][0] is True, in_a_quota
