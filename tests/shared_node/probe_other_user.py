"""Run as another Unix user by test_other_user.py against a running world: try what a
neighbour on a shared node could try, and print (JSON) what worked.

argv: the cluster's directory, its client connection file, a copy of that file with a guessed
key, the rendezvous store's port, and the ports the world's processes listen on."""

from __future__ import annotations

import json
import os
import socket
import sys
from datetime import timedelta


def attempt(fn):
    try:
        return {"ok": True, "value": fn()}
    except Exception as exc:  # what the neighbour sees is the point
        return {"ok": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}


def zmtp1(*frames: bytes) -> bytes:
    """One message in ZMTP 1.0 framing (a length byte counting the flags byte, a flags byte, the body):
    libzmq takes a peer whose first byte is not 0xFF for a 1.0 peer, which needs no handshake."""
    return b"".join(bytes([len(f) + 1, int(i < len(frames) - 1)]) + f for i, f in enumerate(frames))


def junk(port: int) -> bool:
    """Random bytes, and messages a socket without CURVE would take in and pass on."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(zmtp1(b"") + zmtp1(b"junk", b"<IDS|MSG>", b"x") + zmtp1(b"garbage") * 5)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(os.urandom(4096))
    return True


def main() -> None:
    cluster_dir, connection, guessed, store_port, *ports = sys.argv[1:]
    said = {"uid": os.getuid()}
    said["list_cluster_dir"] = attempt(lambda: os.listdir(cluster_dir))
    said["read_connection_file"] = attempt(lambda: open(connection).read()[:20])

    def ipyparallel_client():
        import ipyparallel as ipp

        client = ipp.Client(guessed, timeout=5)
        try:
            return client.ids
        finally:
            client.close()

    said["ipyparallel_with_a_guessed_key"] = attempt(ipyparallel_client)

    def store():
        from torch.distributed import TCPStore

        client = TCPStore("127.0.0.1", int(store_port), is_master=False, timeout=timedelta(seconds=5))
        return len(client.list_keys())

    said["store_list_keys"] = attempt(store)
    said["junk_to_every_port"] = [attempt(lambda p=int(p): junk(p)) for p in ports]
    print(json.dumps(said))


if __name__ == "__main__":
    main()
