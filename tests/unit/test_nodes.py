"""How a world's ranks are grouped into nodes for a cell sent through their leaders (world/nodes.py): each host's ranks
in rank order, NODE_SIZE at most a node, the leader first; indices are the ranks' places in the cell's own list."""

from __future__ import annotations

from types import SimpleNamespace

from nbdist.world import nodes


def world(hosts: list[str]) -> SimpleNamespace:
    """What nodes_of reads of an EngineSet: each rank's host, by rank."""
    return SimpleNamespace(ranks=[SimpleNamespace(rank=r, host=h) for r, h in enumerate(hosts)])


def test_each_hosts_ranks_are_nodes_of_at_most_the_size_asked_led_by_their_lowest_rank():
    engines = world(["a", "b", "a", "b", "a", "a", "b"])
    got = nodes.nodes_of(engines, list(range(7)), size=3)
    assert got == [[(0, 0), (2, 2), (4, 4)], [(5, 5)], [(1, 1), (3, 3), (6, 6)]]


def test_indices_are_places_in_the_cells_own_list_of_ranks_and_each_node_is_in_rank_order():
    engines = world(["a"] * 4)
    assert nodes.nodes_of(engines, [3, 1, 0, 2], size=2) == [[(2, 0), (1, 1)], [(3, 2), (0, 3)]]


def test_the_default_size_is_node_size(monkeypatch):
    monkeypatch.setattr(nodes, "NODE_SIZE", 2)
    assert [len(n) for n in nodes.nodes_of(world(["a"] * 5), list(range(5)))] == [2, 2, 1]
    monkeypatch.setattr(nodes, "NODE_SIZE", 8)
    assert [len(n) for n in nodes.nodes_of(world(["a"] * 5), list(range(5)))] == [5]


def test_a_folder_too_long_for_a_unix_sockets_name_is_not_used():
    assert nodes.usable(SimpleNamespace(workdir="/tmp/nbdist-abc"))
    assert not nodes.usable(SimpleNamespace(workdir="/tmp/" + "x" * 100))
