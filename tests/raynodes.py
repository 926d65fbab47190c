"""A real two-node Ray cluster on this machine, for the Ray launcher's tests and benchmarks/multinode.py.

The head (GCS, raylet, the Ray Client server) runs in one network namespace and a worker node in another, each
with its own address on a bridge and its own hostname (UTS namespace): rnode1 at 10.79.0.2 and rnode2 at
10.79.0.3, ``CPUS`` CPUs each. The notebook side stays in this namespace at 10.79.0.1 and reaches the cluster
with Ray Client (``ray://10.79.0.2:10001``), as a Zero to JupyterHub notebook pod reaches a KubeRay cluster.
Both nodes share this machine's filesystem (the cluster's private directory is visible from them, as a home
directory is on a cluster); each node gets its own Ray temporary directory so their sockets do not collide.

Each node is a ``ray start --block`` started here in a session of its own and ended by pid (its process group:
``--block`` ends the node's processes with it); the namespaces and bridge this module made are removed, also
when a test fails. Needs root; ``unavailable()`` says why not.

    python -m tests.raynodes up|down     # by hand
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field

from tests.nsnodes import begin, end, finish, network, remove_stale

BRIDGE, SUBNET = "nbrbr0", "10.79.0"
HOST_ADDR = f"{SUBNET}.1"
NODES = {"rnode1": f"{SUBNET}.2", "rnode2": f"{SUBNET}.3"}
HEAD = "rnode1"
GCS_PORT, CLIENT_PORT = 6379, 10001
CPUS = 2  # per node
STATE_FILE = "/tmp/nbdist-raynodes.dir"  # where `up` left its directory, for `down`


def _env() -> dict[str, str]:
    """Ray 2.60 turns token authentication on for `ray start` when ~/.ray/auth_token exists (a local `ray.init()`
    writes one); the test cluster and the tests' looks at it say "disabled", so such a file cannot lock the
    notebook side out. GRPC_ENABLE_FORK_SUPPORT=0, as docs/faults.md row 97 tells a user to start a head: with
    gRPC's fork handlers on, the head's Ray Client server may start a client's own server that dies at once (a
    fork while its gRPC threads are busy, ray-project/ray#63202); measured beside a busy client, 3 such deaths in
    13 connections with the handlers on, none in 12 with them off."""
    return {**os.environ, "RAY_AUTH_MODE": "disabled", "GRPC_ENABLE_FORK_SUPPORT": "0"}


def unavailable() -> str:
    """Why a two-node Ray cluster cannot run here ('' when it can)."""
    if sys.platform != "linux":
        return "the two-node Ray cluster needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the two-node Ray cluster needs root (network namespaces); run the suite as root"
    missing = [cmd for cmd in ("nsenter", "unshare", "ip") if not shutil.which(cmd)]
    if missing:
        return f"{', '.join(missing)} not found (util-linux, iproute2)"
    try:
        import grpc  # noqa: F401  (Ray Client)
        import ray  # noqa: F401
    except ImportError as exc:
        return f"Ray is not installed here ({exc}): pip install 'ray[client]' (the dev extras have it)"
    return ""


# The actors Ray's GCS does not call alive, with why it ended each (printed by a failed test: logs_tail).
DEATHS = """
import re
from ray._private import state
for a in state.actors().values():
    if a["State"] != "ALIVE":
        cause = str(a.get("DeathCause"))
        said = re.search(r'error_message: "(.*?)"', cause)
        print(a["ActorClassName"], a["State"], "pid", a.get("Pid"), said.group(1) if said else cause[:300])
"""


@dataclass
class TwoNodeRay:
    """Start with ``up()``, stop with ``down()`` (or use as a context manager)."""

    workdir: str = ""
    nodes: dict[str, subprocess.Popen] = field(default_factory=dict)  # each node's `ray start --block`
    links: list[str] = field(default_factory=list)  # interfaces and namespaces it made

    @property
    def address(self) -> str:
        """What ``--address`` names for a notebook outside the cluster (Ray Client)."""
        return f"ray://{NODES[HEAD]}:{CLIENT_PORT}"

    def __enter__(self) -> TwoNodeRay:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self, timeout: float = 120.0) -> TwoNodeRay:
        why = unavailable()
        if why:
            raise RuntimeError(why)
        _remove_stale()
        self.workdir = begin(STATE_FILE, "nbdist-ray-")
        try:
            self._network()
            ray = os.path.join(os.path.dirname(sys.executable), "ray")
            common = f"--block --num-cpus {CPUS} --object-store-memory {200 * 2**20} --disable-usage-stats"
            for name, addr in NODES.items():
                if name == HEAD:
                    args = f"--head --port {GCS_PORT} --ray-client-server-port {CLIENT_PORT} --include-dashboard false"
                else:
                    args = f"--address {NODES[HEAD]}:{GCS_PORT}"
                temp = f"--temp-dir {self.workdir}/{name}"  # its own sockets and logs (the nodes share a filesystem)
                script = f"hostname {name}; exec {ray} start {args} --node-ip-address {addr} {temp} {common}"
                log = open(os.path.join(self.workdir, f"{name}.log"), "w")  # noqa: SIM115 (the child holds it)
                self.nodes[name] = subprocess.Popen(
                    ["nsenter", f"--net=/var/run/netns/nb{name}", "unshare", "--uts", "sh", "-c", script],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env=_env(),
                )
                log.close()
                with open(os.path.join(self.workdir, f"{name}.pgid"), "w") as fh:
                    fh.write(str(self.nodes[name].pid))
                if name == HEAD:
                    self._wait_nodes(1, timeout)
            self._wait_nodes(len(NODES), timeout)
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """End what this object started, by process group, and remove its interfaces; safe to call twice."""
        for proc in reversed(list(self.nodes.values())):
            end(proc.pid, wait=5.0, group=True)  # `ray start --block` ends its node's processes
            proc.wait()
        self.nodes.clear()
        finish(self.workdir, STATE_FILE, self.links)
        self.workdir = ""

    def query(self, code: str, timeout: float = 60) -> str:
        """Run ``code`` in a fresh driver on the head node (``ray`` imported and connected); what it printed. For
        the tests' looks at Ray's own state: its actors and placement groups, as its GCS keeps them."""
        script = f"import ray\nray.init(address={NODES[HEAD] + ':' + str(GCS_PORT)!r}, log_to_driver=False)\n"
        script += textwrap.dedent(code)
        head = ["nsenter", f"--net=/var/run/netns/nb{HEAD}", sys.executable, "-c", script]
        done = subprocess.run(head, capture_output=True, text=True, timeout=timeout, env=_env())
        if done.returncode != 0:
            raise RuntimeError(f"a Ray query failed: {done.stderr.strip()[-800:]}")
        return done.stdout

    def _network(self) -> None:
        network(BRIDGE, HOST_ADDR, NODES, "nbrv", self.links)

    def _wait_nodes(self, count: int, timeout: float) -> None:
        """Until ``count`` nodes are alive, as the head's GCS says (asked inside the head's namespace)."""
        ray = os.path.join(os.path.dirname(sys.executable), "ray")
        deadline, said = time.monotonic() + timeout, ""
        while time.monotonic() < deadline:
            dead = [name for name, proc in self.nodes.items() if proc.poll() is not None]
            if dead:
                raise RuntimeError(f"ray start on {', '.join(dead)} ended: {self._log_tail()}")
            done = subprocess.run(
                ["nsenter", f"--net=/var/run/netns/nb{HEAD}", ray, "status", "--address", f"{NODES[HEAD]}:{GCS_PORT}"],
                capture_output=True,
                text=True,
                env=_env(),
            )
            said = done.stdout
            active = said.split("Active:", 1)[1].split("Pending:", 1)[0] if "Active:" in said else ""
            if active.count("node_") >= count:
                return
            time.sleep(0.5)
        raise RuntimeError(
            f"{count} Ray node(s) did not come up within {timeout:.0f} s: {said[-400:]} {self._log_tail()}"
        )

    def logs_tail(self, lines: int = 12) -> str:
        """The last lines of the head's Ray Client server logs (the proxier's and each driver's own server's) and of
        its GCS: what a failed test prints, since a Ray Client driver that never gets placed says nothing itself."""
        import glob

        logs = os.path.join(self.workdir, HEAD, "session_latest", "logs")
        found = sorted(glob.glob(os.path.join(logs, "ray_client_server*"))) + [os.path.join(logs, "gcs_server.err")]
        said = []
        for path in found:
            try:
                with open(path, errors="replace") as fh:
                    tail = fh.read().splitlines()[-lines:]
            except OSError:
                continue
            if tail:
                said.append(f"== {os.path.basename(path)}\n" + "\n".join(tail))
        said.append(self._deaths(logs))
        return "\n".join(said) or f"no Ray Client server logs under {logs}"

    def _deaths(self, logs: str) -> str:
        """Why each actor that is not alive ended (its death cause, asked of the head's GCS: its node died, or a
        `ray.kill`, which is nbdist's own driver letting it go) and what the GCS and the head node's raylet logged of
        kills, bundles and dead nodes: a living rank whose actor was ended says here by whom, and when."""
        import re

        said = []
        try:
            said.append("== actors not alive, with Ray's death cause\n" + self.query(DEATHS, timeout=30).strip())
        except Exception as exc:  # the head may be the node that left
            said.append(f"== actors: not asked ({type(exc).__name__}: {str(exc)[:200]})")
        wanted = re.compile(r"(?i)kill|cancel|bundle|node .*dead|dead node|reschedul|low on memory")
        for name in ("gcs_server.out", "raylet.out"):
            try:
                with open(os.path.join(logs, name), errors="replace") as fh:
                    lines = [
                        line[:300]
                        for line in fh.read().splitlines()
                        if line.startswith("[20") and "[state-dump]" not in line and wanted.search(line)  # no stats
                    ][-40:]
            except OSError:
                continue
            said.append(f"== {name} (kills, bundles, dead nodes)\n" + "\n".join(lines))
        return "\n".join(said)

    def _log_tail(self) -> str:
        tails = []
        for name in NODES:
            try:
                with open(os.path.join(self.workdir, f"{name}.log")) as fh:
                    tails.append(f"{name}: " + " | ".join(fh.read().splitlines()[-4:]))
            except OSError:
                pass
        return "; ".join(tails)


def _remove_stale() -> None:
    """A cluster left by a run that was killed: end its nodes by their process groups, remove its links."""
    remove_stale(STATE_FILE, [f"{name}.pgid" for name in NODES], NODES, [BRIDGE, "nbrv1", "nbrv2"], group=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["up"]:
        cluster = TwoNodeRay().up()
        print(f"up: {cluster.address} ({cluster.workdir}); `python -m tests.raynodes down` ends it")
        cluster.nodes.clear()  # leave it running: down() finds it through STATE_FILE
        cluster.links.clear()
    elif sys.argv[1:] == ["down"]:
        _remove_stale()
    else:
        sys.exit("usage: python -m tests.raynodes up|down")
