"""``nbdist.log(step=..., **metrics)`` on a rank: buffered, cheap, thread-safe.

Rows are buffered and sent to the notebook at most every FLUSH_S seconds, in one
ipyparallel ``data_message`` (the engine's datapub, over IOPub) tagged with the
running cell, and once more when the cell ends; the last row of each batch carries the
rank's resident memory (``memory/rss_MiB``). A call costs a dict, a lock and a
clock read; sending happens on the main thread, between training steps, never inside
a collective. Outside an engine the rows stay in ``local_rows()`` (the last 100,000).

Bad input costs one line on the rank's stderr, once per cell, and loses nothing else: a value that is not a
number is left out of the row; a metric name beyond the first MAX_NAMES of the rank is left out (a name made
per step would otherwise grow every store that keeps a series per name); a step smaller than the last is kept,
and said (the dashboard's x axis is the step).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .. import wire
from . import gpu

FLUSH_S = 0.4  # at most 2.5 batches a second: each costs the rank a message and the kernel its handling
# At most this many rows a batch: a loop that logs faster (a tight loop logs 50,000 steps a second) sends its
# last BATCH_EXACT rows as they are and every k-th of the rest, so a rank never sends the kernel more rows than it
# handles as they come (8 ranks at full speed outran it, and the rows waiting held a gigabyte for a while,
# which the kernel's allocator then kept). The dashboard, the transcript and the result thin long runs anyway.
BATCH_ROWS = 1_200
BATCH_EXACT = 1_000
KEY = wire.METRICS
_LOCK = threading.Lock()
_BUFFER: list[dict[str, Any]] = []
_LOCAL: list[dict[str, Any]] = []
MAX_NAMES = 256  # metric names a rank logs, in all: the dashboard draws a fixed set


@dataclass(slots=True)
class _Sending:
    last: float = 0.0  # when rows were last flushed (time.monotonic())
    seq: int = 0  # rows published so far: each publication's key
    names: set[str] = field(default_factory=set)  # the metric names logged (at most MAX_NAMES)
    step: float | None = None  # the last step logged in this cell
    told: set[str] = field(default_factory=set)  # what this cell was told about its input (once each)


STATE = _Sending()


def _say_once(what: str, text: str) -> None:
    if what not in STATE.told:
        STATE.told.add(what)
        print(text, file=sys.stderr, flush=True)


def log(step: int | None = None, **metrics: Any) -> None:
    """Record metrics for this rank (numbers: loss=0.3, lr=1e-3, ...). On a rank that uses a GPU
    the row also gets ``memory/gpu_MiB``: what its tensors hold on the GPU now (the dashboard's panel)."""
    row = _stamped(step)
    if step is not None:
        try:
            at = float(step)
        except (TypeError, ValueError):
            _say_once("step type", f"nbdist.log: step={step!r} is not a number; the row is kept without its step.")
            row["step"] = None
        else:
            if STATE.step is not None and at < STATE.step:
                _say_once(
                    "step",
                    f"nbdist.log: step {step} comes after step {STATE.step:g} on this rank; kept, but the dashboard's "
                    "x axis is the step, so its lines run back. Log a step that keeps counting "
                    "(epoch * steps_per_epoch + i).",
                )
            STATE.step = at
    for key, value in metrics.items():
        if key not in STATE.names:
            if len(STATE.names) >= MAX_NAMES:
                _say_once(
                    "names",
                    f"nbdist.log: {key!r} would be this rank's metric name {MAX_NAMES + 1}; it and later new names "
                    "are left out. Log a fixed set of names (loss=..., not loss_{step}=...).",
                )
                continue
            STATE.names.add(key)
        try:
            row[key] = float(value)
        except (TypeError, ValueError):
            _say_once(
                f"value {key}",
                f"nbdist.log: {key}={value!r} is not a number; it is left out of the row (and later rows). Log "
                "numbers: use .item() on a tensor.",
            )
    _buffer(row)


def record(row: dict[str, float]) -> None:
    """A row nbdist's own step timer made (engine/why.py: numbers, under a fixed set of names, no step of its
    own): buffered as ``log`` buffers, without its checks (a few microseconds a step less)."""
    if not STATE.names.issuperset(row):
        STATE.names.update(row)
    stamped = _stamped(None)
    stamped.update(row)
    _buffer(stamped)


def _stamped(step: Any) -> dict[str, Any]:
    row: dict[str, Any] = {"t": time.time(), "step": step}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # never initialises CUDA itself
        row["memory/gpu_MiB"] = gpu.memory_mib()
    return row


def _buffer(row: dict[str, Any]) -> None:
    with _LOCK:
        _BUFFER.append(row)
    if threading.current_thread() is threading.main_thread() and time.monotonic() - STATE.last >= FLUSH_S:
        flush()


def cell_over() -> None:
    """The cell is over: what it logged since the last batch is sent; the next cell's input is checked afresh."""
    flush()
    STATE.step = None
    STATE.told.clear()


def flush() -> int:
    """Send what is buffered now (``thinned``); returns the number of rows logged since the last batch."""
    with _LOCK:
        rows = list(_BUFFER)
        _BUFFER.clear()
    STATE.last = time.monotonic()
    if not rows:
        return 0
    rows[-1].setdefault("memory/rss_MiB", rss_mib())  # once a batch: the memory panel needs no more
    rank = int(os.environ.get("RANK", "0"))
    STATE.seq += 1
    data_pub = _engine_data_pub()
    if data_pub is None:  # not inside an ipyparallel engine: keep them here
        _LOCAL.extend(rows)
        del _LOCAL[:-100_000]
    else:
        data_pub.publish_data({f"{KEY}{STATE.seq:09d}": {"rank": rank, "rows": thinned(rows)}})
    return len(rows)


def thinned(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A batch as it is sent: at most BATCH_ROWS rows, the last BATCH_EXACT as they are, every k-th of the rest
    (the first among them), the last row (with the memory) always."""
    if len(rows) <= BATCH_ROWS:
        return rows
    older = rows[:-BATCH_EXACT]
    stride = -(-len(older) // (BATCH_ROWS - BATCH_EXACT))
    return older[::stride] + rows[-BATCH_EXACT:]


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_mib() -> float:
    """This process's resident memory now (MiB): /proc on Linux, psutil elsewhere."""
    try:
        with open("/proc/self/statm", "rb") as fh:
            return int(fh.read().split()[1]) * _PAGE / 2**20
    except OSError:
        import psutil

        return float(psutil.Process().memory_info().rss / 2**20)


def publish(key: str, value: Any) -> None:
    """Send one value to the notebook beside the metrics (run.py reads it), when inside an engine."""
    data_pub = _engine_data_pub()
    if data_pub is not None:
        data_pub.publish_data({key: value})


def _engine_data_pub() -> Any:
    """The engine's datapub publisher, or None outside an ipyparallel engine.

    Looks at the running shell instead of calling ipyparallel's publish_data, which
    would create a kernel shell singleton in a plain Python or terminal IPython process."""
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover
        return None
    shell = get_ipython()
    kernel = getattr(shell, "kernel", None)
    if kernel is None or not type(kernel).__module__.startswith("ipyparallel"):
        return None
    return getattr(shell, "data_pub", None)


def local_rows() -> list[dict[str, Any]]:
    return list(_LOCAL)
