"""Addresses on this host: which local address routes to a peer, which interface holds it, can we connect.

Used on the notebook side (the address the controller binds) and on the engines (the
interface gloo and NCCL use, the preflight checks). Linux, IPv4.
"""

from __future__ import annotations

import errno
import socket
import struct

LOOPBACK = "127.0.0.1"
_SIOCGIFADDR = 0x8915


def route_source(dest: str) -> str:
    """This host's address on the route to ``dest`` (a UDP 'connect' sends nothing); OSError if there is none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((dest, 9))
        return str(sock.getsockname()[0])


def listen_on(host: str) -> socket.socket:
    """A TCP socket listening on ``host`` alone (an address, not every interface), on a port the OS picks."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, 0), family=family, backlog=1024)


def loopback_interface() -> str | None:
    """The name of the interface that holds 127.0.0.1 ('lo' on Linux)."""
    return interface_of(LOOPBACK)


def interfaces() -> dict[str, str]:
    """Interface name -> its IPv4 address, for every interface that has one."""
    import fcntl

    out: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            out[name] = socket.inet_ntoa(packed[20:24])
    return out


def interface_of(addr: str) -> str | None:
    """The name of the interface holding this address, or None."""
    for name, ip in interfaces().items():
        if ip == addr:
            return name
    return None


def describe() -> str:
    """'eth0 10.0.0.5, ib0 10.1.0.5' (loopback left out): what --ip can name on this host."""
    items = [f"{name} {ip}" for name, ip in interfaces().items() if not ip.startswith("127.")]
    return ", ".join(items) or "no interface but loopback"


def is_local(addr: str) -> bool:
    return addr in interfaces().values()


def connect_error(host: str, port: int, timeout: float) -> str:
    """'' when a TCP connection to host:port opens within timeout; otherwise why not, in words."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return ""
    except TimeoutError:
        return f"no answer within {timeout:.0f} s"
    except OSError as exc:
        if exc.errno is not None and exc.errno in errno.errorcode:
            return f"{exc.strerror or errno.errorcode[exc.errno]}"
        return str(exc)


def likely_fix(
    reason: str,
    unreachable: str = "the address is on a network this node has no route to (wrong interface)",
    refused: str = "nothing listens there from this node's side (wrong address, or a loopback address)",
    other: str = "a firewall drops the traffic, or the address is on the wrong interface",
) -> str:
    """What a connection failure most likely means, in one clause (the clauses: an engine's, by default)."""
    text = reason.lower()
    if "unreachable" in text or "no route" in text:
        return unreachable
    if "refused" in text:
        return refused
    return other
