"""What reading a reply's timestamps costs the notebook and the controller, with ipyparallel's parser (dateutil's
general ``parse``; the hub reads a request's and a reply's header with jupyter_client's ``isoparse``) and with
nbdist's (``compat.fast_iso_dates``: ``datetime.fromisoformat``, the same instant).

1. Each parser on a timestamp as jupyter_client writes it (medians of 5 runs of 2,000).
2. A live world per size: nbdist's trivial cell, rounds alternated between the client's parser as ipyparallel ships
   it and nbdist's (the controller, a process of its own, runs nbdist's in both), timed as benchmarks/many_ranks.py
   times a cell; the notebook's CPU is where the difference shows.
3. Per cell at 1,024 ranks, from (1): one reply a rank, read once by the client and once by the hub, which also
   reads the request's and the reply's header.

    python benchmarks/reply_dates.py [--ranks 16,64] [--rounds 6] [--reps 11]
"""

from __future__ import annotations

import os
import statistics
import timeit
from datetime import datetime, timezone

os.environ.setdefault("OMP_NUM_THREADS", "1")

from _common import medians, save, sizes_parser  # noqa: E402
from ipyparallel import util  # noqa: E402
from ipyparallel.client import asyncresult  # noqa: E402
from ipyparallel.controller import hub  # noqa: E402
from jupyter_client.jsonutil import json_default  # noqa: E402
from many_ranks import cells_alternated, world  # noqa: E402

from nbdist import compat  # noqa: E402

# ipyparallel's own parsers (private: what compat.fast_iso_dates replaces), taken before any world patches them
THEIRS, THEIRS_HUB = util._parse_date, hub.parse_date  # noqa: SLF001
compat.fast_iso_dates()
OURS = util._parse_date  # noqa: SLF001


def parse_costs() -> dict[str, float]:
    """Microseconds a timestamp, each parser."""
    stamp = json_default(datetime.now(timezone.utc))
    assert THEIRS(stamp) == OURS(stamp) == THEIRS_HUB(stamp)

    def us(fn) -> float:
        return statistics.median(timeit.repeat(lambda: fn(stamp), number=2000, repeat=5)) / 2000 * 1e6

    return {"ipyparallel_us": us(THEIRS), "jupyter_client_isoparse_us": us(THEIRS_HUB), "nbdist_us": us(OURS)}


def client_parser(fn) -> None:
    util._parse_date = asyncresult._parse_date = fn  # noqa: SLF001


def one_size(n: int, rounds: int, reps: int) -> dict[str, dict[str, float]]:
    ways = {"nbdist's (as shipped)": lambda: client_parser(OURS), "ipyparallel's parser": lambda: client_parser(THEIRS)}
    with world(n) as cluster:
        return medians(cells_alternated(cluster, ways, rounds, reps))


def main() -> None:
    parser = sizes_parser("16,64", rounds=6)
    args = parser.parse_args()
    costs = parse_costs()
    print(
        f"a timestamp: ipyparallel's parser {costs['ipyparallel_us']:.1f} us, jupyter_client's isoparse "
        f"{costs['jupyter_client_isoparse_us']:.1f} us, nbdist's {costs['nbdist_us']:.2f} us",
        flush=True,
    )
    per_rank_theirs = 2 * costs["ipyparallel_us"] + 2 * costs["jupyter_client_isoparse_us"]  # client + hub
    per_rank_ours = 4 * costs["nbdist_us"]
    model = {
        "client_ms_1024": 1024 * costs["ipyparallel_us"] / 1e3,
        "hub_ms_1024": 1024 * (costs["ipyparallel_us"] + 2 * costs["jupyter_client_isoparse_us"]) / 1e3,
        "nbdist_both_ms_1024": 1024 * per_rank_ours / 1e3,
    }
    print(
        f"per cell at 1,024 ranks: ipyparallel's parsers {1024 * per_rank_theirs / 1e3:.0f} ms of CPU (client "
        f"{model['client_ms_1024']:.0f}, hub {model['hub_ms_1024']:.0f}), nbdist's {model['nbdist_both_ms_1024']:.1f} ms",
        flush=True,
    )
    result: dict[str, object] = {"parse_us": costs, "model_1024": model}
    for n in [int(x) for x in args.ranks.split(",") if x]:
        result[str(n)] = rows = one_size(n, args.rounds, args.reps)
        for way, m in rows.items():
            print(
                f"{n:3} ranks, client with {way:22} nbdist cell {m['nbdist_cell_ms']:7.2f} ms  view.execute "
                f"{m['view_execute_ms']:7.2f} ms  ratio {m['ratio']:.3f}  notebook CPU {m['notebook_cpu_ms']:.2f} ms "
                f"(view.execute {m['notebook_cpu_view_execute_ms']:.2f} ms)",
                flush=True,
            )
    save("reply_dates", result)


if __name__ == "__main__":
    main()
