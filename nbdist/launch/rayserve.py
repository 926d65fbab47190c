"""A world's Ray driver serves the world's later engine sets, so a replaced or added rank starts warm, in a bundle
the world holds (with ``NBDIST_WARM=0`` too, cold: a driver of its own would wait for the CPUs the world keeps).

Each engine set of a Ray world is a driver process (ray.py's ``main``). The first one connects to Ray (through
Ray Client: seconds), and holds the nodes' warm processes (rayworld.py). A later engine set of the same world
(``%dist_restart``, automatic recovery, ``%dist_grow``) would pay all that again; instead its driver first asks
the world's first driver, through a Unix socket in the cluster's private directory (0700, the socket 0600, and
only a peer of the same user is heard), to place and start its ranks there. It relays what that driver says,
lives as long as those ranks live, and exits with their worst exit code, as a driver of its own would; when it
ends first (``%dist_stop``, a Ctrl-C of the wait, its kernel's death), the world's driver ends its ranks. Where
no driver answers (it ended, or runs on another host), the engine set is a driver of its own, as before.

The kernel asks one more thing, once its world has formed: ``{"ahead": true}``, to make the nodes' warm processes
(rayworld.py's ``warm_up``, from the driver's loop: the first start does not wait for them); nothing is said
back.

One JSON line each way at a time. Asked: ``{"n", "command", "env"}`` (the environment the engine set's own
driver would have passed its engines). Said back: ``{"say": line}`` to print,
``{"waiting": line}`` while Ray has not placed them, ``{"preflight": line}`` when the cluster cannot hold them, ``{"started": true}`` once the engines run, and
``{"exit": code}`` when the last ends.

The driver's own loop (``keep_polling``) polls every group's ranks, and tells the serving side which groups ended.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from . import rayworld

SOCKET = "ray-driver.sock"  # in the cluster's private directory


def path(cluster_dir: str) -> str:
    return os.path.join(cluster_dir, SOCKET)


def ask(
    cluster_dir: str,
    n: int,
    command: list[str],
    env: dict[str, str],
    say: Callable[[str], None],
    waiting: Callable[[str], None],
    preflight: Callable[[str], None],
) -> int | None:
    """Have the world's driver start these ranks; their worst exit code once they all ended (2 when the cluster
    cannot hold them: ``preflight`` hears why), or None where no driver took them (this process starts them)."""
    where = path(cluster_dir)
    if not cluster_dir or not os.path.exists(where):
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(where)
        conn.sendall(json.dumps({"n": n, "command": command, "env": env}).encode() + b"\n")
    except OSError:
        conn.close()
        return None
    started = False
    with conn, conn.makefile("rb") as lines:
        for raw in lines:
            said = json.loads(raw)
            if "say" in said:
                say(said["say"])
            if "waiting" in said:
                waiting(said["waiting"])
            if "preflight" in said:
                preflight(said["preflight"])
                return 2
            started = started or bool(said.get("started"))
            if "exit" in said:
                return int(said["exit"])
    return 1 if started else None  # the world's driver ended (and its ranks with it), or never took them


def ahead(cluster_dir: str) -> None:
    """Have the world's driver make what its later ranks start from (the nodes' warm processes); nothing where no
    driver serves this cluster (it ended, or runs on another host). Does not wait for them."""
    where = path(cluster_dir)
    if not cluster_dir or not os.path.exists(where):
        return
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(2.0)
        conn.connect(where)
        conn.sendall(json.dumps({"ahead": True}).encode() + b"\n")


class Server:
    """Serves ``ask`` for one World (rayworld.py) from threads; ``finished`` hands a group's end to its asker."""

    def __init__(self, cluster_dir: str, world: Any) -> None:
        self.world = world
        self.where = path(cluster_dir)
        self.waiting: dict[int, socket.socket] = {}  # group -> the connection that waits for its end
        self.ended: dict[int, int] = {}  # groups that ended before their connection was recorded
        self.lock = threading.Lock()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.where)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            self.sock.bind(self.where)
        finally:
            os.umask(old)
        self.sock.listen(8)
        self.accepting = threading.Thread(target=self._accept, name="nbdist-ray-serve", daemon=True)
        self.accepting.start()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.where)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept below (closing the socket alone does not)
        with contextlib.suppress(OSError):
            self.sock.close()
        self.accepting.join(5)

    def finished(self, gid: int, code: int) -> None:
        with self.lock:
            conn = self.waiting.pop(gid, None)
            if conn is None:
                self.ended[gid] = code
        if conn is not None:
            _send(conn, {"exit": code})
            with contextlib.suppress(OSError):
                conn.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            if _peer_uid(conn) != os.getuid():
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="nbdist-ray-asked", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        left = threading.Event()
        try:
            asked = json.loads(conn.makefile("rb").readline() or b"{}")
            if asked.get("ahead"):  # the driver's loop makes them (World.poll)
                conn.close()
                self.world.warm_asked.set()
                return
            n, command, env = int(asked["n"]), list(asked["command"]), dict(asked.get("env") or {})
        except (OSError, ValueError, KeyError, TypeError):
            conn.close()
            return
        threading.Thread(target=_watch_close, args=(conn, left), daemon=True).start()
        short = self.world.cannot_hold(n)
        if short:
            _send(conn, {"preflight": short})
            conn.close()
            return
        try:
            gid = self.world.start(
                n,
                command,
                say=lambda line: _send(conn, {"say": line}),
                waiting=lambda line: _send(conn, {"waiting": line}),
                gone=left.is_set,
                env=env,
            )
        except rayworld.NodeLeft as exc:
            _send(conn, {"preflight": str(exc)})
            conn.close()
            return
        except Exception as exc:
            _send(conn, {"say": f"nbdist: the world's Ray driver could not start the rank(s): {exc}"})
            conn.close()
            return
        _send(conn, {"started": True})
        with self.lock:
            self.waiting[gid] = conn
            code = self.ended.pop(gid, None)
        if code is not None:  # its ranks ended already
            self.finished(gid, code)
        left.wait()  # the asker ended (or finished() closed the connection): its ranks end with it
        with self.lock:
            mine = self.waiting.pop(gid, None)
        if mine is not None:
            self.world.stop_group(gid)


def _watch_close(conn: socket.socket, left: threading.Event) -> None:
    """Set ``left`` once the asker's end of the connection closes (it sends nothing after its request)."""
    try:
        while conn.recv(1024):
            pass
    except OSError:
        pass
    left.set()


def _send(conn: socket.socket, message: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):
        conn.sendall(json.dumps(message).encode() + b"\n")


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[2]


POLL_PATIENCE_S = 60.0  # the driver's poll failing this long in a row ends the world, with its line in ENDED


def keep_polling(
    world: rayworld.World,
    first: int,
    server: Server | None,
    say: Callable[[str], None],
    nap: float = 0.5,
    patience_s: float = POLL_PATIENCE_S,
) -> int:
    """Poll the world's ranks until none is left; the first group's worst exit code. An engine that ended gives
    its bundle back to the world at once: its replacement may need it. A poll that raises (nbdist's bug or Ray's)
    is said, with its traceback the first time, and tried again while the ranks run on: before, any such error
    ended every rank of the world with no word to the notebook. Only one that lasts ``patience_s`` ends them."""
    worst, failing_since, said = 0, 0.0, set()
    while True:
        try:
            ended = world.poll(say)
        except Exception as exc:
            now, what = time.monotonic(), first_line(exc)
            failing_since = failing_since or now
            if what not in said:
                said.add(what)
                say(
                    f"nbdist: launch the driver's poll of its ranks failed ({what}); they run on, polled again:\n"
                    + traceback.format_exc().rstrip()
                )
            if now - failing_since >= patience_s:
                raise RuntimeError(f"its poll of the ranks failed for {patience_s:.0f} s: {what}") from exc
            time.sleep(nap)
            continue
        failing_since = 0.0
        for gid, code in ended:
            if gid == first:
                worst = code
            elif server is not None:
                server.finished(gid, code)
        if not world.busy():
            return worst
        time.sleep(nap)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__
