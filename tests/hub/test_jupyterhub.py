"""A real JupyterHub spawns the notebook server as a Slurm job over both test nodes; %dist_start with no
arguments in a kernel of that server puts one rank on each node, and DDP there equals one process.

The hub is the repo's deploy/jupyterhub/jupyterhub_config.py (tests/hubsetup.py adds only ports, a
dummy password and SLURM_CONF), with batchspawner's SlurmSpawner behind wrapspawner's ProfilesSpawner,
configurable-http-proxy from npm, and a Unix user made for the test. The test logs in through the
hub's REST API, spawns, opens a kernel through the server's API, talks to it over the websocket as
JupyterLab does, stops the server and the hub, and checks that no job and no process is left.
Times are bounded only to catch hangs.
"""

from __future__ import annotations

import sys
import time

import psutil
import pytest

from tests import hubsetup
from tests.slurmnodes import HOST_ADDR, NODES

SPAWN_S = 240  # the job starts, the server imports JupyterLab on a 2-core machine, reports its port
CELL_S = 240


def _wait_ready(hub: hubsetup.Hub, user: str, token: str) -> dict:
    deadline = time.monotonic() + SPAWN_S
    while time.monotonic() < deadline:
        server = hub.request("GET", f"/hub/api/users/{user}", token)["servers"].get("")
        if server and server.get("ready"):
            return server
        if not server:
            raise AssertionError(f"the server is gone while starting: {hub.log_tail()}")
        time.sleep(1)
    raise AssertionError(f"the server was not ready within {SPAWN_S} s: {hub.log_tail()}")


def _wait_stopped(hub: hubsetup.Hub, user: str, token: str) -> None:
    deadline = time.monotonic() + 60
    while hub.request("GET", f"/hub/api/users/{user}", token)["servers"] and time.monotonic() < deadline:
        time.sleep(0.5)


def test_a_hub_spawns_the_notebook_on_two_nodes_and_dist_start_uses_both(two_nodes, monkeypatch):
    why = hubsetup.unavailable()
    if why:
        pytest.skip(why)
    monkeypatch.setenv("SLURM_CONF", two_nodes.conf)
    repo = str(hubsetup.ROOT)
    envs = [repo, sys.prefix, sys.base_prefix]  # the checkout, its .venv, the interpreter the .venv links to
    with hubsetup.hub_user() as user, hubsetup.readable_by(user, envs), hubsetup.node_names(NODES):
        hub = hubsetup.Hub(HOST_ADDR, two_nodes.env)
        proxy_pid = 0
        try:
            hub.start()
            proxy_pid = hub.proxy_pid()
            assert proxy_pid, "the hub started no configurable-http-proxy"
            with pytest.raises(hubsetup.HubError, match="403"):
                hub.request(
                    "POST", f"/hub/api/users/{user}/tokens", body={"auth": {"username": user, "password": "no"}}
                )
            login = {"auth": {"username": user, "password": hubsetup.PASSWORD}, "note": "nbdist test"}
            token = hub.request("POST", f"/hub/api/users/{user}/tokens", body=login)["token"]

            try:
                hub.request("POST", f"/hub/api/users/{user}/server", token, body={"profile": "cpu-2x1"})
                _wait_ready(hub, user, token)
            except (hubsetup.HubError, AssertionError) as exc:
                raise AssertionError(f"{exc}\nthe job's log: {hubsetup.job_logs(user)}") from None
            jobs = two_nodes.jobs()
            assert len(jobs) == 1
            job = jobs[0]
            assert two_nodes.run("squeue", "-h", "-j", job, "-o", "%N %D %u").stdout.split() == ["node[1-2]", "2", user]

            kernel = hub.request("POST", f"/user/{user}/api/kernels", token, body={"name": "python3"})
            ws = hub.url.replace("http", "ws", 1) + f"/user/{user}/api/kernels/{kernel['id']}/channels"
            ddp = (
                f"import sys; sys.path.insert(0, {repo!r})\n"
                "import nbdist\n"
                "from tests.helpers import check_ddp_against_one_process\n"
                "c = nbdist.current()\n"
                "check_ddp_against_one_process(c)\n"
                "print('HOSTS', sorted(r.host for r in c.ranks), c.backend, 'DDP equal to one process')"
            )
            cells = ["%load_ext nbdist", "%dist_start --timeout 120", "%dist_status", ddp, "%dist_stop"]
            results = hubsetup.run_in_kernel(ws, token, cells, timeout=CELL_S)
            transcript = "\n".join(f"[{i}] {r['out']}" for i, r in enumerate(results))
            assert len(results) == len(cells) and not any(r["error"] for r in results), transcript
            started = results[1]["out"]
            assert (
                f"2 ranks = 2 tasks allocated on node1,node2 (Slurm job {job}); engines via srun --overlap" in started
            )
            assert "2 ranks ready on 2 hosts (node1, node2), backend gloo" in started
            assert "node1" in results[2]["out"] and "node2" in results[2]["out"]
            assert "HOSTS ['node1', 'node2'] gloo DDP equal to one process" in results[3]["out"]

            hub.request("DELETE", f"/user/{user}/api/kernels/{kernel['id']}", token)
            hub.request("DELETE", f"/hub/api/users/{user}/server", token)
            _wait_stopped(hub, user, token)
        finally:
            hub.stop()
        assert two_nodes.wait_empty(30) == [], "the notebook's Slurm job outlived the hub"
        left = [p.pid for p in psutil.process_iter(["username"]) if p.info["username"] == user]
        assert not left, f"processes of {user} outlived the hub: {left}"
        assert not proxy_pid or not psutil.pid_exists(proxy_pid), "configurable-http-proxy outlived the hub"
