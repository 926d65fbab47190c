"""A cell sent as one request a node and answered by one reply a node (a tree), modelled on stub ranks, against
nbdist's cell (a request and a reply a rank) and ipyparallel's ``DirectView.execute``, alternated on the same engines.

Issue 52 asks for a cell at 1,024 ranks in 100 ms with its output folded. What is left of nbdist's cell at that size
is a request and a reply for every rank through the notebook (and the controller): docs/scaling.md, sessions 45-46.
This measures what the design that removes them would cost before it is built: on each node the lowest rank is its
leader; the notebook sends the cell to the leaders alone (one ipyparallel ``apply`` each); a leader hands it to the
other ranks of its node over a socket of the node's own (ZeroMQ, ``ipc://`` in a private folder), runs it itself, takes
their replies, folds its node's output (alike text: one entry with its ranks), and answers once; the notebook folds the
nodes' answers the same way. The other ranks run the cell on their kernel's own loop (a ``ZMQStream`` on the main
thread's IOLoop, where ipykernel runs a cell), with IPython's ``run_cell`` and their stdout taken while it runs.

Not measured here, and needed before this is nbdist's path: a rank's death, an interrupt, a breakpoint, a display or a
widget's messages from a rank that is not a leader, output as it comes (a rank's text reaches the notebook only with
its node's answer here), a leader's death. All ranks are on this host, so a "node" is a group of ``--per-node`` ranks;
with ``--per-node 2`` at 256 ranks the notebook hears 128 nodes, as it would from 1,024 ranks in nodes of 8.

Measured a cell (medians): the notebook's CPU (its process, every thread), the controller's (/proc, 10 ms ticks: a
mean), the wall, and the leaders' own CPU (their thread, from sending the cell to folding the answer). Each cell's
folded text is checked against nbdist's: the same line, tagged with every rank.

    python benchmarks/node_tree.py [--ranks 64,256] [--per-node 8,2] [--reps 15]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

from _common import save
from ipyparallel import interactive
from many_ranks import controller_of
from stub_ranks import LEAN, PRINT, TRIVIAL, StubLauncher, nbdist_cell

from nbdist.config import StartConfig
from nbdist.doctor import ranks_text
from nbdist.world.engineset import EngineSet

# Run on every engine once: what a rank of a tree needs (its node's socket; a leader's list of the others).
NODE = '''
import contextlib as _cl, io as _io, json as _json, zmq as _zmq
from zmq.eventloop.zmqstream import ZMQStream as _Stream
_trees = globals().setdefault("_trees", {})

def _tree_run(code):
    """The cell on this rank: its error (None when it ran) and what it printed."""
    out = _io.StringIO()
    with _cl.redirect_stdout(out):
        got = get_ipython().run_cell(code, store_history=False)
    failed = got.error_in_exec or got.error_before_exec
    return (None if failed is None else repr(failed)), out.getvalue()

def _tree_join(size, rank, leader, path):
    """This rank in the tree of nodes of ``size``: a leader binds its node's socket, the others connect to it and
    run what comes on their kernel's loop, answering with their rank, error and output."""
    ctx = _zmq.Context.instance()
    if rank == leader:
        sock = ctx.socket(_zmq.ROUTER)
        sock.bind(path)
        _trees[size] = {"sock": sock, "others": [], "rank": rank}
        return
    sock = ctx.socket(_zmq.DEALER)
    sock.setsockopt(_zmq.IDENTITY, str(rank).encode())
    sock.connect(path)
    def on_cell(frames, sock=sock, rank=rank):
        err, out = _tree_run(frames[-1].decode())
        sock.send(_json.dumps([rank, err, out]).encode())
    stream = _Stream(sock)
    stream.on_recv(on_cell)
    _trees[size] = {"sock": sock, "stream": stream}
    sock.send(b"here")

def _tree_ready(size, others):
    """A leader: wait until every other rank of its node has connected (a ROUTER drops what it sends to a peer
    not yet there)."""
    tree, poller = _trees[size], _zmq.Poller()
    poller.register(tree["sock"], _zmq.POLLIN)
    while len(tree["others"]) < others:
        if not poller.poll(60_000):
            raise TimeoutError(f"{len(tree['others'])} of {others} ranks of this node connected")
        ident, _ = tree["sock"].recv_multipart()
        tree["others"].append(ident)
'''


@interactive
def tree_cell(size: int, code: str) -> dict[str, Any]:
    """A leader's part of a cell: hand it to its node, run it, fold the node's output, answer once."""
    import json
    import time

    import zmq

    tic = time.thread_time()
    tree = _trees[size]  # noqa: F821  # the engine's namespace (NODE)
    sock = tree["sock"]
    body = code.encode()
    for ident in tree["others"]:
        sock.send_multipart([ident, body])
    err, out = _tree_run(code)  # noqa: F821
    answers = [(tree["rank"], err, out)]
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while len(answers) < 1 + len(tree["others"]):
        if not poller.poll(60_000):
            raise TimeoutError(f"{len(answers)} of {1 + len(tree['others'])} ranks of this node answered")
        _, reply = sock.recv_multipart()
        answers.append(tuple(json.loads(reply)))
    folded: dict[str, list[int]] = {}
    errors: dict[str, list[int]] = {}
    for r, e, o in answers:
        folded.setdefault(o, []).append(r)
        if e is not None:
            errors.setdefault(e, []).append(r)
    return {"out": folded, "errors": errors, "cpu_s": time.thread_time() - tic}


class Tree:
    """The engines grouped into nodes of ``size`` ranks, each node's lowest rank its leader."""

    def __init__(self, engines: EngineSet, size: int, folder: str) -> None:
        ranks = sorted(r.rank for r in engines.ranks)
        self.size, self.ranks = size, ranks
        self.leaders = ranks[::size]
        joins = []
        for i, rank in enumerate(ranks):
            leader = ranks[i - i % size]
            path = f"ipc://{folder}/tree{size}-node{leader}"
            joins.append(engines.view([rank]).execute(f"_tree_join({size}, {rank}, {leader}, {path!r})", block=False))
        for ar in joins:
            ar.get()
        for i, leader in enumerate(self.leaders):
            others = len(ranks[i * size : (i + 1) * size]) - 1
            engines.view([leader]).execute(f"_tree_ready({size}, {others})", block=True)
        self.view = engines.view(self.leaders)
        self.leader_cpu: list[float] = []

    def cell(self, code: str) -> str:
        """The cell on every rank; the output folded: one line for the ranks that printed it alike."""
        out: dict[str, list[int]] = {}
        errors: dict[str, list[int]] = {}
        for answer in self.view.apply_async(tree_cell, self.size, code).get():  # a request and a reply a leader
            self.leader_cpu.append(answer["cpu_s"])
            for text, ranks in answer["out"].items():
                out.setdefault(text, []).extend(ranks)
            for text, ranks in answer["errors"].items():
                errors.setdefault(text, []).extend(ranks)
        heard = sorted(r for ranks in out.values() for r in ranks)
        if heard != self.ranks or errors:
            raise RuntimeError(f"the tree heard ranks {ranks_text(heard)} of {ranks_text(self.ranks)}; errors {errors}")
        return "".join(
            f"[{ranks_text(ranks)}] {line}\n" for text, ranks in out.items() for line in text.splitlines() if text
        )


def one_size(n: int, sizes: list[int], reps: int, nbdist_node: int) -> dict[str, Any]:
    config = StartConfig.of(n=n, oversubscribe=True, pin=False, timeout=600)
    with tempfile.TemporaryDirectory(prefix="nbdist-tree-") as workdir:
        engines = EngineSet(config, StubLauncher(), workdir)
        try:
            engines.start()
            direct = engines.view([r.rank for r in engines.ranks])
            direct.execute(LEAN, block=True)
            direct.execute(NODE, block=True)
            trees = {size: Tree(engines, size, workdir) for size in sizes}
            kinds: dict[str, Any] = {
                "nbdist cell (a request a rank)": lambda code: nbdist_cell(engines, code),
                "DirectView.execute": lambda code: direct.execute(code, block=True),
                f"nbdist cell, tree of {nbdist_node} a node": lambda code: nbdist_cell(engines, code, tree=nbdist_node),
            }
            for size, tree in trees.items():
                kinds[f"tree, {size} ranks a node ({len(tree.leaders)} nodes)"] = tree.cell
            expected = nbdist_cell(engines, PRINT)
            for kind, run in kinds.items():
                run(TRIVIAL)  # warm: the views' sockets, the first transcript
                if kind != "DirectView.execute":
                    folded = run(PRINT)
                    assert folded.strip() == expected.strip(), f"{kind} folded {folded!r}, nbdist's cell {expected!r}"
            for tree in trees.values():
                tree.leader_cpu.clear()
            controller = controller_of(engines)
            rows: dict[str, Any] = {}
            for code_name, code in (("trivial", TRIVIAL), ("print on every rank", PRINT)):
                got: dict[str, dict[str, list[float]]] = {k: {"wall": [], "cpu": [], "ctl": []} for k in kinds}
                for _ in range(reps):
                    for kind, run in kinds.items():
                        mine, theirs = time.process_time(), sum(controller.cpu_times()[:2])
                        tic = time.perf_counter()
                        run(code)
                        got[kind]["wall"].append(time.perf_counter() - tic)
                        got[kind]["cpu"].append(time.process_time() - mine)
                        got[kind]["ctl"].append(sum(controller.cpu_times()[:2]) - theirs)
                rows[code_name] = {
                    kind: {
                        "notebook_cpu_ms": statistics.median(g["cpu"]) * 1e3,
                        "controller_cpu_ms": statistics.fmean(g["ctl"]) * 1e3,
                        "wall_ms": statistics.median(g["wall"]) * 1e3,
                    }
                    for kind, g in got.items()
                }
            rows["leader_cpu_ms"] = {
                size: statistics.median(tree.leader_cpu) * 1e3 for size, tree in trees.items() if tree.leader_cpu
            }
            rows["folded"] = expected.strip()
        finally:
            engines.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", default="64,256")
    parser.add_argument("--per-node", default="8,2")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--nbdist-node", type=int, default=8, help="ranks a node in nbdist's own tree (TREE_FROM)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.per_node.split(",")]
    out: dict[str, Any] = {}
    for n in map(int, args.ranks.split(",")):
        out[str(n)] = rows = one_size(n, sizes, args.reps, args.nbdist_node)
        for code_name in ("trivial", "print on every rank"):
            for kind, m in rows[code_name].items():
                print(
                    f"{n:>4} stub ranks, {code_name:19}, {kind:38} notebook CPU {m['notebook_cpu_ms']:6.1f} ms  "
                    f"controller CPU {m['controller_cpu_ms']:5.1f} ms  wall {m['wall_ms']:7.1f} ms",
                    flush=True,
                )
        print(f"{n:>4} stub ranks: a leader's CPU a cell (median), by ranks a node: {rows['leader_cpu_ms']}")
        print(f"{n:>4} stub ranks: folded as {rows['folded']!r}", flush=True)
    save("node_tree", {"reps": args.reps, "per_node": sizes, "nbdist_node": args.nbdist_node, "sizes": out})


if __name__ == "__main__":
    main()
