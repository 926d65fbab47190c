"""Follow a running cell to its end: ``Watch.follow`` wakes on output and completions, hands output to the
``Sink``, asks the ``ReleasePolicy`` what to do (release, kill), turns Ctrl-C into a release, and collects
each rank's result into a ``RunResult``; then ``on_done`` (the Cluster's repair policy) sees it.

Output is read from ipyparallel's per-engine metadata as it grows (the iopub callback only wakes the
loop), so nothing is lost or printed twice.
"""

from __future__ import annotations

import functools
import queue
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from .. import compat, wire
from ..launch import procs
from ..results import RankResult, RankState, RankStatus, Release, RunResult, classify, remote_error
from ..world.engineset import EngineSet
from . import replies
from .interrupt import CtrlC
from .output import Sink
from .pdbrelay import Relay, send_line
from .release import Action, ReleasePolicy

OnDone = Callable[[RunResult, list[int]], list[int]]  # (result, ranks killed) -> ranks to recover
DEATH_CHECK_S = 0.1  # how often a running cell looks whether its ranks' processes are still there
_SHOWN_TYPES = ("stream", "display_data", "execute_result", "error", "data_message")


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
        ask: Callable[[str], str] | None = None,
    ) -> None:
        self.engines, self.ranks, self.ar, self.sink = engines, ranks, ar, sink
        self.ask = ask or _typed  # a person's answer to a rank's debugger prompt (the notebook's input box)
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
        self.pdb: queue.SimpleQueue[tuple[int, dict[str, Any]]] = queue.SimpleQueue()  # (child, what its pdb said)
        self.relay = Relay(functools.partial(send_line, engines), ask=self.ask, say=self._say)
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
        ctrl_c = CtrlC(self.wake)
        self.relay.ask = ctrl_c.around(self.ask)
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

    def _loop(self, policy: ReleasePolicy, ctrl_c: CtrlC, stream: bool) -> tuple[list[int], bool]:
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
                if self._debug(stream, policy):
                    continue  # a person answered a prompt: look at everything afresh
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
                failed = bool(self.gone) or any(replies.error_of(c) is not None for c in self.children)
                exited = any(replies.exit_of(c) is not None for c in self.children)
                action = policy.observe(
                    failed=failed, finished=len(running) < len(self.children), paused=self.relay.active, exited=exited
                )
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

    def _debug(self, stream: bool, policy: ReleasePolicy) -> bool:
        """Hand the ranks' debugger messages to the relay; when one waits at a prompt, stop the policy's
        timers, show the output before it and ask for a line. Whether a line was asked for."""
        while True:
            try:
                i, content = self.pdb.get_nowait()
            except queue.Empty:
                break
            self.relay.take(self.ranks[i], content)
        for i, child in enumerate(self.children if self.relay.inside else []):
            if child.done() and self.ranks[i] in self.relay.inside:
                self.relay.ended(self.ranks[i])
        if self.relay.active:
            policy.hold()  # until observe(paused=False): the time a person spends here is not the cell's
        if not self.relay.prompts:
            return False
        if stream:
            self._emit()
            _call(self.sink, "settle")
        return self.relay.answer()

    def _say(self, text: str) -> None:
        print(text, flush=True)

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
            for content in md.get("outputs") or []:
                self._heard_display(i, content)
            child.iopub_callbacks.append(heard)

    def _poke(self, i: int, msg: Any) -> None:
        # Wake the watching thread only for what it shows; bookkeeping messages would just
        # make it compete with ipyparallel's IO thread for the GIL.
        kind = msg.get("header", {}).get("msg_type")
        if kind == "stream":
            content = msg.get("content", {})
            self.order[i].append((content.get("name", "stdout"), content.get("text", "")))
        elif kind == "display_data":
            self._heard_display(i, msg.get("content", {}))
        if kind in _SHOWN_TYPES:
            self.wake.put(1)

    def _heard_display(self, i: int, content: dict[str, Any]) -> None:
        said = (content.get("data") or {}).get(wire.PDB)
        if said is None:
            self.order[i].append(("display", content))
        else:
            self.pdb.put((i, said))

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
                err = replies.error_of(child)
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
            outputs = replies.shown(md.get("outputs"))
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
            rr.outputs = replies.shown(md.get("outputs"))
            rr.result = md.get("execute_result")
            rr.wall_s = replies.seconds_between(md.get("started"), md.get("completed"))
            self.checkpoint = (md.get("data") or {}).get(wire.CHECKPOINT, self.checkpoint)
            rr.exited = replies.exit_of(child)
            exc = replies.error_of(child)
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


def _typed(prompt: str) -> str:
    return input(prompt)  # looked up at each call: the kernel's input, or a test's


def _call(sink: Any, method: str, *args: Any) -> None:
    """Call an optional sink method (a sink that does not subclass Sink may lack it)."""
    fn = getattr(sink, method, None)
    if fn is not None:
        fn(*args)
