"""Run by test_listening.py in a mount namespace whose /etc/hosts maps this host's name to a
network address, as on most GPU nodes: start a 2-rank world, restart it, let it recover from a
killed rank, and print (JSON) what every process below this one listens on after each step."""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile

sys.path.insert(0, os.getcwd())

import nbdist  # noqa: E402
from tests.sockets import listening, tree  # noqa: E402

KILL_ONCE = """
import os
if dist.get_rank() == 1 and not os.path.exists({mark!r}):
    open({mark!r}, "w").close()
    os.kill(os.getpid(), 9)
dist.all_reduce(torch.ones(1))
"""


def snapshot(cluster: nbdist.Cluster) -> dict:
    cluster.run("dist.all_reduce(torch.ones(1))", quiet=True).raise_for_error()
    return {
        "sockets": listening(tree(os.getpid())),
        "ranks": [r.pid for r in cluster.ranks],
        "store": cluster.master_port,
    }


def main() -> None:
    report: dict = {"host_resolves_to": socket.gethostbyname(socket.gethostname())}
    mark = os.path.join(tempfile.mkdtemp(), "killed")
    with nbdist.start(2, max_restarts=1, timeout=60) as cluster:
        report["start"] = snapshot(cluster)
        cluster.restart()
        report["restart"] = snapshot(cluster)
        result = cluster.run(KILL_ONCE.format(mark=mark), quiet=True).raise_for_error()
        assert result.recovered, "the killed rank was not recovered"
        report["recovery"] = snapshot(cluster)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
