"""A real JupyterHub for tests: the repo's deploy/jupyterhub/jupyterhub_config.py on the two-node test Slurm.

What a test needs beside the hub itself, each undone when the test ends (also when it fails):
a Unix user for the notebook server (``useradd``; the hub runs ``sbatch`` as that user through
sudo), read access for that user to this checkout and its .venv (ACL entries on directories
that others may not enter, such as a 0700 temp dir), the node names in /etc/hosts (the proxy
reaches the server at the node name that squeue reports), and configurable-http-proxy (npm).
The hub gets only the settings a test must add (ports, a dummy authenticator, SLURM_CONF);
everything else is the deployment file as docs/jupyterhub.md describes it.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from typing import Any

from tests.helpers import free_port

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEPLOY_CONFIG = ROOT / "deploy" / "jupyterhub" / "jupyterhub_config.py"
USER, PASSWORD = "nbhubtest", "nbdist-test-password"
HOSTS_MARK = "# nbdist test Slurm"


def unavailable() -> str:
    """Why a hub cannot run here ('' when it can)."""
    if os.geteuid() != 0:
        return "the JupyterHub test needs root (a test user, sudo, ACLs); run the suite as root"
    for module in ("jupyterhub", "batchspawner", "wrapspawner"):
        try:
            __import__(module)
        except ImportError:
            return f"{module} is not installed in this environment (pip install -e '.[dev]')"
    if not proxy_command():
        return "configurable-http-proxy is not installed (`make test` installs it as root: tests/system-packages.sh)"
    missing = [cmd for cmd in ("sudo", "setfacl", "useradd") if not shutil.which(cmd)]
    if missing:
        return f"{', '.join(missing)} not found (`make test` installs sudo and acl as root: tests/system-packages.sh)"
    return ""


def proxy_command() -> str:
    """configurable-http-proxy ('' when missing)."""
    return shutil.which("configurable-http-proxy") or ""


@contextmanager
def hub_user():
    """A Unix user with a home directory, removed afterwards (with every process it still has)."""
    subprocess.run(["userdel", "-r", USER], capture_output=True)  # a leftover of a killed run
    subprocess.run(["useradd", "-m", "-s", "/bin/bash", USER], check=True, capture_output=True)
    try:
        yield USER
    finally:
        subprocess.run(["pkill", "-KILL", "-u", USER], capture_output=True)  # only this test's user
        subprocess.run(["userdel", "-r", USER], capture_output=True)


@contextmanager
def readable_by(user: str, paths: list[str]):
    """Let ``user`` read these directories and pass through their parents: an ACL entry (r-x on
    the directory, --x on a parent) where others may not; the entries are removed afterwards."""
    added: list[str] = []
    try:
        for path in paths:
            p = pathlib.Path(path).resolve()
            for d, perms in [(p, "rx"), *((parent, "x") for parent in p.parents)]:
                if not os.stat(d).st_mode & stat.S_IXOTH and str(d) not in added:
                    subprocess.run(["setfacl", "-m", f"u:{user}:{perms}", str(d)], check=True, capture_output=True)
                    added.append(str(d))
        yield added
    finally:
        for d in added:
            subprocess.run(["setfacl", "-x", f"u:{user}", str(d)], capture_output=True)


@contextmanager
def node_names(nodes: dict[str, str]):
    """The test nodes' names in /etc/hosts (a real cluster's DNS), removed afterwards. Written in
    place: /etc/hosts may be a bind mount."""
    _drop_hosts_lines()
    with open("/etc/hosts", "a") as fh:
        fh.writelines(f"{addr} {name} {HOSTS_MARK}\n" for name, addr in nodes.items())
    try:
        yield
    finally:
        _drop_hosts_lines()


def _drop_hosts_lines() -> None:
    with open("/etc/hosts") as fh:
        lines = fh.readlines()
    kept = [line for line in lines if not line.rstrip().endswith(HOSTS_MARK)]
    if kept != lines:
        with open("/etc/hosts", "w") as fh:
            fh.writelines(kept)


class Hub:
    """``jupyterhub`` with the deployment config plus the test's settings; ``stop()`` ends it and its proxy."""

    def __init__(self, cluster_ip: str, slurm_env: dict[str, str]) -> None:
        self.dir = tempfile.mkdtemp(prefix="nbdist-hub-")
        self.cluster_ip = cluster_ip
        self.url = f"http://127.0.0.1:{free_port('127.0.0.1')}"
        self.env = dict(
            os.environ,
            **slurm_env,
            NBDIST_HUB_CLUSTER_IP=cluster_ip,
            PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
        )
        self.proc: subprocess.Popen | None = None
        self.log = os.path.join(self.dir, "hub.log")

    def write_config(self) -> str:
        path = os.path.join(self.dir, "test_config.py")
        proxy_api = free_port("127.0.0.1")
        with open(path, "w") as fh:
            fh.write(
                f"""c = get_config()
load_subconfig({str(DEPLOY_CONFIG)!r})
# What only a test adds: its own ports and files, a dummy password, the test cluster's SLURM_CONF.
c.JupyterHub.bind_url = {self.url!r}
c.JupyterHub.hub_port = {free_port(self.cluster_ip)}
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{proxy_api}"
c.ConfigurableHTTPProxy.command = [{proxy_command()!r}]
c.ConfigurableHTTPProxy.pid_file = {os.path.join(self.dir, "proxy.pid")!r}
c.JupyterHub.db_url = "sqlite:///{self.dir}/jupyterhub.sqlite"
c.JupyterHub.cookie_secret_file = {os.path.join(self.dir, "cookie_secret")!r}
c.JupyterHub.authenticator_class = "dummy"
c.DummyAuthenticator.password = {PASSWORD!r}
c.Authenticator.allowed_users = {{{USER!r}}}
c.Spawner.env_keep.append("SLURM_CONF")
c.JupyterHub.cleanup_servers = True
"""
            )
        return path

    def start(self, timeout: float = 60) -> Hub:
        config = self.write_config()
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jupyterhub", "-f", config],
                cwd=self.dir,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyterhub exited ({self.proc.returncode}): {self.log_tail()}")
            try:
                self.request("GET", "/hub/api")
                return self
            except (OSError, HubError):  # not listening yet, or the proxy has no route to the hub yet
                time.sleep(0.3)
        raise RuntimeError(f"jupyterhub did not answer within {timeout:.0f} s: {self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM to the hub (it stops the user's server and its proxy), then SIGKILL to what is left
        of the processes it started (its process group), by pid."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # what the hub started in its own process group
        except ProcessLookupError:
            pass
        proxy = self.proxy_pid()
        if proxy:  # the hub starts the proxy in a session of its own and may not have stopped it
            os.kill(proxy, signal.SIGKILL)
        shutil.rmtree(self.dir, ignore_errors=True)
        self.proc = None

    def proxy_pid(self) -> int:
        """The pid of the proxy this hub started, while it runs (from the hub's pid file); else 0."""
        import psutil

        try:
            with open(os.path.join(self.dir, "proxy.pid")) as fh:
                pid = int(fh.read().strip())
            alive = psutil.Process(pid)
            return pid if "configurable-http-proxy" in " ".join(alive.cmdline()) else 0
        except (OSError, ValueError, psutil.Error):
            return 0

    def log_tail(self, n: int = 4000) -> str:
        try:
            with open(self.log) as fh:
                lines = [line for line in fh if " 200 GET " not in line]  # the test's own polling
        except OSError:
            return ""
        return "".join(lines)[-n:]

    def request(self, method: str, path: str, token: str = "", body: Any = None, timeout: float = 30) -> Any:
        """One HTTP request to the hub's public URL (the proxy); the decoded JSON answer."""
        import urllib.error
        import urllib.request

        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if token:
            req.add_header("Authorization", f"token {token}")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                text = resp.read().decode()
        except urllib.error.HTTPError as exc:
            said = f"{method} {path}: {exc.code} {exc.read().decode()[:500]}"
            raise HubError(said + (f"; the hub's log: {self.log_tail(3000)}" if exc.code >= 500 else "")) from None
        return json.loads(text) if text.strip() else None


def job_logs(user: str) -> str:
    """The notebook jobs' own output (SlurmSpawner writes it to the user's home), for failure messages."""
    home = pathlib.Path(os.path.expanduser(f"~{user}"))
    return "\n".join(f"{p.name}: {p.read_text()[-3000:]}" for p in sorted(home.glob("jupyterhub_slurmspawner_*.log")))


class HubError(RuntimeError):
    """The hub answered with an HTTP error (not an OSError: the hub is up)."""


def run_in_kernel(ws_url: str, token: str, cells: list[str], timeout: float) -> list[dict]:
    """Run cells one after another in a kernel, through the server's websocket (the Jupyter
    protocol as JupyterLab speaks it); per cell: {'out': text of its streams, 'error': ename or ''}."""
    return asyncio.run(_run_cells(ws_url, token, cells, timeout))


def _decode(raw: str | bytes) -> dict:
    """A websocket message: JSON text, or (a message with buffers: widget updates) the binary frame
    the server sends, decoded as JupyterLab decodes it."""
    if isinstance(raw, bytes):
        from jupyter_server.services.kernels.connection.base import deserialize_binary_message

        return deserialize_binary_message(raw)
    return json.loads(raw)


async def _run_cells(ws_url: str, token: str, cells: list[str], timeout: float) -> list[dict]:
    from tornado.httpclient import HTTPRequest
    from tornado.websocket import websocket_connect

    conn = await websocket_connect(HTTPRequest(ws_url, headers={"Authorization": f"token {token}"}))
    session = uuid.uuid4().hex
    results = []
    try:
        for code in cells:
            msg_id = uuid.uuid4().hex
            header = {"msg_id": msg_id, "msg_type": "execute_request", "session": session, "username": USER}
            header.update(version="5.3", date="")
            content = {"code": code, "silent": False, "store_history": True, "user_expressions": {}}
            content.update(allow_stdin=False, stop_on_error=True)
            msg = {"header": header, "parent_header": {}, "metadata": {}, "content": content, "channel": "shell"}
            await conn.write_message(json.dumps(msg))
            out, error, replied, idle = [], "", False, False
            deadline = time.monotonic() + timeout
            while not (replied and idle):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"cell did not finish within {timeout:.0f} s: {code[:80]!r}; output: {out}")
                raw = await asyncio.wait_for(conn.read_message(), left)
                if raw is None:
                    raise ConnectionError(f"the kernel's websocket closed; output so far: {''.join(out)}")
                reply = _decode(raw)
                if reply.get("parent_header", {}).get("msg_id") != msg_id:
                    continue
                kind, body = reply["msg_type"], reply["content"]
                if kind == "stream":
                    out.append(body["text"])
                elif kind in ("execute_result", "display_data"):
                    out.append(body.get("data", {}).get("text/plain", "") + "\n")
                elif kind == "error":
                    error = body["ename"]
                    out.append(f"{body['ename']}: {body['evalue']}\n")
                elif kind == "execute_reply":
                    replied = True
                elif kind == "status" and body.get("execution_state") == "idle":
                    idle = True
            results.append({"out": "".join(out), "error": error})
            if error:
                break
    finally:
        conn.close()
    return results
