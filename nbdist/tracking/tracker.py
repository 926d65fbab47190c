"""One tracked run for a world (``%dist_track``): what the ranks log goes to one run of a tracker, from the notebook.

The ranks send their rows as they always do; the cell path hands them to the tracker as the dashboard gets them
(``metrics``), and to nothing else on the rank: no rank opens a run. The tracker only puts them on a bounded queue
(QUEUE items: a cell's batches) and returns; a thread of its own turns them into points (steps.py) and writes them
to the run, so a slow tracker never slows a step or a cell. When the queue is full (a tracker stuck for minutes)
batches are dropped and counted, said once, and the run goes on. ``close`` writes what is queued (for at most
CLOSE_S) and ends the run.

A world's run outlives its kernel with the world (``%dist_start --keep``, then ``%dist_attach`` in a new kernel):
the tracker keeps STATE in the world's private directory (how to open the run again, its last step, the world's
size), written before each batch's points go to the tracker, so the steps a new kernel's cells log go on after
every step the run may hold: none twice. ``resume`` opens the run again from it; ``close`` removes it.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from .. import wire
from .sinks import reopen
from .steps import Point, Steps

QUEUE = 10_000  # batches waiting for the writer, at most
DRAIN = 1_000  # batches the writer takes at once: their points go to the tracker in one write
CLOSE_S = 30.0  # what is queued at close is written for at most this long
EXIT_S = 3.0  # ... and when the process exits with the run open (jupyter_client kills a kernel 5 s after asking)
STATE = "track.json"  # in the world's directory, while a run is open


class Run(Protocol):
    """A tracker's run, as the writer thread uses it (sinks.py makes one per tracker)."""

    where: str  # where it is, in words: a folder, a URI
    spec: dict[str, Any]  # what opens it again (sinks.reopen)

    def params(self, params: dict[str, Any]) -> None: ...

    def scalars(self, points: list[Point]) -> None: ...

    def cell(self, code: str, step: int) -> None: ...

    def close(self) -> None: ...


class Tracker:
    """One run for one world (see the module's docstring)."""

    def __init__(
        self, run: Run, kind: str, params: dict[str, Any], workdir: str = "", steps: Steps | None = None
    ) -> None:
        self.run, self.kind = run, kind
        self.steps = steps or Steps()
        self.state = os.path.join(workdir, STATE) if workdir else ""  # where the run's state is kept, if anywhere
        self._kept = -2  # the last step the state file holds
        self.dropped = 0
        self.failed = ""  # the first error the tracker raised, once said
        self._keep()  # before the writer thread, which keeps it from then on
        self._queue: queue.Queue[tuple[str, tuple]] = queue.Queue(QUEUE)
        self._thread = threading.Thread(target=self._write, name="nbdist-track", daemon=True)
        self._thread.start()
        self._closed = False
        atexit.register(self._at_exit)
        if steps is None:  # a new run; one opened again has its parameters
            self._put("params", (params,))

    # ------------------------------------------------------------------ the cell path's side: never waits

    def cell(self, code: str, world: int) -> None:
        self._put("cell", (code, world))

    def metrics(self, rank: int, rows: list[dict[str, Any]]) -> None:
        self._put("rows", (rank, rows))

    def resized(self, new: dict[int, int], step: int | None, joined: list[int] | None = None) -> None:
        self._put("resized", (dict(new), step, list(joined or [])))

    def _put(self, what: str, args: tuple) -> None:
        try:
            self._queue.put_nowait((what, args))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                print(
                    f"nbdist: the {self.kind} run at {self.run.where} does not keep up: its queue holds {QUEUE} "
                    "batches; later ones are left out until it catches up (training goes on).",
                    file=sys.stderr,
                    flush=True,
                )

    # ------------------------------------------------------------------ the writer thread

    def _write(self) -> None:
        while True:
            batch = [self._queue.get()]  # and what else is queued: its rows go to the tracker in one write
            while len(batch) < DRAIN:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = any(what == "stop" for what, _ in batch)
            try:
                self._handle(batch)
            except Exception as exc:  # the tracker's own failure: said once, the training goes on
                if not self.failed:
                    self.failed = f"{type(exc).__name__}: {exc}"
                    print(
                        f"nbdist: the {self.kind} run at {self.run.where} failed to write ({self.failed}); "
                        "training goes on, and %dist_track off ends the run.",
                        file=sys.stderr,
                        flush=True,
                    )
            finally:
                for _ in batch:
                    self._queue.task_done()
            if stop:
                return

    def _handle(self, batch: list[tuple[str, tuple]]) -> None:
        points: list[Point] = []
        for what, args in batch:
            if what == "rows":
                points += self.steps.add(*args)
                continue
            self._apply(points)  # what came before, first
            points = []
            if what == "stop":
                self._apply(self.steps.flush())
                return
            if what == "cell":
                code, world = args
                self._apply(self.steps.cell(world))
                self.run.cell(code, self.steps.base)
            elif what == "resized":
                self._apply(self.steps.resized(*args))
            elif what == "params":
                self.run.params(*args)
        self._apply(points)

    def _apply(self, points: list[Point]) -> None:
        if points:
            self._keep()  # first: a kernel that dies now leaves a run whose next steps come after these
            self.run.scalars(points)

    def _keep(self) -> None:
        if self.state and self.steps.last != self._kept:
            spec = {"run": self.run.spec, "last": self.steps.last, "world": self.steps.world}
            wire.write_private(self.state, json.dumps(spec))
            self._kept = self.steps.last

    def wait(self, timeout: float = CLOSE_S) -> bool:
        """Until what is queued now is written (True), or ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline or not self._thread.is_alive():
                return False
            time.sleep(0.01)
        return True

    def close(self) -> None:
        """Write what is queued (for at most CLOSE_S), then end the run."""
        atexit.unregister(self._at_exit)
        self._finish(CLOSE_S, exiting=False)
        if self.state:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.state)

    def _at_exit(self) -> None:
        """The kernel's process exits with the run open (a restart under a kept world, a script's end): what is
        queued is written (for at most EXIT_S: a restarting kernel is killed a few seconds after it was asked to
        end) and the run ended, so nothing it was handed is lost (a tracker's own writer thread, trackio's, would
        die with the process); its state stays in the world's directory for the kernel that attaches next."""
        self._finish(EXIT_S, exiting=True)

    def _finish(self, within: float, exiting: bool) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put(("stop", ()), timeout=within)
        except queue.Full:
            pass
        self._thread.join(within)
        if exiting and self._thread.is_alive():
            return  # a tracker stuck in a write would hold the exiting process: it is left as it is
        self.run.close()


def resume(workdir: str, say: Callable[[str], None]) -> Tracker | None:
    """The run of the world in ``workdir``, opened again where its last kernel left it (None: it has none), said."""
    try:
        with open(os.path.join(workdir, STATE)) as fh:
            state = json.load(fh)
    except FileNotFoundError:
        return None
    steps = Steps(world=int(state["world"]), last=int(state["last"]))
    steps.base = steps.last + 1
    tracker = Tracker(reopen(state["run"]), state["run"]["kind"], {}, workdir, steps)
    say(f"tracking this world in the {tracker.kind} run at {tracker.run.where} again (from step {steps.base})")
    return tracker
