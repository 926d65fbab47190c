"""What the processes nbdist started listen on: every listening socket of a process tree, read
from ``/proc/PID/net`` (each process's own network namespace, so ranks on the Slurm nodes'
namespaces count; psutil reads the caller's) and matched to the process by socket inode."""

from __future__ import annotations

import ipaddress
import os
import socket
import struct

import psutil

LISTEN, UNCONNECTED = "0A", "07"  # TCP_LISTEN; UDP bound with no peer


def tree(*roots: int) -> set[int]:
    """These processes and every process below them."""
    found: set[int] = set()
    for pid in roots:
        try:
            found |= {pid, *(child.pid for child in psutil.Process(pid).children(recursive=True))}
        except psutil.NoSuchProcess:
            continue
    return found


def listening(pids: set[int]) -> list[tuple[str, int, int, str]]:
    """(address, port, pid, 'tcp'/'udp') of every TCP socket these processes listen on and every
    UDP socket they have bound."""
    out = set()
    for pid in pids:
        try:
            inodes = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        except OSError:  # gone, or not ours to read
            continue
        for kind, state in (("tcp", LISTEN), ("udp", UNCONNECTED)):
            for table in (kind, kind + "6"):
                for addr, port, inode in _table(f"/proc/{pid}/net/{table}", state):
                    if f"socket:[{inode}]" in inodes:
                        out.add((addr, port, pid, kind))
    return sorted(out)


def outside(sockets: list[tuple[str, int, int, str]], allowed: set[str]) -> list[str]:
    """The sockets on an address other than these, as 'ADDR:PORT (kind, pid PID)'."""
    return [f"{a}:{p} ({k}, pid {pid})" for a, p, pid, k in sockets if a not in allowed]


def _table(path: str, state: str) -> list[tuple[str, int, str]]:
    try:
        with open(path) as fh:
            rows = fh.read().splitlines()[1:]
    except OSError:
        return []
    found = []
    for row in rows:
        cols = row.split()
        if cols[3] != state:
            continue
        hexaddr, hexport = cols[1].split(":")
        raw = bytes.fromhex(hexaddr)
        if len(raw) == 4:
            addr = socket.inet_ntop(socket.AF_INET, raw[::-1])
        else:  # four little-endian 32-bit words
            addr = socket.inet_ntop(socket.AF_INET6, b"".join(struct.pack(">I", w) for w in struct.unpack("<4I", raw)))
        found.append((str(ipaddress.ip_address(addr)), int(hexport, 16), cols[9]))
    return found
