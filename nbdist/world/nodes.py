"""A cell sent through the nodes' leaders: one request from the notebook a node, not a rank (engine/nodetree.py is the
ranks' side; compat.execute_heard_tree sends it).

A node is a host's ranks, ``NODE_SIZE`` at most (a host with more is several nodes); its leader is its lowest rank.
The tree is joined the first time a cell goes through it, and again once a rank of the world is another engine (a
restart, a grown world). What each rank prints, displays or raises is still its own, heard as any cell's.
"""

from __future__ import annotations

import secrets
import weakref
from typing import Any

from ..engine import nodetree
from ..errors import ClusterError
from .engineset import EngineSet

NODE_SIZE = 8  # ranks a node at most
JOIN_S = 30.0  # a join's answers are waited for this long at most
_MAX_PATH = 90  # a socket's path in a folder longer than this would pass the 107 bytes a Unix socket's name may have

Nodes = list[list[tuple[int, int]]]  # each node's (index in the cell's ranks, rank), its leader first

_JOINED: weakref.WeakKeyDictionary[EngineSet, tuple[tuple[int, ...], Nodes]] = weakref.WeakKeyDictionary()


def nodes_of(engines: EngineSet, ranks: list[int], size: int | None = None) -> Nodes:
    """The cell's ranks as nodes: each host's in rank order, ``size`` (``NODE_SIZE``) at most a node."""
    size = size or NODE_SIZE
    by_host: dict[str, list[tuple[int, int]]] = {}
    for k, rank in sorted(enumerate(ranks), key=lambda placed: placed[1]):
        by_host.setdefault(engines.ranks[rank].host, []).append((k, rank))
    return [node[i : i + size] for node in by_host.values() for i in range(0, len(node), size)]


def usable(engines: EngineSet) -> bool:
    """Whether the world's folder can hold its nodes' sockets (a Unix socket's name is 107 bytes at most)."""
    return len(engines.workdir) <= _MAX_PATH


def joined(engines: EngineSet, ranks: list[int]) -> Nodes:
    """The nodes of these ranks, their tree joined on their engines now if it was not (or a rank is another engine
    since). ClusterError, naming the ranks, when a rank did not join or did not reach its leader (the next cell tries
    again)."""
    key = (*engines.engine_ids(ranks), NODE_SIZE)
    known = _JOINED.get(engines)
    if known is not None and known[0] == key:
        return known[1]
    _JOINED.pop(engines, None)
    nodes = nodes_of(engines, ranks)
    tag = secrets.token_hex(3)
    calls: dict[int, Any] = {}
    for node in nodes:
        leader = node[0][1]
        others = [rank for _, rank in node[1:]]
        for _, rank in node:
            calls[rank] = (
                nodetree.join,
                (engines.workdir, leader, rank, others if rank == leader else [], tag, engines.ranks[leader].pid),
                {},
            )
    engines.call_each(calls, timeout=JOIN_S).ordered("joining the node tree", ranks)
    leaders = [node[0][1] for node in nodes]
    missing = engines.call(leaders, nodetree.wait_for, JOIN_S / 2, timeout=JOIN_S).ordered("the node tree", leaders)
    unheard = sorted(rank for late in missing for rank in late)
    if unheard:
        raise ClusterError(
            f"rank(s) {', '.join(map(str, unheard))} did not reach their node's leader within {JOIN_S / 2:.0f} s"
        )
    _JOINED[engines] = (key, nodes)
    return nodes
