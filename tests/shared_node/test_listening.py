"""Nothing a world opens listens beyond what the world needs (issue 31).

Where the host name resolves to a network address (most GPU nodes: ``hostname -i`` is the
node's own), gloo and NCCL listen on that address unless told otherwise, and torch's
TCPStore listens on every interface whatever host it is given. The test builds that node:
a veth pair holding 10.213.7.1 and a mount namespace whose /etc/hosts maps this host's name
to it; a world started there must listen on 127.0.0.1 only, after its start, a
``%dist_restart`` and a recovery. (The Slurm world's check is in tests/multinode.)
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
PROBE = pathlib.Path(__file__).with_name("probe_local.py")
NODE_ADDR = "10.213.7.1"
LINK = "nbls0"
HANG_S = 300

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root: the test makes a veth pair and a mount namespace (CI runs as root)"
)


def _ip(*args: str, check: bool = True) -> None:
    subprocess.run(["ip", *args], check=check, capture_output=True)


@pytest.fixture
def node_address(tmp_path):
    """This host's name resolving to a network address, in a mount namespace's /etc/hosts."""
    _ip("link", "del", LINK, check=False)  # a leftover of a killed run
    _ip("link", "add", LINK, "type", "veth", "peer", "name", LINK + "p")
    try:
        _ip("addr", "add", f"{NODE_ADDR}/24", "dev", LINK)
        _ip("link", "set", LINK, "up")
        hosts = tmp_path / "hosts"
        hosts.write_text(f"127.0.0.1 localhost\n{NODE_ADDR} {socket.gethostname()}\n")
        yield hosts
    finally:
        _ip("link", "del", LINK, check=False)


def test_a_local_world_listens_on_loopback_only_where_the_host_name_resolves_to_the_network(node_address):
    cmd = ["unshare", "--mount", "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$1" "$2"']
    proc = subprocess.Popen(
        [*cmd, str(node_address), sys.executable, str(PROBE)],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=HANG_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    # the trap is set: left to themselves, gloo and NCCL would listen on the node's address
    assert report["host_resolves_to"] == NODE_ADDR
    for step in ("start", "restart", "recovery"):
        sockets = report[step]["sockets"]
        wrong = [f"{a}:{p} ({k}, pid {pid})" for a, p, pid, k in sockets if a != "127.0.0.1"]
        assert not wrong, f"after the {step}, listening beyond loopback: {wrong}"
        owners = {pid for _, _, pid, _ in sockets}
        assert set(report[step]["ranks"]) <= owners, f"after the {step}, a rank listens on nothing: {sockets}"
        rank0 = report[step]["ranks"][0]
        assert ("127.0.0.1", report[step]["store"], rank0, "tcp") in [tuple(s) for s in sockets], (
            f"after the {step}, rank 0's store is not on 127.0.0.1:{report[step]['store']}"
        )
