"""The processes below the ones nbdist started (launch/procs.descendants: what ``stop`` ends, by id), on real
processes, against psutil's own ``children(recursive=True)``."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

from nbdist.launch import procs

# a process that starts two children, each of which starts two more (depth 2), then waits: 6 below each
LEVEL = (
    "import subprocess, sys, time\n"
    "depth, me = int(sys.argv[1]), sys.argv[2]\n"
    "kids = [subprocess.Popen([sys.executable, '-c', me, str(depth - 1), me]) for _ in range(2 if depth else 0)]\n"
    "time.sleep(60)\n"
)


def test_the_processes_below_several_started_ones_are_psutils_children_and_no_other():
    trees = [subprocess.Popen([sys.executable, "-c", LEVEL, "2", LEVEL]) for _ in range(3)]
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # started, not asked about
    try:
        deadline = time.monotonic() + 30  # only to catch a hang
        while sum(len(psutil.Process(t.pid).children(recursive=True)) for t in trees) < 18:
            assert time.monotonic() < deadline, "the process trees did not start"
            time.sleep(0.05)
        asked = [t.pid for t in trees] + [999_999_999]  # a pid that names no process is no error
        expected = {c.pid for t in trees for c in psutil.Process(t.pid).children(recursive=True)}
        got = procs.descendants(asked)
        assert got == expected and len(got) == 18
        assert other.pid not in got and os.getpid() not in got
        assert procs.descendants([os.getpid()]) >= {*expected, *(t.pid for t in trees), other.pid}
    finally:
        for t in trees:
            for child in psutil.Process(t.pid).children(recursive=True):
                child.kill()
            t.kill()
            t.wait()
        other.kill()
        other.wait()
