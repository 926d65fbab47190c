"""A real two-node Slurm cluster on this machine, for tests, notebook 07 and benchmarks/multinode.py.

Each ``slurmd`` runs in its own network namespace (its own address on a bridge) and
UTS namespace (its own hostname), from Debian's ``slurm-wlm`` and ``munge``; the
controller (``slurmctld``) and the notebook side stay in this namespace at 10.77.0.1. Each node's link is
shaped to 1 Gb/s (``LINK``), ordinary Ethernet, so traffic between nodes costs what it costs on a cluster.
How it is built, and its two traps: docs/multinode-testing.md. Needs root; ``unavailable()`` says why not.

Everything started here is ended by pid (never by name), and the namespaces, bridge
and portless bridge this module made are removed, also when a test fails. A second
address on a portless bridge that the nodes have no route to (``UNROUTED``) lets a
test name a controller address the nodes cannot reach.

    python -m tests.slurmnodes up|down     # by hand, e.g. to try notebook 07
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, field

from tests.nsnodes import begin, end, finish, network, remove_stale, sh

BRIDGE, SUBNET = "nbbr0", "10.77.0"
HOST_ADDR = f"{SUBNET}.1"
DUMMY, UNROUTED = "nbbr1", "10.78.0.1"  # a bridge with no ports: an address the nodes have no route to
NODES = {"node1": f"{SUBNET}.2", "node2": f"{SUBNET}.3"}
LINK = "1gbit"  # each node's link (see _network)
GPUS = 2  # per node, for Slurm's bookkeeping only (see _fake_gpus)
PACKAGES = ("slurm-wlm", "munge", "openmpi-bin")
STATE_FILE = "/tmp/nbdist-slurmnodes.dir"  # where `up` left its directory, for `down`


def unavailable() -> str:
    """Why a two-node cluster cannot run here ('' when it can)."""
    if sys.platform != "linux":
        return "the two-node Slurm cluster needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the two-node Slurm cluster needs root (network namespaces, slurmd); run the suite as root"
    missing = [cmd for cmd in ("slurmctld", "slurmd", "munged", "nsenter", "ip") if not _which(cmd)]
    if missing:
        return (
            f"{', '.join(missing)} not found: install {', '.join(PACKAGES)} (as root, `make test` does it: "
            "tests/system-packages.sh)"
        )
    return ""


def _which(cmd: str) -> str | None:
    return shutil.which(cmd) or shutil.which(cmd, path="/usr/sbin:/sbin:/usr/bin")


@dataclass
class TwoNodeSlurm:
    """Start with ``up()``, stop with ``down()`` (or use as a context manager)."""

    cpus_per_node: int = 2
    workdir: str = ""
    pids: list[int] = field(default_factory=list)  # processes this object started
    links: list[str] = field(default_factory=list)  # interfaces and namespaces it made

    @property
    def conf(self) -> str:
        return os.path.join(self.workdir, "slurm.conf")

    @property
    def env(self) -> dict[str, str]:
        """What a process needs to use this cluster (``SLURM_CONF``)."""
        return {"SLURM_CONF": self.conf}

    def __enter__(self) -> TwoNodeSlurm:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self, timeout: float = 60.0) -> TwoNodeSlurm:
        why = unavailable()
        if why:
            raise RuntimeError(why)
        _remove_stale()
        self.workdir = begin(STATE_FILE, "nbdist-slurm-")
        try:
            self._munge()
            self._network()
            self._write_conf()
            for sub in ("state", "spool/node1", "spool/node2"):
                os.makedirs(os.path.join(self.workdir, sub), exist_ok=True)
            self._daemon(["slurmctld", "-f", self.conf], "slurmctld.pid")
            for name in NODES:
                script = f"hostname {name}; exec slurmd -f {self.conf} -N {name}"
                nsenter = ["nsenter", f"--net=/var/run/netns/nb{name}", "unshare", "--uts", "sh", "-c", script]
                self._daemon(nsenter, f"slurmd-{name}.pid")
            self._wait_idle(timeout)
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """End what this object started, by pid, and remove its interfaces; safe to call twice."""
        self.cancel_all_jobs()
        for pid in reversed(self.pids):
            end(pid, wait=1.0)  # the cluster's state is thrown away: no need to wait for a clean save
        self.pids.clear()
        finish(self.workdir, STATE_FILE, self.links)
        self.workdir = ""

    # ------------------------------------------------------------------ queries

    def run(self, *cmd: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        """Run a Slurm command (squeue, srun, ...) against this cluster."""
        env = dict(os.environ, **self.env)
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")
        return done

    def jobs(self) -> list[str]:
        """Ids of the jobs in the queue (any state)."""
        if not self.workdir:
            return []
        out = self.run("squeue", "-h", "-o", "%i", check=False).stdout
        return [line.strip() for line in out.splitlines() if line.strip()]

    def cancel_all_jobs(self) -> None:
        """Cancel every job on this (private, test-only) cluster, by id, and wait until the queue is empty."""
        ids = self.jobs()
        if ids:
            self.run("scancel", *ids, check=False)
            deadline = time.monotonic() + 20
            while self.jobs() and time.monotonic() < deadline:
                time.sleep(0.2)

    def wait_empty(self, timeout: float = 30) -> list[str]:
        """Wait until no job is queued or running; return the ids still there after timeout."""
        deadline = time.monotonic() + timeout
        while (ids := self.jobs()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return ids

    def drain(self, node: str, reason: str = "nbdist test") -> None:
        self.run("scontrol", "update", f"nodename={node}", "state=drain", f"reason={reason}")

    def resume(self, node: str) -> None:
        self.run("scontrol", "update", f"nodename={node}", "state=resume")

    # ------------------------------------------------------------------ setup steps

    def _munge(self) -> None:
        if subprocess.run(["munge", "-n"], capture_output=True).returncode == 0:
            return  # a munged is already running (not ours: leave it)
        for d in ("/etc/munge", "/run/munge", "/var/lib/munge", "/var/log/munge"):
            os.makedirs(d, exist_ok=True)
        key = "/etc/munge/munge.key"
        if not os.path.exists(key):
            with open(key, "wb") as fh:
                fh.write(os.urandom(1024))
        sh("chown", "-R", "munge:munge", "/etc/munge", "/run/munge", "/var/lib/munge", "/var/log/munge")
        os.chmod(key, 0o400)
        sh("runuser", "-u", "munge", "--", "munged", "--force")
        pidfile = "/run/munge/munged.pid"
        deadline = time.monotonic() + 10
        while not os.path.exists(pidfile) and time.monotonic() < deadline:
            time.sleep(0.05)
        with open(pidfile) as fh:
            self.pids.append(int(fh.read().strip()))

    def _network(self) -> None:
        # every node's link runs at ordinary Ethernet's 1 Gb/s (what reaches the node; tc's token bucket), so
        # a collective between nodes is slower than within one, as on a real cluster (notebook 07 measures it)
        network(BRIDGE, HOST_ADDR, NODES, "nbv", self.links, rate=LINK)
        sh("ip", "link", "add", DUMMY, "type", "bridge")
        self.links.append(DUMMY)
        sh("ip", "addr", "add", f"{UNROUTED}/24", "dev", DUMMY)
        sh("ip", "link", "set", DUMMY, "up")

    def _write_conf(self) -> None:
        d = self.workdir
        host = socket.gethostname().split(".")[0]
        nodes = "\n".join(
            f"NodeName={n} NodeAddr={a} NodeHostname={n} CPUs={self.cpus_per_node} RealMemory=2000 Gres=gpu:{GPUS}"
            for n, a in NODES.items()
        )
        self._fake_gpus()
        text = f"""ClusterName=nbtest
SlurmctldHost={host}({HOST_ADDR})
SlurmctldPort=16817
SlurmdPort=16818
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/ctld.log
SlurmdLogFile={d}/d-%n.log
SlurmUser=root
GresTypes=gpu
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
KillWait=2
MessageTimeout=5
{nodes}
PartitionName=debug Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""
        with open(self.conf, "w") as fh:
            fh.write(text)

    def _fake_gpus(self) -> None:
        """GPUs for Slurm's bookkeeping only: device files like /dev/null, so that jobs that ask
        ``--gpus-per-node`` get what a GPU node gives them (``SLURM_GPUS_ON_NODE``,
        ``SLURM_JOB_GPUS``, ``CUDA_VISIBLE_DEVICES``). Nothing can run CUDA on them."""
        dev = os.path.join(self.workdir, "dev")
        os.makedirs(dev, exist_ok=True)
        for i in range(GPUS):
            os.mknod(os.path.join(dev, f"gpu{i}"), 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        with open(os.path.join(self.workdir, "gres.conf"), "w") as fh:
            fh.write(f"NodeName={','.join(NODES)} Name=gpu File={dev}/gpu[0-{GPUS - 1}]\n")

    def _daemon(self, cmd: list[str], pidfile: str) -> None:
        """Start a daemon that writes its pid file; record that pid."""
        path = os.path.join(self.workdir, pidfile)
        done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **self.env), timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"{cmd[0]} failed to start: {done.stderr.strip()}{self._log_tail()}")
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                with open(path) as fh:
                    self.pids.append(int(fh.read().strip()))
                return
            except (FileNotFoundError, ValueError):
                time.sleep(0.05)
        raise RuntimeError(f"{' '.join(cmd)} wrote no pid file {path}{self._log_tail()}")

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        out = ""
        while time.monotonic() < deadline:
            out = self.run("sinfo", "-h", "-o", "%t %D", check=False).stdout.strip()
            if out == "idle 2":
                return
            time.sleep(0.2)
        raise RuntimeError(f"the two Slurm nodes did not become idle within {timeout:.0f} s (sinfo: {out!r})")

    def _log_tail(self) -> str:
        tails = []
        for name in ("ctld.log", "d-node1.log", "d-node2.log"):
            try:
                with open(os.path.join(self.workdir, name)) as fh:
                    tails.append(f"{name}: " + " | ".join(fh.read().splitlines()[-3:]))
            except OSError:
                pass
        return ("; " + "; ".join(tails)) if tails else ""


def _remove_stale() -> None:
    """A cluster left by a run that was killed: end its daemons by their pid files, remove its links."""
    pids = ["slurmctld.pid", *(f"slurmd-{name}.pid" for name in NODES)]
    remove_stale(STATE_FILE, pids, NODES, [BRIDGE, DUMMY, "nbv1", "nbv2"], group=False)


if __name__ == "__main__":
    action = sys.argv[1] if len(sys.argv) > 1 else "up"
    if action == "up":
        nodes = TwoNodeSlurm().up()
        print(f"export SLURM_CONF={nodes.conf}")
        print("# stop with: python -m tests.slurmnodes down")
    else:
        _remove_stale()
