"""The TCP connections a rank finds among its own file descriptors (engine/connections.py): what the watcher shuts to
release a rank from a blocked collective, so they must be exactly the process's connected TCP sockets. psutil's
reading of the host's table is the reference."""

from __future__ import annotations

import socket

import psutil
import pytest

from nbdist.engine import connections


def _psutil() -> dict:
    return {
        c.fd: (tuple(c.laddr), tuple(c.raddr))
        for c in psutil.Process().net_connections("tcp")
        if c.status == psutil.CONN_ESTABLISHED and c.fd >= 0 and c.raddr
    }


@pytest.fixture
def sockets():
    made: list[socket.socket] = []
    yield made
    for s in made:
        s.close()


def _pairs(family: int, host: str, n: int, made: list[socket.socket]) -> None:
    server = socket.socket(family, socket.SOCK_STREAM)
    server.bind((host, 0))
    server.listen(n)
    made.append(server)  # listening: no peer, not a connection
    for _ in range(n):
        client = socket.create_connection(server.getsockname()[:2])
        accepted, _ = server.accept()
        made += [client, accepted]


def test_the_connections_are_those_psutil_finds_in_the_hosts_table(sockets):
    _pairs(socket.AF_INET, "127.0.0.1", 5, sockets)
    if socket.has_ipv6:
        try:
            _pairs(socket.AF_INET6, "::1", 2, sockets)
        except OSError:  # no IPv6 loopback here
            pass
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.connect(("127.0.0.1", 9))  # connected, but not TCP
    unconnected = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sockets += [udp, unconnected]
    found = connections.tcp_connections()
    assert found == _psutil()
    assert {s.fileno() for s in sockets[1:11]} <= set(found)  # the ten IPv4 ends
    for other in (sockets[0], udp, unconnected):
        assert other.fileno() not in found and connections.ends_of(other.fileno()) is None


def test_a_closed_descriptor_has_no_ends_and_stays_closed(sockets):
    _pairs(socket.AF_INET, "127.0.0.1", 1, sockets)
    client = sockets[1]
    fd, ends = client.fileno(), connections.tcp_connections()[client.fileno()]
    assert connections.ends_of(fd) == ends == (client.getsockname(), client.getpeername())
    client.close()
    assert connections.ends_of(fd) is None


def _listener(made: list[socket.socket]) -> socket.socket:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    made.append(server)
    return server


def test_a_group_connection_on_a_file_number_an_earlier_socket_had_is_the_groups(sockets):
    """A socket that closes while a group forms (zmq reconnecting, a store client) frees its number, and the group's
    next connection takes it: still the group's, so the watcher shuts it (before: left out, as if the earlier
    socket were still there, and a rank released in a collective on it waited until the group's timeout)."""
    first, second = _listener(sockets), _listener(sockets)
    early = socket.create_connection(first.getsockname())
    sockets.append(first.accept()[0])
    before = connections.tcp_connections()
    number = early.fileno()
    early.close()
    late = socket.create_connection(second.getsockname())  # the lowest free number: the one just freed
    sockets.extend([late, second.accept()[0]])
    assert late.fileno() == number  # what the test is about; the kernel gives the lowest free number
    new = connections.added(before, connections.tcp_connections())
    assert new.get(number) == (late.getsockname(), late.getpeername()), new
