"""What the two-node test clusters (tests/slurmnodes.py, tests/raynodes.py) share: nodes as network and UTS
namespaces on a bridge of their own, a private directory whose path is kept in a state file so that a run
killed half-way is cleaned up by the next one, and processes ended by pid or process group, never by name."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip() or done.stdout.strip()}")
    return done


def end(pid: int, wait: float = 10.0, group: bool = False) -> None:
    """SIGTERM the process (``group``: the process group) this test's cluster started, then SIGKILL it after
    ``wait`` seconds."""
    send = os.killpg if group else os.kill
    try:
        send(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            send(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    try:
        send(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def begin(state_file: str, prefix: str) -> str:
    """The cluster's private directory (readable by the nodes' unprivileged processes), noted in ``state_file``."""
    workdir = tempfile.mkdtemp(prefix=prefix)
    os.chmod(workdir, 0o755)
    with open(state_file, "w") as fh:
        fh.write(workdir)
    return workdir


def finish(workdir: str, state_file: str, links: list[str]) -> None:
    """Remove the links and namespaces (``netns:NAME``) in ``links``, newest first, and the directory."""
    for link in reversed(links):
        if link.startswith("netns:"):
            sh("ip", "netns", "del", link[6:], check=False)
        else:
            sh("ip", "link", "del", link, check=False)
    links.clear()
    if workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    try:
        os.unlink(state_file)
    except FileNotFoundError:
        pass


def network(bridge: str, host_addr: str, nodes: dict[str, str], veth: str, links: list[str], rate: str = "") -> None:
    """A bridge at ``host_addr`` and one namespace ``nb<node>`` per node, its ``eth0`` at the node's address on
    the bridge (each link shaped to ``rate`` by tc's token bucket where given); what it made goes into ``links``."""
    sh("ip", "link", "add", bridge, "type", "bridge")
    links.append(bridge)
    sh("ip", "addr", "add", f"{host_addr}/24", "dev", bridge)
    sh("ip", "link", "set", bridge, "up")
    for i, (name, addr) in enumerate(nodes.items(), start=1):
        ns, link = f"nb{name}", f"{veth}{i}"
        sh("ip", "netns", "add", ns)
        links.append(f"netns:{ns}")
        sh("ip", "link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", ns)
        links.append(link)
        sh("ip", "link", "set", link, "master", bridge, "up")
        if rate:
            sh("tc", "qdisc", "add", "dev", link, "root", "tbf", "rate", rate, "burst", "256kb", "latency", "50ms")
        sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")


def remove_stale(state_file: str, pid_files: list[str], nodes: dict[str, str], links: list[str], group: bool) -> None:
    """A cluster left by a run that was killed: end what its pid files name, remove its directory and links."""
    try:
        with open(state_file) as fh:
            old = fh.read().strip()
    except FileNotFoundError:
        old = ""
    if old and os.path.isdir(old):
        for name in pid_files:
            try:
                with open(os.path.join(old, name)) as fh:
                    end(int(fh.read().strip()), wait=5.0, group=group)
            except (OSError, ValueError):
                pass
        shutil.rmtree(old, ignore_errors=True)
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for node in nodes:
        if f"nb{node}" in names:
            sh("ip", "netns", "del", f"nb{node}", check=False)
    for link in links:
        sh("ip", "link", "del", link, check=False)
