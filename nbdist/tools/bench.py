"""nbdist.tools.bench: the all_reduce bandwidth sweep and the scaling report, measured on the cluster.

algbw = bytes / time; busbw = algbw x 2(n-1)/n, the traffic a ring all-reduce puts on each
link, comparable across world sizes (the convention of NCCL's tests). The memcpy bandwidth
measured in the same run is the in-process ceiling to read them against. Scaling
efficiency = throughput on n ranks / (throughput on 1 rank x n), one small MLP (benchfns.train_throughput)
trained four ways: one rank alone, one process on every core (torch's threads, no ranks), n DDP ranks,
and n ranks without the all-reduce (DDP's no_sync: what sharing the machine costs by itself).
"""

from __future__ import annotations

from typing import Any

from ..cluster import Cluster, current
from . import benchfns

BOUND_S = 600.0  # the most one measurement may take on the ranks
DEFAULT_SIZES = [4 << 10 << (2 * i) for i in range(8)]  # 4 KiB, 16 KiB, ..., 64 MiB


def bench(cluster: Cluster | None = None, sizes: list[int] | None = None, scaling: bool = True) -> dict[str, Any]:
    cluster = cluster or current()
    sizes = sizes or DEFAULT_SIZES
    n = cluster.world_size
    engines, every = cluster.engines, list(range(n))
    assert engines is not None  # current() is a running cluster

    def on(ranks: list[int], fn: Any, **kwargs: Any) -> list[Any]:  # a measurement may take minutes, never forever
        return engines.call(ranks, fn, timeout=BOUND_S, **kwargs).ordered(f"%dist_bench ({fn.__name__})", ranks)

    sweeps = on(every, benchfns.allreduce_sweep, sizes=sizes)
    rows = []
    for i, size in enumerate(sizes):
        seconds = max(s[i]["seconds"] for s in sweeps)  # the slowest rank sets the pace
        algbw = size / seconds
        rows.append(
            {"bytes": size, "seconds": seconds, "algbw_GBps": algbw / 1e9, "busbw_GBps": algbw * 2 * (n - 1) / n / 1e9}
        )
    memcpy = min(on(every, benchfns.memcpy_bandwidth)) / 1e9
    report: dict[str, Any] = {"world_size": n, "backend": cluster.backend, "allreduce": rows, "memcpy_GBps": memcpy}
    if scaling:
        alone = on([0], benchfns.train_throughput, distributed=False)[0]
        alone_all_cores = on([0], benchfns.train_throughput, distributed=False, threads=_cores())[0]
        together = on(every, benchfns.train_throughput, distributed=True)
        apart = on(every, benchfns.train_throughput, distributed=True, comm=False)
        total = sum(t["samples_per_s"] for t in together)
        report["scaling"] = {
            "one_rank_samples_per_s": alone["samples_per_s"],
            "one_process_all_cores_samples_per_s": alone_all_cores["samples_per_s"],
            "cores": _cores(),
            "n_ranks_samples_per_s": total,
            "n_ranks_no_comm_samples_per_s": sum(t["samples_per_s"] for t in apart),
            "efficiency": total / (alone["samples_per_s"] * n),
        }
    return report


def figure(report: dict[str, Any]) -> Any:
    """Bandwidth against message size, with the memcpy ceiling."""
    import plotly.graph_objects as go

    rows = report["allreduce"]
    xs = [r["bytes"] for r in rows]
    fig = go.Figure()
    if report["world_size"] == 2:  # 2(n-1)/n = 1: busbw is algbw, and a second line would hide under the first
        fig.add_scatter(x=xs, y=[r["algbw_GBps"] for r in rows], name="all_reduce (busbw = algbw at 2 ranks)",
                        mode="lines+markers")
    else:
        fig.add_scatter(x=xs, y=[r["busbw_GBps"] for r in rows], name="all_reduce busbw", mode="lines+markers")
        fig.add_scatter(x=xs, y=[r["algbw_GBps"] for r in rows], name="all_reduce algbw", mode="lines+markers")
    fig.add_scatter(
        x=[xs[0], xs[-1]], y=[report["memcpy_GBps"]] * 2, name="memcpy (same run)", mode="lines", line={"dash": "dot"}
    )
    fig.update_layout(
        title=f"all_reduce over {report['backend']}, {report['world_size']} ranks",
        # one label per size swept (4 KiB, 16 KiB, ...), not plotly's crowded 2 and 5 between the decades
        xaxis={"type": "log", "title": "message size", "tickvals": xs, "ticktext": [_size(x) for x in xs]},
        yaxis={"type": "log", "title": "GB/s"},
        height=360,
    )
    return fig


def _size(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


def _cores() -> int:
    import os

    return os.cpu_count() or 1
