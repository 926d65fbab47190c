"""Follow a running cell to its end: ``Watch.follow`` wakes on output and completions, hands output to the
``Sink``, asks the ``ReleasePolicy`` what to do (release, kill), turns Ctrl-C into a release, and collects
each rank's result into a ``RunResult``; then ``on_done`` (the Cluster's repair policy) sees it.

Output is read from ipyparallel's per-engine metadata as it grows (the iopub callback only wakes the
loop), so nothing is lost or printed twice.
"""

from __future__ import annotations

import functools
import queue
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from datetime import datetime
from typing import Any

from .. import compat, wire
from ..launch import procs
from ..results import RankResult, RankState, RankStatus, Release, RunResult, classify, remote_error
from ..world.engineset import EngineSet
from .output import Sink
from .release import Action, ReleasePolicy

OnDone = Callable[[RunResult, list[int]], list[int]]  # (result, ranks killed) -> ranks to recover
DEATH_CHECK_S = 0.1  # how often a running cell looks whether its ranks' processes are still there
_SHOWN_TYPES = ("stream", "display_data", "execute_result", "error", "data_message")


class _CtrlC:
    """Ctrl-C while a cell is followed, counted by a handler of our own (main thread only).

    Python's default handler raises KeyboardInterrupt wherever the main thread happens to
    be, and a few places (a finalizer, a C call that clears errors) swallow it: the press
    would be lost and the ranks left blocked. This handler only counts and wakes the loop,
    which then acts on it; the previous handler comes back when the cell is over.
    """

    def __init__(self, wake: queue.SimpleQueue[int]) -> None:
        self.wake, self.pressed, self.previous = wake, 0, None
        # only where Ctrl-C means KeyboardInterrupt now: a process that ignores SIGINT keeps ignoring it
        if (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        ):
            try:
                self.previous = signal.signal(signal.SIGINT, self._on_sigint)
            except ValueError:  # not the main interpreter
                self.previous = None

    def _on_sigint(self, signum: int, frame: Any) -> None:
        self.pressed += 1
        self.wake.put(1)  # SimpleQueue.put is reentrant: safe in a signal handler

    def take(self) -> bool:
        pressed, self.pressed = self.pressed, 0
        return pressed > 0

    def restore(self) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
            self.previous = None


class Watch:
    """Follows one AsyncResult to the end: streams its output, applies the release policy."""

    def __init__(
        self,
        engines: EngineSet,
        ranks: list[int],
        ar: Any,
        sink: Sink,
        *,
        grace: float,
        watchdog: float | None,
        on_done: OnDone,
    ) -> None:
        self.engines, self.ranks, self.ar, self.sink = engines, ranks, ar, sink
        self.grace, self.watchdog, self.on_done = grace, watchdog, on_done
        self.tic = time.perf_counter()
        self.wake: queue.SimpleQueue[int] = queue.SimpleQueue()
        self.children = compat.async_result_children(ar)  # one per rank, in the order of ``ranks``
        self.seen = [_Seen() for _ in self.children]
        self.metrics: dict[int, list[dict[str, Any]]] = {r: [] for r in ranks}
        self.states: dict[int, RankState] = {}
        self.reports: dict[int, dict[str, Any]] = {}  # where released ranks were
        self.checkpoint: dict[str, Any] | None = None  # the last save_checkpoint of the cell, if any
        # Ranks whose process nbdist started on this host, by pid: a death is seen at once, from the process,
        # instead of when the controller's heart monitor misses its beats (1-2 s later).
        infos = [engines.ranks[r] for r in ranks]
        self.pids = {i: info.pid for i, info in enumerate(infos) if info.local and info.pid}
        self.gone: set[int] = set()  # children whose process has ended before they reported
        self.finished: set[int] = set()  # children whose output (iopub, up to its idle status) was handed on
        self.deaths_at = self.tic  # the last look at the ranks' processes
        # What each rank wrote and displayed, message by message, in order (ipyparallel keeps each stream's
        # text and the displays apart): (stream, text) or ("display", content), appended by its IO thread.
        self.order: list[deque[tuple[str, Any]]] = [deque() for _ in self.children]
        self.heard = [functools.partial(self._poke, i) for i in range(len(self.children))]
        compat.on_io_thread(engines.client, self._listen)
        for child in self.children:
            child.add_done_callback(lambda f: self.wake.put(1))

    def follow(self, timeout: float | None, stream: bool) -> tuple[RunResult, list[int]]:
        """Watch until every rank is done, releasing or killing ranks as the policy says.

        Wakes on output and completions (at least every 50 ms), shows new output when
        ``stream``, and asks the policy what to do. Ctrl-C releases the running ranks and
        is raised again once they stopped and the world was repaired. Returns the result
        after ``on_done`` has seen it, and the ranks ``on_done`` left to recover.
        """
        policy = ReleasePolicy(grace=self.grace, watchdog=self.watchdog, timeout=timeout, started=self.tic)
        ctrl_c = _CtrlC(self.wake)
        try:
            killed, interrupted = self._loop(policy, ctrl_c, stream)
        finally:
            ctrl_c.restore()
        self._finish_output(stream)
        result = self._collect(policy.released, killed)
        recover = self.on_done(result, killed)
        if interrupted:
            for note in result.notes:
                print(note, file=sys.stderr)
            raise KeyboardInterrupt
        return result, recover

    def _loop(self, policy: ReleasePolicy, ctrl_c: _CtrlC, stream: bool) -> tuple[list[int], bool]:
        """Until no rank runs: (the ranks killed, whether Ctrl-C was pressed)."""
        killed: list[int] = []
        interrupted = False
        while True:
            try:
                try:
                    self.wake.get(timeout=0.05)
                    while True:  # a burst of messages (16 ranks finishing) is one look, not one each
                        self.wake.get_nowait()
                except queue.Empty:
                    pass
                if ctrl_c.take():
                    raise KeyboardInterrupt
                if stream:
                    heard_all = [i for i, c in enumerate(self.children) if c.output.done()]  # before the emit
                    self._emit()
                    self._report_states()
                    for i in heard_all:  # their output is all with the sink now: no line of theirs to wait for
                        if i not in self.finished:
                            self.finished.add(i)
                            _call(self.sink, "finished", self.ranks[i])
                    _call(self.sink, "tick")
                self._notice_deaths()
                running = self._running()
                if not running:
                    return killed, interrupted
                failed = bool(self.gone) or any(_error_of(c) is not None for c in self.children)
                action = policy.observe(failed=failed, finished=len(running) < len(self.children))
                if action is Action.PROBE:
                    self.reports = self.engines.where(running)
                    action = policy.probed(any(rep.get("in_collective") for rep in self.reports.values()))
                    if action is Action.RELEASE:
                        self.engines.signal(running)
                elif action is Action.RELEASE:
                    self._release(running)
                elif action is Action.KILL:
                    killed = running
                    self.engines.kill(running)
                    return killed, interrupted
            except KeyboardInterrupt:
                interrupted = True
                if policy.interrupt() is Action.RELEASE:
                    self._release(self._running())

    def _running(self) -> list[int]:
        return [self.ranks[i] for i, c in enumerate(self.children) if not c.done() and i not in self.gone]

    def _notice_deaths(self) -> None:
        """Ranks whose process ended, read from /proc: at most every DEATH_CHECK_S (16 reads a look; a
        cell that ends sooner never pays them), still long before a missed heartbeat says so."""
        now = time.perf_counter()
        if now - self.deaths_at < DEATH_CHECK_S:
            return
        self.deaths_at = now
        for i, pid in self.pids.items():
            if i not in self.gone and not self.children[i].done() and not procs.alive(pid):
                self.gone.add(i)

    def _release(self, running: list[int]) -> None:
        """Note where the running ranks are, then interrupt them (their watchers do the rest)."""
        self.reports = self.engines.where(running)
        self.engines.signal(running)

    def _listen(self) -> None:
        """On the client's IO thread, between two messages: take what each rank already sent from the
        store (a fast rank can print before the watch exists), then hear every later message."""
        for i, (child, heard) in enumerate(zip(self.children, self.heard, strict=True)):
            md = child.output.metadata
            self.order[i].extend((name, md[name]) for name in ("stdout", "stderr") if md.get(name))
            self.order[i].extend(("display", content) for content in md.get("outputs") or [])
            child.iopub_callbacks.append(heard)

    def _poke(self, i: int, msg: Any) -> None:
        # Wake the watching thread only for what it shows; bookkeeping messages would just
        # make it compete with ipyparallel's IO thread for the GIL.
        kind = msg.get("header", {}).get("msg_type")
        if kind == "stream":
            content = msg.get("content", {})
            self.order[i].append((content.get("name", "stdout"), content.get("text", "")))
        elif kind == "display_data":
            self.order[i].append(("display", msg.get("content", {})))
        if kind in _SHOWN_TYPES:
            self.wake.put(1)

    def _report_states(self) -> None:
        """Tell the sink which ranks are busy or done (and, after 2 s, show progress)."""
        done = 0
        for i, child in enumerate(self.children):
            state = RankState.BUSY
            if i in self.gone and not child.done():
                done += 1
                state = RankState.DEAD
            elif child.done():
                done += 1
                err = _error_of(child)
                if err is None:
                    state = RankState.IDLE
                else:
                    state = RankState.DEAD if getattr(err, "ename", "") == "EngineError" else RankState.FAILED
            rank = self.ranks[i]
            if self.states.get(rank) != state:
                self.states[rank] = state
                _call(self.sink, "state", rank, state)
        if time.perf_counter() - self.tic > 2.0 and done < len(self.children):
            _call(self.sink, "progress", done, len(self.children))

    def _emit(self, last: bool = False) -> None:
        """Hand the sink what each rank produced since the last call (``last``: the cell is over)."""
        for i, child in enumerate(self.children):
            md, rank, seen = child.output.metadata, self.ranks[i], self.seen[i]
            self._emit_streams(i, md, rank, seen, last)
            if md.get("execute_result") and not seen.result:
                seen.result = True
                self.sink.result(rank, md["execute_result"])
            data = md.get("data") or {}
            for key in sorted(k for k in data if k.startswith(wire.METRICS) and k not in seen.data):
                seen.data.add(key)
                rows = data[key].get("rows", [])
                self.metrics[rank].extend(rows)
                _call(self.sink, "metrics", rank, rows)

    def _emit_streams(self, i: int, md: dict[str, Any], rank: int, seen: _Seen, last: bool = False) -> None:
        """A rank's new stdout, stderr and displays in the order they were made, from the messages heard
        (ipyparallel's stored text is rewritten at each carriage return, so it cannot be sliced by length);
        ``last``: what no message was heard of (made before the watch listened) comes from the store."""
        order = self.order[i]
        while order:
            name, item = order.popleft()
            if name == "display":
                seen.outputs += 1
                self.sink.display(rank, item)
            else:
                seen.chars[name] += len(item)
                self.sink.stream(rank, name, item)
        if last:
            for name in ("stdout", "stderr"):
                stored = md.get(name) or ""
                if stored and not seen.chars[name]:
                    seen.chars[name] = len(stored)
                    self.sink.stream(rank, name, stored)
            outputs = md.get("outputs") or []
            for content in outputs[seen.outputs :]:
                self.sink.display(rank, content)
            seen.outputs = len(outputs)

    def _finish_output(self, stream: bool) -> None:
        # Output can trail the reply by a moment (iopub and shell are separate sockets).
        if stream:
            end = time.perf_counter() + 1.0
            for i, child in enumerate(self.children):
                if i in self.gone and not child.done():
                    continue  # a dead engine's output never completes
                try:
                    child.output.result(timeout=max(0.0, end - time.perf_counter()))
                except Exception:  # the output of a dead engine never completes
                    pass
            self._emit(last=True)
            self._report_states()
            self.sink.flush()
        for child, heard in zip(self.children, self.heard, strict=True):
            try:
                child.iopub_callbacks.remove(heard)
            except ValueError:
                pass

    def _collect(self, released: Release | None, killed: list[int]) -> RunResult:
        out = []
        for i, child in enumerate(self.children):
            rank = self.ranks[i]
            md = child.output.metadata
            info = self.engines.ranks[rank]
            rr = RankResult(rank=rank, engine_id=info.engine_id, host="" if info.local else info.host)
            rr.stdout, rr.stderr = md.get("stdout") or "", md.get("stderr") or ""
            rr.outputs = list(md.get("outputs") or [])
            rr.result = md.get("execute_result")
            rr.wall_s = _seconds_between(md.get("started"), md.get("completed"))
            self.checkpoint = (md.get("data") or {}).get(wire.CHECKPOINT, self.checkpoint)
            exc = _error_of(child)
            if i in self.gone and not child.done():
                rr.status = RankStatus.DEAD
                rr.error = {
                    "ename": "EngineError",
                    "evalue": f"its process (pid {self.pids[i]}) ended",
                    "traceback": [],
                }
            elif rank in killed or not child.done():
                rr.status = RankStatus.DEAD
                rr.error = {"ename": "Killed", "evalue": "did not stop after an interrupt; nbdist ended it"}
                rr.error["traceback"] = []
            elif exc is not None:
                rr.error = remote_error(exc)
                rr.status = classify(rr.error, released)
                report = self.reports.get(rank, {})
                if report.get("cell_line") and not rr.error.get("line"):
                    rr.error["line"] = report["cell_line"]
            else:
                rr.status = RankStatus.OK
            out.append(rr)
        result = RunResult(
            ranks=out,
            wall_s=time.perf_counter() - self.tic,
            released=released,
            reports=self.reports if released else {},
            metrics=self.metrics,
            checkpoint=self.checkpoint,
        )
        result.explain()
        return result


class _Seen:
    """How much of one rank's output has been handed to the sink."""

    __slots__ = ("chars", "outputs", "result", "data")

    def __init__(self) -> None:
        self.chars = {"stdout": 0, "stderr": 0}
        self.outputs = 0
        self.result = False
        self.data: set[str] = set()


def _call(sink: Any, method: str, *args: Any) -> None:
    """Call an optional sink method (a sink that does not subclass Sink may lack it)."""
    fn = getattr(sink, method, None)
    if fn is not None:
        fn(*args)


def _error_of(child: Any) -> BaseException | None:
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
    try:
        if isinstance(start, str):
            start = datetime.fromisoformat(start)
        if isinstance(end, str):
            end = datetime.fromisoformat(end)
        return float((end - start).total_seconds())
    except (TypeError, ValueError):
        return None
