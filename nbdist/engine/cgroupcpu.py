"""The CPU quota of this process's cgroup and the CPU its processes used: what a container may compute (a JupyterHub
pod with a CPU limit on a node of many cores, a Slurm job step with its cores, Docker's ``--cpus``).

cgroup v2: ``cpu.max`` (quota and period, or ``max``) and ``cpu.stat``'s ``usage_usec``; cgroup v1: the ``cpu``
controller's ``cpu.cfs_quota_us`` (-1: none) and ``cpu.cfs_period_us``, and ``cpuacct.usage`` (nanoseconds). The
cgroup is the one ``/proc/self/cgroup`` names, found under the mount ``/proc/self/mountinfo`` gives for its hierarchy.
Only that cgroup's own quota is read, not its parents'.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial


@dataclass(frozen=True, slots=True)
class Quota:
    """``cores``: the quota in cores (1.5: a period's worth of CPU time and half); ``used_s()``: the seconds of CPU
    the cgroup's processes have used."""

    cores: float
    used_s: Callable[[], float]


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _mounts(mountinfo: str) -> list[tuple[str, str, str, set[str]]]:
    """Each cgroup mount: (its root within the hierarchy, where it is mounted, 'cgroup' or 'cgroup2', its options)."""
    found = []
    for line in mountinfo.splitlines():
        head, _, tail = line.partition(" - ")
        fields, after = head.split(), tail.split()
        if len(fields) >= 5 and len(after) >= 3 and after[0] in ("cgroup", "cgroup2"):
            found.append((fields[3], fields[4], after[0], set(after[2].split(","))))
    return found


def _dir(mounts: list[tuple[str, str, str, set[str]]], kind: str, controller: str | None, path: str) -> str | None:
    """The directory of cgroup ``path`` in the hierarchy of ``kind`` that has ``controller`` (v1) mounted."""
    for root, point, fs, options in mounts:
        if fs != kind or (controller is not None and controller not in options):
            continue
        if path == root or root == "/" or path.startswith(root.rstrip("/") + "/"):
            rel = path[len(root) :] if root != "/" else path
            return os.path.join(point, rel.lstrip("/"))
    return None


def quota(proc: str = "/proc/self") -> Quota | None:
    """This process's cgroup's CPU quota; None where none is set, or the files are not there to read (not Linux), or
    read as nothing here expects (the warm process calls this as it starts: a quota not read only costs the gate)."""
    cgroups, mountinfo = _read(f"{proc}/cgroup"), _read(f"{proc}/mountinfo")
    if cgroups is None or mountinfo is None:
        return None
    try:
        return _quota(cgroups, _mounts(mountinfo))
    except (ValueError, IndexError, ZeroDivisionError):
        return None


def _quota(cgroups: str, mounts: list[tuple[str, str, str, set[str]]]) -> Quota | None:
    for line in cgroups.splitlines():
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and not controllers:  # v2
            v2 = _dir(mounts, "cgroup2", None, path)
            limit = _read(f"{v2}/cpu.max") if v2 else None
            if v2 and limit and not limit.startswith("max"):
                per, period = limit.split()[:2]
                return Quota(int(per) / int(period), partial(_usec, f"{v2}/cpu.stat"))
        elif "cpu" in controllers.split(","):  # v1
            v1 = _dir(mounts, "cgroup", "cpu", path)
            per_us = _read(f"{v1}/cpu.cfs_quota_us") if v1 else None
            period_us = _read(f"{v1}/cpu.cfs_period_us") if v1 else None
            acct = _acct_dir(cgroups, mounts)
            if per_us and period_us and int(per_us) > 0 and acct is not None:
                return Quota(int(per_us) / int(period_us), partial(_nsec, f"{acct}/cpuacct.usage"))
    return None


def _acct_dir(cgroups: str, mounts: list[tuple[str, str, str, set[str]]]) -> str | None:
    for line in cgroups.splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpuacct" in controllers.split(","):
            return _dir(mounts, "cgroup", "cpuacct", path)
    return None


def _nsec(usage: str) -> float:
    return int(_read(usage) or 0) / 1e9


def _usec(stat: str) -> float:
    for line in (_read(stat) or "").splitlines():
        if line.startswith("usage_usec "):
            return int(line.split()[1]) / 1e6
    return 0.0
