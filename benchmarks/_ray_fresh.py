"""Raw Ray's start of a world, as a Ray user writes it (``ray.init``, a placement group, one actor per rank,
``init_process_group`` with rank 0's address and the interface set by hand, one all_reduce), and a first start from a
fresh Python, as from a fresh notebook kernel: nbdist's ``--launcher ray`` against raw Ray, each in a process of its own
that imports what it needs inside the time (raw Ray: ``import ray``; nbdist: ``import nbdist``, which imports
ipyparallel and starts a driver that imports Ray). benchmarks/multinode.py's other Ray rows time both in its own
process, where Ray is imported already: there raw Ray's ``import ray`` is outside the time and nbdist's (in its
driver, a process of its own) inside it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time


class RawRank:
    """Raw Ray: one rank of a world a Ray user builds by hand."""

    def where(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def join(self, master: str, port: int, rank: int, world: int) -> float:
        import os

        import torch
        import torch.distributed as dist

        os.environ["GLOO_SOCKET_IFNAME"] = "eth0"  # the node's hostname does not resolve to its address
        dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=world)
        x = torch.ones(1)
        dist.all_reduce(x)
        dist.destroy_process_group()
        return x.item()


def raw_start(address: str, n: int, port: int) -> tuple[float, float]:
    """Raw Ray's world of ``n`` ranks on the two test nodes: (the wall clock before ``ray.init``, once a collective ran
    on every rank)."""
    import ray
    import ray.cloudpickle
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the nodes do not have benchmarks/ to import
    tic = time.time()
    for attempt in range(5):  # Ray Client's server may still be ending the last session
        try:
            ray.init(address, log_to_driver=False)
            break
        except ConnectionError:
            time.sleep(1 + attempt)
    try:
        group = placement_group([{"CPU": 1}] * n, strategy="PACK")
        ray.get(group.ready(), timeout=120)
        rank_cls = ray.remote(num_cpus=1)(RawRank)
        ranks = [
            rank_cls.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i)
            ).remote()
            for i in range(n)
        ]
        master = ray.get(ranks[0].where.remote())
        sums = ray.get([r.join.remote(master, port, i, n) for i, r in enumerate(ranks)], timeout=120)
        assert sums == [float(n)] * n, sums
        done = time.time()
        nodes = set(ray.get([r.where.remote() for r in ranks]))
        assert len(nodes) == 2, nodes
        return tic, done
    finally:
        ray.shutdown()


# Each child prints ``DONE <time.time()>`` once a collective ran on every rank, before it stops its world.
RAW = """
import sys
sys.path.insert(0, sys.argv[4])
from _ray_fresh import raw_start
print("DONE", raw_start(sys.argv[1], int(sys.argv[3]), int(sys.argv[2]))[1], flush=True)
"""

NBDIST = """
import sys, time
import nbdist

address, n = sys.argv[1], int(sys.argv[3])
cluster = nbdist.start(n=n, launcher="ray", address=address, timeout=120, progress=lambda line: None)
try:
    cluster.run("x = torch.ones(1); dist.all_reduce(x)", quiet=True).raise_for_error()
    print("DONE", time.time(), flush=True)
    assert len({r.host for r in cluster.ranks}) == 2, [r.host for r in cluster.ranks]
finally:
    cluster.stop()
"""


def fresh_once(which: str, address: str, port: int, n: int = 4) -> float:
    """Seconds from spawning a fresh Python that starts a world of ``n`` ranks (``which``: 'raw' or 'nbdist') to the
    collective having run on every rank."""
    code = RAW if which == "raw" else NBDIST
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    here = os.path.dirname(os.path.abspath(__file__))
    tic = time.time()
    done = subprocess.run(
        [sys.executable, "-c", code, address, str(port), str(n), here],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=os.path.expanduser("~"),  # nbdist is imported as installed, not from this checkout's working directory
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("DONE ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{which} first start failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return float(lines[0].split()[1]) - tic
