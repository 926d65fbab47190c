"""What another Unix user on the same host can and cannot do to a running world (issue 31).

The test (as root, as CI runs) creates a second user and, while a 2-rank world runs, has it
try what a neighbour on a shared GPU node could: read the cluster's directory and connection
file, talk to the controller with a guessed key, reach the rendezvous store, and send junk
(random bytes, and ZMTP 1.0 messages, which need no handshake) to every port the world listens on. docs/jupyterhub.md ("Sharing a node") says the same in words;
the world must compute correctly afterwards.
"""

from __future__ import annotations

import glob
import json
import os
import pathlib
import pwd
import secrets
import shutil
import subprocess
import sys
import tempfile

import pytest

import nbdist
from tests.hubsetup import readable_by
from tests.sockets import listening, tree

USER = "nbdist-neighbour"
PROBE = pathlib.Path(__file__).with_name("probe_other_user.py")
REPO = pathlib.Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the test creates a second Unix user")


@pytest.fixture(scope="module")
def neighbour():
    """A second Unix user who may run this Python and read this repository (ACLs, removed afterwards)."""
    subprocess.run(["userdel", USER], capture_output=True)  # a leftover of a killed run
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", USER], check=True)
    try:
        with readable_by(USER, sorted({sys.prefix, sys.base_prefix, str(REPO)})):
            yield pwd.getpwnam(USER)
    finally:
        subprocess.run(["pkill", "-KILL", "-u", USER], capture_output=True)  # only this test's user
        subprocess.run(["userdel", USER], capture_output=True)


@pytest.fixture
def shared_dir():
    """A directory the neighbour may read (pytest's tmp_path is under a 0700 directory)."""
    path = pathlib.Path(tempfile.mkdtemp(prefix="nbdist-neighbour-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_another_user_cannot_read_the_world_or_command_it_and_cannot_break_it(neighbour, shared_dir):
    tmp_path = shared_dir
    with nbdist.start(2, timeout=60) as cluster:
        workdir = cluster.engines.workdir
        connection = glob.glob(os.path.join(workdir, "profile", "security", "ipcontroller-*-client.json"))[0]
        info = json.loads(pathlib.Path(connection).read_text())
        guessed = tmp_path / "guessed.json"
        guessed.write_text(json.dumps({**info, "key": secrets.token_hex(16)}))
        os.chmod(guessed, 0o644)
        ports = sorted({p for _, p, _, _ in listening(tree(*cluster.pids()))})
        assert cluster.master_port in ports
        done = subprocess.run(
            [sys.executable, str(PROBE), workdir, connection, str(guessed), str(cluster.master_port), *map(str, ports)],
            user=neighbour.pw_uid,
            group=neighbour.pw_gid,
            extra_groups=[],
            env={"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        said = json.loads(done.stdout.strip().splitlines()[-1])
        assert said["uid"] == neighbour.pw_uid

        # cannot: the cluster's directory is 0700, the connection file (the HMAC key) 0600
        assert said["list_cluster_dir"] == {
            "ok": False,
            "error": f"PermissionError: [Errno 13] Permission denied: '{workdir}'",
        }
        assert said["read_connection_file"]["error"].startswith("PermissionError")
        # cannot: the controller drops messages signed with another key, so no client ever connects
        assert not said["ipyparallel_with_a_guessed_key"]["ok"]
        assert "TimeoutError" in said["ipyparallel_with_a_guessed_key"]["error"]
        # can: torch's store is unauthenticated; on loopback it is reachable from this host (docs/jupyterhub.md)
        assert said["store_list_keys"]["ok"], said["store_list_keys"]
        # junk reached every port, and broke nothing: random bytes, and ZMTP 1.0 messages, which without
        # CURVE the controller took in and forwarded until the next cell never reached the engines
        assert all(j["ok"] for j in said["junk_to_every_port"]), said["junk_to_every_port"]
        result = cluster.run("t = torch.tensor([dist.get_rank() + 1.0])\ndist.all_reduce(t)", quiet=True, timeout=60)
        result.raise_for_error()
        assert cluster.pull("t.item()") == [3.0, 3.0]
