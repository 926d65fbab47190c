"""A rank's TCP connections, by file descriptor: those a process group made (``added``), which the watcher shuts to
release a rank blocked on them (``shut``, ``group.abort_world``). Read from the process's own file descriptors."""

from __future__ import annotations

import os
import socket

from .state import STATE

Ends = tuple[tuple[str, int], tuple[str, int]]  # a TCP connection's local and remote (address, port)


def tcp_connections() -> dict[int, Ends]:
    """This process's connected TCP sockets: file descriptor -> its two ends, asked of each socket among its own file
    descriptors. (psutil reads the host's whole table, /proc/net/tcp, to find a process's own: 74 ms against 3 ms
    for a rank's 130 sockets among 4,000 on the host, and at 64 ranks every rank reads it at once, three times in a
    recovery.)"""
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:  # no /proc (not Linux)
        return _from_psutil()
    found = {}
    for fd in fds:
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
        except OSError:  # closed since
            continue
        ends = ends_of(fd)
        if ends is not None:
            found[fd] = ends
    return found


def ends_of(fd: int) -> Ends | None:
    """The two ends of the connected TCP socket ``fd``; None when ``fd`` is no such socket (closed, another kind)."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        return _ends(sock)
    finally:
        sock.detach()  # the fd stays open: it is the group's


def shut(fd: int, ends: Ends) -> bool:
    """Shut both ways the TCP connection ``fd`` if it still has these ends (else the number was closed and given to
    another socket since: not the group's any more); whether it was shut."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return False
    try:
        if _ends(sock) != ends:
            return False
        sock.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        sock.detach()


def _ends(sock: socket.socket) -> Ends | None:
    if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    try:
        return tuple(sock.getsockname()[:2]), tuple(sock.getpeername()[:2])  # type: ignore[return-value]
    except OSError:  # not connected
        return None


def _from_psutil() -> dict[int, Ends]:
    import psutil

    return {
        c.fd: (tuple(c.laddr), tuple(c.raddr))  # type: ignore[misc]
        for c in psutil.Process().net_connections("tcp")
        if c.status == psutil.CONN_ESTABLISHED and c.fd >= 0 and c.raddr
    }


def added(before: dict[int, Ends], after: dict[int, Ends]) -> dict[int, Ends]:
    """The connections a process group made: new since ``before``, and not to a peer this process was connected to
    already. The engine's own sockets (ipyparallel's, through zmq's I/O thread) can connect again at any moment, to
    the controller's ports they had before; one that did so while a group formed is not the group's, and shutting
    it would lose the rank's reply to the cell (it happened: 'its cell over, no reply sent'). On the rank that serves
    the rendezvous store, the ranks' connections to it come while the group forms; they are the store's, which
    outlives the group (group.join_world), and shutting them would break every rank's next forming."""
    known = {ends[1] for ends in before.values()}
    served = STATE.store_at[1] if STATE.store_at is not None and STATE.store_at[2] else None
    return {
        fd: ends
        for fd, ends in after.items()
        # new: a number an earlier socket had (closed while the group formed) counts by its ends
        if before.get(fd) != ends and ends[1] not in known and ends[0][1] != served  # nor the store's: outlives it
    }
