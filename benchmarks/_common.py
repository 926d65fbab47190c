"""Helpers shared by the benchmark scripts: timing stats, JSON results, an IPython shell."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

RESULTS = pathlib.Path(__file__).parent / "results"


def stats(samples: list[float]) -> dict[str, Any]:
    return {
        "median": statistics.median(samples),
        "min": min(samples),
        "max": max(samples),
        "n": len(samples),
        "samples": samples,
    }


def alternated(ways: list[str], rounds: int, measure: Callable[[str], dict[str, float]]) -> dict[str, list[dict[str, float]]]:
    """``measure(way)`` for every way, ``rounds`` times, the order reversed every other round (no way always first):
    each way's samples."""
    rows: dict[str, list[dict[str, float]]] = {way: [] for way in ways}
    for r in range(rounds):
        for way in ways if r % 2 == 0 else ways[::-1]:
            rows[way].append(measure(way))
    return rows


def sizes_parser(ranks: str, rounds: int, reps: int = 11) -> argparse.ArgumentParser:
    """The arguments of a benchmark that alternates ways on a world a size: ``--ranks`` (the sizes), ``--rounds``,
    ``--reps`` (cells a round)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", default=ranks)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--reps", type=int, default=reps)
    return parser


def medians(rows: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Each way's median of each figure over its samples."""
    return {way: {key: statistics.median(s[key] for s in samples) for key in samples[0]} for way, samples in rows.items()}


def machine() -> dict[str, Any]:
    import torch

    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def speed_probe(seconds: float = 1.0) -> float:
    """This machine's speed now: float32 matrix products (256 x 1024 by 1024 x 1024) a second on one thread, over
    ``seconds``. Taken between the parts of a benchmark, its spread says how far the machine's own speed moved over
    the run (on the 2-core machine, idle, it moved 0.62-1.0 over 15 s of such a loop): a timed difference smaller
    than that spread is not shown by one run."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.rand(256, 1024), torch.rand(1024, 1024)
        a @ b
        n, tic = 0, time.perf_counter()
        while time.perf_counter() - tic < seconds:
            a @ b
            n += 1
        return n / (time.perf_counter() - tic)
    finally:
        torch.set_num_threads(threads)


def save(name: str, data: dict[str, Any]) -> pathlib.Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    data = {"benchmark": name, "machine": machine(), **data}
    path.write_text(json.dumps(data, indent=2))
    print(f"saved {path}")
    return path


def shell() -> Any:
    from IPython.testing.globalipapp import start_ipython

    ip = start_ipython()
    ip.run_line_magic("load_ext", "nbdist")
    return ip


# The fault drills both benchmarks time (docs/faults.md, rows 2 and 3).
FAILURE_CELL = "%%distributed\nif dist.get_rank() == 1:\n    raise ValueError('x')\ndist.all_reduce(torch.ones(1))"
INTERRUPT_CELL = (
    "%%distributed\nif dist.get_rank() == 0:\n    dist.all_reduce(torch.ones(1))\nelse:\n    dist.barrier()"
)


def interrupted_cell(ip: Any, code: str, after: float = 0.5) -> float:
    """Run a cell and press Ctrl-C (SIGINT to this process) ``after`` seconds in; seconds
    from the signal until the cell returned."""
    import os
    import signal
    import threading

    signal.signal(signal.SIGINT, signal.default_int_handler)  # a background shell may have started us ignoring it
    threading.Timer(after, os.kill, (os.getpid(), signal.SIGINT)).start()
    tic = time.perf_counter()
    ip.run_cell(code, silent=True)
    return time.perf_counter() - tic - after


def run_cell(ip: Any, code: str) -> Any:
    result = ip.run_cell(code, silent=True)
    result.raise_error()
    return result.result
