"""Run code on ranks: streaming output tagged by rank, failures that fail, releases that release.

``execute`` sends the cell through ipyparallel (``DirectView.execute``, as ``%%px``
does) and then watches it from the calling thread:

* output is read from ipyparallel's per-engine metadata as it grows (the iopub
  callback only wakes us), so nothing is lost or printed twice;
* when a rank fails while others are still running, the others get ``grace``
  seconds to finish, then they are interrupted; an engine's watcher breaks its
  process group if it is stuck in a collective (see engine/runtime.py);
* Ctrl-C and ``timeout`` do the same for every running rank; a rank that still
  does not stop within ``escalate`` seconds is killed and restarted;
* after a release the process group is rebuilt, so the next cell works.
"""

from __future__ import annotations

import json
import os
import pickle
import queue
import re
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .config import RunConfig
from .errors import ClusterError, RankError, RunTimeout

if TYPE_CHECKING:
    from .cluster import Cluster

ESCALATE_S = 3.0
METRICS_KEY = "nbdist.metrics."
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_CELL_LINE = re.compile(r"(?:Cell In\[\d+\]|<cell[^>]*>|ipykernel_\d+/\d+\.py)\D+line (\d+)")
_DIST_ERROR = re.compile(r"gloo|nccl|Connection closed by peer|DistBackendError|c10d|ProcessGroup", re.I)


@dataclass(slots=True)
class RankResult:
    """What one rank did with a cell."""

    rank: int
    engine_id: int
    status: str = "pending"  # ok | error | interrupted | dead | timeout
    stdout: str = ""
    stderr: str = ""
    outputs: list[dict[str, Any]] = field(default_factory=list)
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    wall_s: float | None = None


@dataclass(slots=True)
class RunResult:
    """Per-rank results of one cell, plus what nbdist did about failures."""

    ranks: list[RankResult]
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    released: str | None = None  # why ranks were interrupted, if they were
    reports: dict[int, dict[str, Any]] = field(default_factory=dict)  # where each released rank waited
    metrics: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # nbdist.log rows by rank

    @property
    def ok(self) -> bool:
        return all(r.status == "ok" for r in self.ranks)

    @property
    def failed(self) -> list[RankResult]:
        return [r for r in self.ranks if r.status != "ok"]

    def __getitem__(self, rank: int) -> RankResult:
        for r in self.ranks:
            if r.rank == rank:
                return r
        raise KeyError(f"rank {rank} did not run this cell; it ran on ranks {[r.rank for r in self.ranks]}.")

    def raise_for_error(self) -> RunResult:
        """Raise RankError (RunTimeout for a timeout) if any rank did not finish cleanly."""
        if self.ok:
            return self
        # The rank that raised first in rank order is the cause; ranks released because of it come after.
        order = {"error": 0, "dead": 1, "timeout": 2, "interrupted": 3}
        failed = sorted(self.failed, key=lambda r: (order.get(r.status, 9), r.rank))
        failures = [_failure(r) for r in failed]
        head = failures[0]
        message = head["summary"]
        others = [f["summary"] for f in failures[1:]]
        if others:
            message += "\n" + "\n".join(others)
        cls = RunTimeout if self.released in ("timeout", "watchdog") else RankError
        raise cls(message, failures=failures, notes=self.notes)


def _failure(r: RankResult) -> dict[str, Any]:
    err = r.error or {}
    ename, evalue = err.get("ename", r.status), err.get("evalue", "")
    tb = [_ANSI.sub("", line) for line in err.get("traceback", [])]
    line = err.get("line")
    where = f" in cell line {line}" if line else ""
    if r.status == "dead":
        summary = f"rank {r.rank} (engine {r.engine_id}) died while running the cell: {evalue}"
    elif r.status == "interrupted":
        summary = f"rank {r.rank} (engine {r.engine_id}) was interrupted{where}"
    elif r.status == "timeout":
        summary = f"rank {r.rank} (engine {r.engine_id}) did not finish in time{where}"
    else:
        summary = f"rank {r.rank} (engine {r.engine_id}) raised {ename}{where}: {evalue}"
    return {
        "rank": r.rank,
        "engine_id": r.engine_id,
        "status": r.status,
        "ename": ename,
        "evalue": evalue,
        "line": line,
        "traceback": tb,
        "summary": summary,
    }


# ----------------------------------------------------------------------------- output


class Sink:
    """Where a running cell's output goes. Subclass it and override what you need;
    every method is optional (TaggedPrinter, the default, prints and plots)."""

    def stream(self, rank: int, name: str, text: str) -> None:
        pass

    def display(self, rank: int, content: dict[str, Any]) -> None:
        pass

    def result(self, rank: int, content: dict[str, Any]) -> None:
        pass

    def metrics(self, rank: int, rows: list[dict[str, Any]]) -> None:
        pass

    def state(self, rank: int, state: str) -> None:
        pass

    def progress(self, done: int, total: int) -> None:
        pass

    def flush(self) -> None:
        pass


class TaggedPrinter(Sink):
    """Default sink: prints each complete line as ``[rank N] ...``; shows displays per rank."""

    def __init__(self, quiet_ranks: set[int] | None = None, limit: int = 100_000) -> None:
        self.quiet_ranks = quiet_ranks or set()
        self.limit = limit  # characters shown per rank and stream per cell (FAULTS.md row 9)
        self._partial: dict[tuple[int, str], str] = {}
        self._shown: dict[tuple[int, str], int] = {}
        self.dashboard: Any = None
        self._states: dict[int, str] = {}
        self._bar: Any = None

    def stream(self, rank: int, name: str, text: str) -> None:
        if rank in self.quiet_ranks:
            return
        key = (rank, name)
        shown = self._shown.get(key, 0)
        if shown >= self.limit:
            return
        if shown + len(text) > self.limit:
            text = text[: self.limit - shown]
            text += (
                f"\n... {name} of rank {rank} cut at {self.limit:,} characters; "
                "the whole text is in the RunResult (cluster.last)\n"
            )
        self._shown[key] = shown + len(text)
        buf = self._partial.get(key, "") + text
        *lines, rest = buf.split("\n")
        self._partial[(rank, name)] = rest
        if lines:
            out = sys.stderr if name == "stderr" else sys.stdout
            out.write("".join(f"[rank {rank}] {line}\n" for line in lines))
            out.flush()

    def display(self, rank: int, content: dict[str, Any]) -> None:
        if rank in self.quiet_ranks:
            return
        _show(rank, content.get("data", {}), content.get("metadata", {}), prefix=f"[rank {rank}]")

    def result(self, rank: int, content: dict[str, Any]) -> None:
        if rank in self.quiet_ranks:
            return
        _show(rank, content.get("data", {}), content.get("metadata", {}), prefix=f"[rank {rank}] Out:")

    def state(self, rank: int, state: str) -> None:
        """A rank's state changed (busy, idle, failed, dead): shown in the dashboard's strip."""
        self._states[rank] = state
        if self.dashboard is not None:
            self.dashboard.set_state(rank, state)

    def progress(self, done: int, total: int) -> None:
        """Ranks finished so far, as tqdm's notebook bar, for cells that run longer than a moment."""
        if self._bar is None:
            if not _in_kernel():
                return
            from tqdm.notebook import tqdm

            self._bar = tqdm(total=total, desc="ranks finished", leave=False)
        self._bar.n = done
        self._bar.refresh()

    def metrics(self, rank: int, rows: list[dict[str, Any]]) -> None:
        """Rows from nbdist.log: plotted live in a notebook (the dashboard appears on the first rows)."""
        if self.dashboard is None:
            if not _in_kernel():
                return
            from .widgets.dashboard import Dashboard

            self.dashboard = Dashboard()
            for r, st in self._states.items():
                self.dashboard.states[r] = st
            self.dashboard.show()
        self.dashboard.update(rank, rows)

    def flush(self) -> None:
        if self._bar is not None:
            self._bar.n = self._bar.total  # every rank has finished by now (or failed, which the cell reports)
            self._bar.refresh()
            self._bar.close()  # leave=False: the bar goes away
            self._bar = None
        if self.dashboard is not None:
            self.dashboard.close()  # the final state, as a static figure
        for (rank, name), rest in sorted(self._partial.items()):
            if rest:
                out = sys.stderr if name == "stderr" else sys.stdout
                out.write(f"[rank {rank}] {rest}\n")
                out.flush()
        self._partial.clear()


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def _show(rank: int, data: dict[str, Any], metadata: dict[str, Any], prefix: str) -> None:
    text = data.get("text/plain", "")
    rich = {k: v for k, v in data.items() if k != "text/plain"}
    try:
        from IPython import get_ipython

        shell = get_ipython()
    except ImportError:  # pragma: no cover
        shell = None
    if rich and shell is not None and getattr(shell, "kernel", None) is not None:
        from IPython.display import publish_display_data

        print(prefix, flush=True)
        publish_display_data(data, metadata)
        return
    if "\n" in text:
        print(prefix)
        print(text, flush=True)
    else:
        print(f"{prefix} {text}", flush=True)


# ----------------------------------------------------------------------------- execute


class PendingRun:
    """A cell started with block=False; ``wait()`` returns its RunResult."""

    def __init__(self, watcher: _Watch) -> None:
        self._watch = watcher
        self._result: RunResult | None = None

    def done(self) -> bool:
        return self._result is not None or self._watch.ar.ready()

    def wait(self, timeout: float | None = None, show: bool = True) -> RunResult:
        if self._result is None:
            self._result = self._watch.follow(deadline_s=timeout, stream=show)
        return self._result

    def result(self, timeout: float | None = None) -> RunResult:
        return self.wait(timeout).raise_for_error()

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"<nbdist.PendingRun on ranks {self._watch.cfg.ranks}: {state}; collect with .wait()>"


def execute(cluster: Cluster, code: str, cfg: RunConfig, sink: Any = None) -> RunResult | PendingRun:
    dead = [r for r in cluster.dead_ranks() if r in cfg.ranks]
    if dead:
        raise ClusterError(
            f"rank {dead[0]} (engine {cluster.ranks[dead[0]].engine_id}) is dead; "
            "run %dist_restart (or cluster.restart()) to bring the world back."
        )
    if sink is None:
        quiet = set(cfg.ranks[1:]) if cfg.quiet else set()
        sink = TaggedPrinter(quiet_ranks=quiet)
    view = cluster.view(cfg.ranks)
    ar = view.execute(code, silent=False, block=False)
    watcher = _Watch(cluster, cfg, ar, sink)
    if not cfg.block:
        pending = PendingRun(watcher)
        cluster.last = pending
        return pending
    result = watcher.follow(deadline_s=cfg.timeout, stream=True)
    cluster.last = result
    return result


class _Watch:
    """Follows one AsyncResult to the end, applying the failure policy."""

    def __init__(self, cluster: Cluster, cfg: RunConfig, ar: Any, sink: Any) -> None:
        self.cluster, self.cfg, self.ar, self.sink = cluster, cfg, ar, sink
        self.wake: queue.SimpleQueue[int] = queue.SimpleQueue()
        self.children = list(ar._children)
        self.seen: list[dict[str, Any]] = [
            {"stdout": 0, "stderr": 0, "outputs": 0, "result": False, "data": set()} for _ in self.children
        ]
        self.metrics: dict[int, list[dict[str, Any]]] = {r: [] for r in cfg.ranks}
        self.states: dict[int, str] = {}
        self.tic = time.perf_counter()
        self.timings: dict[str, float] = {}
        for child in self.children:
            child.iopub_callbacks.append(self._poke)
            child.add_done_callback(lambda f: self.wake.put(1))

    def _report_states(self) -> None:
        """Tell the sink which ranks are busy or done (and, after 2 s, show progress)."""
        done = 0
        for i, child in enumerate(self.children):
            rank = self.cfg.ranks[i]
            if child.done():
                done += 1
                err = _child_error(child)
                state = "idle" if err is None else ("dead" if getattr(err, "ename", "") == "EngineError" else "failed")
            else:
                state = "busy"
            if self.states.get(rank) != state:
                self.states[rank] = state
                on_state = getattr(self.sink, "state", None)
                if on_state is not None:
                    on_state(rank, state)
        on_progress = getattr(self.sink, "progress", None)
        if on_progress is not None and time.perf_counter() - self.tic > 2.0 and done < len(self.children):
            on_progress(done, len(self.children))

    def _poke(self, msg: Any) -> None:
        # Wake the watching thread only for what it shows; bookkeeping messages would just
        # make it compete with ipyparallel's IO thread for the GIL.
        if msg.get("header", {}).get("msg_type") in (
            "stream",
            "display_data",
            "execute_result",
            "error",
            "data_message",
        ):
            self.wake.put(1)

    def _emit(self) -> None:
        for i, child in enumerate(self.children):
            md = child.output.metadata
            rank = self.cfg.ranks[i]
            seen = self.seen[i]
            for name in ("stdout", "stderr"):
                text = md.get(name) or ""
                if len(text) > seen[name]:
                    self.sink.stream(rank, name, text[seen[name] :])
                seen[name] = len(text)
            outputs = md.get("outputs") or []
            for content in outputs[seen["outputs"] :]:
                self.sink.display(rank, content)
            seen["outputs"] = len(outputs)
            if md.get("execute_result") and not seen["result"]:
                seen["result"] = True
                self.sink.result(rank, md["execute_result"])
            data = md.get("data") or {}
            fresh = sorted(k for k in data if k.startswith(METRICS_KEY) and k not in seen["data"])
            for key in fresh:
                seen["data"].add(key)
                rows = data[key].get("rows", [])
                self.metrics[rank].extend(rows)
                on_metrics = getattr(self.sink, "metrics", None)
                if on_metrics is not None:
                    on_metrics(rank, rows)

    def follow(self, deadline_s: float | None, stream: bool) -> RunResult:
        cluster, cfg = self.cluster, self.cfg
        grace = cluster.config.grace
        deadline = self.tic + deadline_s if deadline_s else None
        first_failure: float | None = None
        first_finish: float | None = None
        watchdog = cluster.config.watchdog
        released_at: float | None = None
        released: str | None = None
        reports: dict[int, dict[str, Any]] = {}
        killed: list[int] = []
        interrupted = False
        while True:
            try:
                try:
                    self.wake.get(timeout=0.05)
                except queue.Empty:
                    pass
                if stream:
                    self._emit()
                    self._report_states()
                pending = [cfg.ranks[i] for i, c in enumerate(self.children) if not c.done()]
                if not pending:
                    self.timings["results"] = time.perf_counter() - self.tic
                    break
                now = time.perf_counter()
                failed_any = any(_child_error(c) is not None for c in self.children)
                if failed_any and first_failure is None:
                    first_failure = now
                finished_any = len(pending) < len(self.children)
                if finished_any and first_finish is None:
                    first_finish = now
                if released is None:
                    if first_failure is not None and now - first_failure > grace:
                        released = "failure"
                    elif deadline is not None and now > deadline:
                        released = "timeout"
                    elif watchdog and first_finish is not None and now - first_finish > watchdog:
                        # Some ranks are done, others still running: a hang only if they wait in a collective.
                        reports = _collect_reports(cluster, pending)
                        if any(rep.get("in_collective") for rep in reports.values()):
                            released = "watchdog"
                        else:
                            first_finish = now  # legitimate work on the other ranks; look again later
                    if released:
                        reports = _collect_reports(cluster, pending)
                        cluster.signal_ranks(pending)
                        released_at = now
                elif released_at is not None and now - released_at > ESCALATE_S and not killed:
                    killed = pending
                    cluster._kill_ranks(pending)
                    break
            except KeyboardInterrupt:
                interrupted = True
                if released is None:
                    pending = [cfg.ranks[i] for i, c in enumerate(self.children) if not c.done()]
                    reports = _collect_reports(cluster, pending)
                    cluster.signal_ranks(pending)
                    released, released_at = "interrupt", time.perf_counter()
        self._finish_output(stream)
        result = self._collect(released, reports, killed)
        _repair(cluster, result, killed)
        if interrupted:
            for note in result.notes:
                print(note, file=sys.stderr)
            raise KeyboardInterrupt
        return result

    def _finish_output(self, stream: bool) -> None:
        # Output can trail the reply by a moment (iopub and shell are separate sockets).
        if stream:
            end = time.perf_counter() + 1.0
            for child in self.children:
                try:
                    child.output.result(timeout=max(0.0, end - time.perf_counter()))
                except Exception:  # the output of a dead engine never completes
                    pass
            self._emit()
            self._report_states()
            self.sink.flush()
        self.timings["outputs"] = time.perf_counter() - self.tic
        for child in self.children:
            try:
                child.iopub_callbacks.remove(self._poke)
            except ValueError:
                pass

    def _collect(self, released: str | None, reports: dict[int, dict[str, Any]], killed: list[int]) -> RunResult:
        out = []
        for i, child in enumerate(self.children):
            rank = self.cfg.ranks[i]
            md = child.output.metadata
            rr = RankResult(rank=rank, engine_id=self.cluster.ranks[rank].engine_id)
            rr.stdout, rr.stderr = md.get("stdout") or "", md.get("stderr") or ""
            rr.outputs = list(md.get("outputs") or [])
            rr.result = md.get("execute_result")
            rr.wall_s = _seconds_between(md.get("started"), md.get("completed"))
            exc = _child_error(child)
            if rank in killed or not child.done():
                rr.status = "dead"
                rr.error = {
                    "ename": "Killed",
                    "evalue": "did not stop after an interrupt; nbdist ended it",
                    "traceback": [],
                }
            elif exc is not None:
                rr.error = _error_dict(exc)
                ename = rr.error["ename"]
                if ename == "EngineError":
                    rr.status = "dead"
                elif ename == "KeyboardInterrupt" or (released and _DIST_ERROR.search(rr.error["evalue"] or "")):
                    rr.status = "timeout" if released in ("timeout", "watchdog") else "interrupted"
                else:
                    rr.status = "error"
                if rank in reports and reports[rank].get("cell_line"):
                    rr.error["line"] = rr.error.get("line") or reports[rank]["cell_line"]
            else:
                rr.status = "ok"
            out.append(rr)
        result = RunResult(
            ranks=out, wall_s=time.perf_counter() - self.tic, released=released, reports=reports, metrics=self.metrics
        )
        _explain(result)
        return result


def _child_error(child: Any) -> BaseException | None:
    """The error one engine reported for this cell (ipyparallel stores it as the result)."""
    if not child.done():
        return None
    exc = child.exception()
    if exc is not None:
        return exc
    res = child.result()
    if isinstance(res, BaseException):
        return res
    err = child.output.metadata.get("error")
    return err if isinstance(err, BaseException) else None


def _seconds_between(start: Any, end: Any) -> float | None:
    from datetime import datetime

    try:
        if isinstance(start, str):
            start = datetime.fromisoformat(start)
        if isinstance(end, str):
            end = datetime.fromisoformat(end)
        return float((end - start).total_seconds())
    except (TypeError, ValueError):
        return None


def _error_dict(exc: BaseException) -> dict[str, Any]:
    ename = getattr(exc, "ename", None) or type(exc).__name__
    evalue = getattr(exc, "evalue", None)
    if evalue is None:
        evalue = str(exc)
    tb = getattr(exc, "traceback", None)
    lines = tb.splitlines() if isinstance(tb, str) else list(tb or [])
    line = None
    for text in lines:
        m = _CELL_LINE.search(_ANSI.sub("", text))
        if m:
            line = int(m.group(1))
    return {"ename": ename, "evalue": str(evalue), "traceback": lines, "line": line}


def _collect_reports(cluster: Cluster, ranks: list[int], wait: float = 0.5) -> dict[int, dict[str, Any]]:
    """Ask the running ranks where they are (SIGUSR1 -> watcher writes a report)."""
    import signal

    directory = cluster._workdir
    paths = {r: os.path.join(directory, f"rank{r}.json") for r in ranks}
    for path in paths.values():
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    cluster.signal_ranks(ranks, signal.SIGUSR1)
    reports: dict[int, dict[str, Any]] = {}
    end = time.monotonic() + wait
    while time.monotonic() < end and len(reports) < len(paths):
        for rank, path in paths.items():
            if rank not in reports and os.path.exists(path):
                try:
                    with open(path) as fh:
                        reports[rank] = json.load(fh)
                except (OSError, ValueError):
                    pass
        time.sleep(0.01)
    return reports


def _explain(result: RunResult) -> None:
    notes = result.notes
    errored = [r for r in result.ranks if r.status == "error"]
    ok = [r for r in result.ranks if r.status == "ok"]
    if errored and ok:
        notes.append(
            f"note: rank(s) {', '.join(str(r.rank) for r in ok)} finished this cell, so state on the ranks may now differ."
        )
    if result.released:
        why = {
            "failure": "a rank failed",
            "timeout": "the cell ran past its timeout",
            "interrupt": "of Ctrl-C",
            "watchdog": "other ranks had finished the cell and it waited in a collective past the watchdog",
        }[result.released]
        for rank, rep in sorted(result.reports.items()):
            if rep.get("busy"):
                where = f"cell line {rep['cell_line']}" if rep.get("cell_line") else "library code"
                fn = rep.get("function")
                waiting = " (inside torch.distributed)" if rep.get("in_collective") else ""
                notes.append(f"rank {rank} was at {where}, in {fn}{waiting}, when released because {why}.")


def _repair(cluster: Cluster, result: RunResult, killed: list[int]) -> None:
    """After a release or a broken collective, make the world usable again and say how."""
    dead = sorted({r.rank for r in result.ranks if r.status == "dead"} | set(killed))
    broke = bool(result.released) or any(
        r.error and _DIST_ERROR.search(r.error.get("evalue") or "") for r in result.ranks
    )
    if dead:
        tic = time.perf_counter()
        if killed or cluster.config.auto_restart:
            try:
                cluster.restart(dead)
                result.notes.append(
                    f"rank(s) {', '.join(map(str, dead))} did not stop and were restarted with the same rank(s) "
                    f"in {time.perf_counter() - tic:.1f} s (their variables are gone); the process group was rebuilt."
                )
            except Exception as exc:
                result.notes.append(f"restarting rank(s) {dead} failed ({exc}); run %dist_restart.")
        else:
            result.notes.append(
                f"rank(s) {', '.join(map(str, dead))} died; run %dist_restart to bring the world back with the same ranks."
            )
        return
    if broke:
        tic = time.perf_counter()
        try:
            cluster.rebuild_world()
            result.notes.append(
                f"the process group was rebuilt in {time.perf_counter() - tic:.2f} s; variables on every rank are kept."
            )
        except Exception as exc:
            result.notes.append(f"rebuilding the process group failed ({exc}); run %dist_restart.")


# ----------------------------------------------------------------------------- data


def push(cluster: Cluster, mapping: dict[str, Any], ranks: list[int]) -> None:
    for name, value in mapping.items():
        _check_picklable(name, value)
    cluster.client[cluster.engine_ids(ranks)].push(mapping, block=True)


def _check_picklable(name: str, value: Any) -> None:
    try:
        import cloudpickle as pickler  # what ipyparallel uses for functions and closures
    except ImportError:  # pragma: no cover
        pickler = pickle  # type: ignore[no-redef]
    try:
        pickler.dumps(value)
    except Exception as exc:
        raise ClusterError(
            f"cannot send {name!r} (type {type(value).__module__}.{type(value).__qualname__}) to the ranks: "
            f"{type(exc).__name__}: {exc}. Send a simpler value (numbers, lists, dicts, numpy arrays, "
            "CPU tensors: use .cpu()), or build it inside a %%distributed cell."
        ) from exc


def pull(cluster: Cluster, name: str, ranks: list[int]) -> list[Any]:
    out = []
    for rank in ranks:
        eid = cluster.ranks[rank].engine_id
        try:
            out.append(cluster.client[eid].pull(name, block=True))
        except Exception as exc:
            err = _error_dict(exc)
            if err["ename"] == "NameError":
                raise ClusterError(
                    f"rank {rank} (engine {eid}) has no variable {name!r}; define it in a %%distributed cell first."
                ) from None
            try:
                from ipyparallel import interactive

                kind = cluster.client[eid].apply_sync(interactive(_type_name), name)
            except Exception:
                kind = "unknown"
            hint = " Move it to the CPU first (.cpu())." if "cuda" in kind.lower() else ""
            raise ClusterError(
                f"cannot fetch {name!r} (type {kind}) from rank {rank} (engine {eid}): {err['ename']}: "
                f"{err['evalue']}. Convert it to a picklable value (a number, list, numpy array or CPU tensor)"
                f" on the ranks first.{hint}"
            ) from None
    return out


def _type_name(name: str) -> str:
    value = globals()[name]
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    device = getattr(value, "device", None)
    return f"{kind} on {device}" if device is not None else kind
