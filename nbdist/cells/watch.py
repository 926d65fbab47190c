"""Follow a running cell to its end: ``Watch.follow`` wakes on output and completions, has what the ranks
sent handed to the ``Sink`` (heard.py), asks the ``ReleasePolicy`` what to do (release, kill), turns Ctrl-C
into a release, and collects each rank's reply into a ``RunResult`` (replies.py); then ``on_done`` (the
Cluster's repair policy) sees it.
"""

from __future__ import annotations

import functools
import queue
import re
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from .. import compat
from ..errors import Interrupted
from ..launch import exits, procs
from ..results import RankState, RunResult
from ..world import reports
from ..world.engineset import EngineSet
from . import replies
from .heard import Heard, call_sink, taken
from .interrupt import CtrlC
from .output import Sink
from .pdbrelay import Relay, send_line
from .release import Action, ReleasePolicy, stuck

OnDone = Callable[[RunResult, list[int]], list[int]]  # (result, ranks killed) -> ranks to recover
DEATH_CHECK_S = 0.1  # how often a running cell looks whether its ranks' processes are still there (no pidfds)
FOLLOWED_CHECK_S = 1.0  # the same look where the kernel tells of each death (launch/exits.py): a second safety net
TICK_S = 1.0  # how often the cell's path is asked whether the world should change (a queued replacement came)


Send = Callable[[Callable[[int, Any], None]], Any]  # sends the cell, calling hear(k, future) as each request is made


class Watch:
    """Sends a cell and follows its AsyncResult to the end: streams its output, applies the release policy."""

    def __init__(
        self,
        engines: EngineSet,
        ranks: list[int],
        send: Send,
        sink: Sink,
        *,
        grace: float,
        watchdog: float | None,
        on_done: OnDone,
        ask: Callable[[str], str] | None = None,
        cell: str = "",
        death_grace: float | None = None,
        tick: Callable[[], None] | None = None,
    ) -> None:
        self.engines, self.ranks, self.sink = engines, ranks, sink
        self.board = engines.board  # each rank's state: busy now, then what its reply says (world/board.py)
        self.board.set(ranks, RankState.BUSY, cell=cell)
        self.ask = ask or _typed  # a person's answer to a rank's debugger prompt (the notebook's input box)
        self.grace, self.watchdog, self.on_done, self.death_grace = grace, watchdog, on_done, death_grace
        self.tick, self.ticked = tick, time.perf_counter()  # called about every TICK_S while the cell runs
        self.tic = time.perf_counter()
        self.wake: queue.SimpleQueue[int] = queue.SimpleQueue()
        self.states: dict[int, RankState] = {}  # what the sink was told
        # The ranks whose state changed and the children whose output is all in, appended as they come: a look at the
        # cell goes through those alone (_report_states, _loop).
        self.changed: deque[int] = deque()
        self.complete: deque[int] = deque()
        self.reports: dict[int, dict[str, Any]] = {}  # where released ranks were
        self.looked: dict[int, dict[str, Any] | None] = {}  # after a release, the last look at those still running
        # Ranks whose process nbdist started on this host, by pid: a death is seen at once, from the process,
        # instead of when the controller's heart monitor misses its beats (1-2 s later).
        infos = [engines.ranks[r] for r in ranks]
        self.pids = {i: info.pid for i, info in enumerate(infos) if info.local and info.pid}
        self.gone: set[int] = set()  # children whose process has ended before they reported
        self.ended: set[int] = set()  # children whose process nbdist ended: stuck after a release
        # What the replies said, kept as they come (on the IO thread) so that a look costs nothing per rank
        # that is done: the children still without a reply, and whether any failed or exited.
        self.waiting: set[int] = set(range(len(ranks)))
        self.failed = False
        self.exited = False
        self.finished: set[int] = set()  # children whose output (iopub, all its reply counted) was handed on
        self.unsettled: set[int] = set()  # children that replied before their output was all in (_settle)
        self.deaths_at = self.tic  # the last look at the ranks' processes
        self.exit_seen: set[int] = set()  # the pids the kernel said ended (launch/exits.py), not yet looked at
        self.out = Heard(ranks, sink, self.wake)  # what the ranks send, in order, to the sink
        self.relay = Relay(functools.partial(send_line, engines), ask=self.ask, say=self._say)
        self.ar = send(self.out.hear)  # each rank heard from before its request goes
        self.children = self.out.children = compat.async_result_children(self.ar)  # one per rank, as ``ranks``
        for i, child in enumerate(self.children):
            child.add_done_callback(functools.partial(self._replied, i))
            child.output.add_done_callback(lambda _, i=i: self.complete.append(i))

    def _replied(self, i: int, child: Any) -> None:
        """A rank's reply came (on the client's IO thread): its state goes on the board. The watch wakes when one
        failed or exited (the release policy acts on it), or when every rank has replied and its output is in
        (``_all_in``); a rank that ended well while others run is seen at the loop's next look, within 50 ms. A wake
        per reply was ten looks a cell at 16 ranks, each over every rank, holding the GIL this thread needs for the
        messages still to come."""
        state = RankState.FAILED  # a reply that cannot be read wakes the watch, as a failure would
        try:
            state = replies.state_of(child)
            self.failed = self.failed or state in (RankState.FAILED, RankState.DEAD)
            self.exited = self.exited or state == RankState.EXITED
            if state == RankState.IDLE and not child.output.done():
                self.unsettled.add(i)  # busy until its output is in: an exit() may still be on its way (_settle)
                child.output.add_done_callback(lambda _: self._settle(i))  # followed or not (a --noblock cell)
            else:
                self.board.set([self.ranks[i]], state)
        finally:  # whatever the reply said, this rank is not running any more
            self.waiting.discard(i)
            if state != RankState.IDLE or self._all_in():
                self.wake.put(1)

    def _all_in(self) -> bool:
        """Every rank replied, and the output of each that replied idle is in."""
        return not self.waiting and not self.unsettled

    def _settle(self, i: int) -> None:
        """A rank whose reply said idle before its output was all in: what it is left in, read now that the output is
        in. An exit() in the cell travels with the output (iopub), which can come after the reply (shell)."""
        try:
            self.unsettled.remove(i)  # once (the IO thread's callback and the loop may both come)
        except KeyError:
            return
        state = replies.state_of(self.children[i])
        self.exited = self.exited or state == RankState.EXITED
        self.board.set([self.ranks[i]], state)
        if state != RankState.IDLE or self._all_in():
            self.wake.put(1)

    def follow(self, timeout: float | None, stream: bool) -> tuple[RunResult, list[int]]:
        """Watch until every rank is done, releasing or killing ranks as the policy says.

        Wakes on output and completions (at least every 50 ms), shows new output when
        ``stream``, and asks the policy what to do. Ctrl-C releases the running ranks and
        is raised again once they stopped and the world was repaired. Returns the result
        after ``on_done`` has seen it, and the ranks ``on_done`` left to recover.
        """
        policy = ReleasePolicy(
            grace=self.grace, watchdog=self.watchdog, timeout=timeout, started=self.tic, death_grace=self.death_grace
        )
        ctrl_c = CtrlC(self.wake)
        unfollow = exits.EXITS.follow(self.pids.values(), self.process_ended)
        unsubscribe = self.board.subscribe(lambda now: self.changed.append(now.rank))  # for the loop's looks
        self.relay.ask = ctrl_c.around(self.ask)
        try:
            killed, interrupted = self._loop(policy, ctrl_c, stream)
        finally:
            ctrl_c.restore()
            unfollow()
            unsubscribe()
        self._finish_output(stream)
        for i in list(self.unsettled):
            self._settle(i)
        if stream:  # the last replies' states: the loop ends on them, before it reports them
            self._report_states(every=True)
        result = replies.collect(
            self.children,
            self.engines,
            self.ranks,
            dead={i: self.pids[i] for i in self.gone},
            killed=killed,
            released=policy.released,
            reports=self.reports,
            metrics={rank: kept.rows() for rank, kept in self.out.metrics.items()},
            started=self.tic,
        )
        recover = self.on_done(result, killed)
        self._over()
        if stream:  # what the cell's end made of each rank (failed -> idle, unanswered -> dead): the chips say it too
            self._report_states(every=True)
        if interrupted:
            for note in result.notes:
                print(note, file=sys.stderr)
            raise Interrupted()
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
                    # before the emit: those whose output is complete
                    heard_all = [i for i in sorted(taken(self.complete)) if i not in self.finished]
                    for i in heard_all:
                        self._settle(i)
                    self.out.emit()
                    self._report_states()
                    for i in heard_all:  # their output is all with the sink now: no line of theirs to wait for
                        if i not in self.finished:
                            self.finished.add(i)
                            call_sink(self.sink, "finished", self.ranks[i])
                    call_sink(self.sink, "tick")
                else:  # nothing shown, but the rows are kept and a tracked run hears them as they come
                    self.out.emit_rows()
                self.notice_deaths()
                if self.tick is not None and time.perf_counter() - self.ticked >= TICK_S:
                    self.ticked = time.perf_counter()
                    self.tick()
                running = self._running()
                if not running:
                    return killed, interrupted
                action = policy.observe(
                    failed=bool(self.gone) or self.failed,
                    finished=len(running) < len(self.children),
                    paused=self.relay.active,
                    exited=self.exited,
                    died=bool(self.gone),
                )
                if action is Action.PROBE:
                    self.reports = reports.where(self.engines, running)
                    action = policy.probed(any(rep.get("in_collective") for rep in self.reports.values()))
                    if action is Action.RELEASE:
                        self.engines.signal(running)
                elif action is Action.RELEASE:
                    self._release(running, death=bool(self.gone) and self.death_grace == 0)
                elif action is Action.CHECK:
                    now = reports.where(self.engines, running)
                    ended = stuck(running, now, self.looked)
                    self.looked = {r: now.get(r) for r in running}
                    self.reports.update(now)  # where they were last seen, for the line of those ended
                    if ended:
                        self._end(ended)
                        killed += ended
                elif action is Action.KILL:
                    self._end(running)
                    return killed + running, interrupted
            except KeyboardInterrupt:
                interrupted = True
                if policy.interrupt() is Action.RELEASE:
                    self._release(self._running())

    def _debug(self, stream: bool, policy: ReleasePolicy) -> bool:
        """Hand the ranks' debugger messages to the relay; when one waits at a prompt, stop the policy's
        timers, show the output before it and ask for a line. Whether a line was asked for."""
        while True:
            try:
                i, content = self.out.pdb.get_nowait()
            except queue.Empty:
                break
            rank = self.ranks[i]
            self.relay.take(rank, content)
            if content.get("state") == "prompt":
                self.board.set([rank], RankState.DEBUGGING, line=_pdb_line(content.get("text", "")))
            elif not self.children[i].done():
                self.board.set([rank], RankState.BUSY)
        for i, child in enumerate(self.children if self.relay.inside else []):
            if child.done() and self.ranks[i] in self.relay.inside:
                self.relay.ended(self.ranks[i])
        if self.relay.active:
            policy.hold()  # until observe(paused=False): the time a person spends here is not the cell's
        if not self.relay.prompts:
            return False
        if stream:
            self.out.emit()
            call_sink(self.sink, "settle")
        return self.relay.answer()

    def _say(self, text: str) -> None:
        print(text, flush=True)

    def _running(self) -> list[int]:
        return [self.ranks[i] for i in sorted(self.waiting - self.gone - self.ended)]

    def process_ended(self, pid: int) -> None:
        """A process on this host ended (on launch/exits.py's thread): if it is one of this cell's ranks, wake the
        loop to look now."""
        if pid in self.pids.values():
            self.exit_seen.add(pid)
            self.wake.put(1)

    def notice_deaths(self) -> None:
        """Ranks whose process ended: at once those the kernel said ended (``process_ended``: one /proc read each);
        and, from /proc, all of them every DEATH_CHECK_S where no pidfd follows them, or every FOLLOWED_CHECK_S where
        they do (a read per rank a look: at 64 ranks, 64 reads in about every trivial cell, 12.7 ms of it
        under the profiler). Both long before a missed heartbeat says so."""
        now = time.perf_counter()
        said = set(self.exit_seen)  # a copy, then only those taken: one added meanwhile (IO thread) stays for the next
        self.exit_seen -= said
        every = max(DEATH_CHECK_S, FOLLOWED_CHECK_S) if exits.EXITS.works else DEATH_CHECK_S
        look_all = now - self.deaths_at >= every
        if look_all:
            self.deaths_at = now
        for i in sorted(self.waiting - self.gone - self.ended):
            pid = self.pids.get(i)
            if pid and (look_all or pid in said) and not procs.alive(pid):
                self.gone.add(i)
                self.board.set([self.ranks[i]], RankState.DEAD)

    def _release(self, running: list[int], death: bool = False) -> None:
        """Note where the running ranks are, then interrupt them (their watchers do the rest). After a death that
        recovery mends (``death``) the group is lost anyway and the cell runs again: no look (the ranks' errors are
        not shown), and the watchers break the group at once instead of giving the cell a moment to stop by itself
        (engine/runtime.py: BREAK_NOW)."""
        if death:
            reports.break_now(self.engines)
        else:
            self.reports = reports.where(self.engines, running)
        self.engines.signal(running)

    def _end(self, ranks: list[int]) -> None:
        """End these ranks' processes (they did not stop after the release): they are dead, and no longer waited for.
        Where each was last seen is said first: what held it is what to fix."""
        for rank in ranks:
            seen = self.reports.get(rank) or {}
            place = " <- ".join(reversed([p.rsplit("/", 1)[-1] for p in (seen.get("stack") or [])[-4:]]))
            state = "" if not seen else " (in its cell)" if seen.get("busy", True) else " (its cell over, no reply sent)"
            self._say(
                f"nbdist: ending rank {rank}, which did not stop after the release{state}: {place or 'silent'}"
                + _broke(seen.get("broke"), seen.get("time"))
            )
        self.engines.kill(ranks)
        self.board.set(ranks, RankState.DEAD)
        self.ended.update(i for i, rank in enumerate(self.ranks) if rank in ranks)

    def _report_states(self, every: bool = False) -> None:
        """Tell the sink each rank's state as the board has it, when it changed (and, after 2 s, progress): while the
        cell runs, of the ranks the board said changed since the last look (the first look and ``every``: of all)."""
        changed = taken(self.changed)
        ranks = [r for r in self.ranks if r in changed] if self.states and not every else self.ranks
        board = self.board.of(ranks)
        done = len(self.children) - len(self.waiting - self.gone - self.ended)
        for rank in ranks:
            state = board[rank].state if rank in board else RankState.BUSY
            if self.states.get(rank) != state:
                self.states[rank] = state
                call_sink(self.sink, "state", rank, state)
        if time.perf_counter() - self.tic > 2.0 and done < len(self.children):
            call_sink(self.sink, "progress", done, len(self.children))

    def _over(self) -> None:
        """The cell is over: a rank that failed or exited in it waits for the next one (idle); one still
        marked busy never replied (killed, or its process ended) and is dead unless it was restarted."""
        board = self.board.get()
        ended = [r for r in self.ranks if r in board and board[r].state in (RankState.FAILED, RankState.EXITED)]
        self.board.set(ended, RankState.IDLE)
        unanswered = {r for r in self.ranks if r in board and board[r].in_cell}
        if unanswered:
            dead = unanswered & set(self.engines.dead_ranks())
            self.board.set(sorted(dead), RankState.DEAD)
            self.board.set(sorted(unanswered - dead), RankState.IDLE)

    def _finish_output(self, stream: bool) -> None:
        # Output can trail the reply by a moment (iopub and shell are separate sockets); its metric rows are kept
        # whether it is shown or not.
        end = time.perf_counter() + 1.0
        lost = self.gone | self.ended
        for i, child in enumerate(self.children):
            if i in self.finished or (i in lost and not child.done()):
                continue  # all in already (the loop saw it); a dead engine's output never completes
            try:
                child.output.result(timeout=max(0.0, end - time.perf_counter()))
            except Exception:  # the output of a dead engine never completes
                pass
        if not stream:
            self.out.emit_rows(last=True)
        else:
            self.out.emit(last=True)
            self._report_states(every=True)
            self.sink.flush()
        self.out.stop()


_PDB_AT = re.compile(r"^> .*?\((\d+)\)", re.M)  # pdb's '> <cell>(12)<module>()': where it stopped


def _pdb_line(text: str) -> int | None:
    found = _PDB_AT.findall(text)
    return int(found[-1]) if found else None


def _typed(prompt: str) -> str:
    return input(prompt)  # looked up at each call: the kernel's input, or a test's


def _broke(broke: list | None, seen_at: float | None) -> str:
    """What the rank's watcher did to its group before it was last seen: a rank that did not stop although its
    connections were shut waits on something else (what to fix); one whose group was never broken waited for it."""
    if not broke:
        return "; its group was not broken"
    closed, of, at = broke
    ago = f" {seen_at - at:.1f} s before it was last seen" if seen_at else ""
    return f"; its watcher shut {closed} of its group's {of} connections{ago}"
