"""What a cell did on each rank: plain data, built by ``run``, read by the magics and by users.

``RankStatus`` is how a rank ended a cell, ``RankState`` what a rank is doing now (the
dashboard's strip and ``%dist_status``), ``Release`` why nbdist interrupted ranks.
``remote_error`` is the one parser of the errors ipyparallel brings back from an engine.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from .doctor import collective_text, odd_ranks, ranks_text
from .errors import Failure, RankError, RunTimeout

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# a cell's frame: "Cell In[3], line 7" (IPython's context mode), "ipykernel_12/34.py:7" (its plain mode)
_CELL_LINE = re.compile(r"(?:Cell In\[\d+\]|<cell[^>]*>|ipykernel_\d+/\d+\.py)(?:\D+line |:)(\d+)")
# %dist_run's frame (engine/hosted.py), and a frame's first line, in IPython's context and plain modes (the plain
# one indents and has no comma: a lost group's errors, engine/runtime.py)
_SCRIPT_RUNNER = re.compile(r"engine/hosted\.py:\d+,? in run_script")
_FILE_LINE = re.compile(r"^\s*File (\S+?):(\d+)")
# An error raised by a broken process group (the release of a rank waiting in a collective).
_DIST_ERROR = re.compile(
    r"gloo|nccl|Connection closed by peer|DistBackendError|c10d|ProcessGroup|mismatch between collectives", re.I
)
# torch's collective check (TORCH_DISTRIBUTED_DEBUG=DETAIL): both ranks' fingerprints in one message.
_MISMATCH = re.compile(
    r"Rank (\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=(\d+), OpType=(\w+)"
    r"(?:, TensorShape=\[([^\]]*)\])?(?:, TensorDtypes=(\w+))?"
)


class _Text(str, Enum):
    """A string enum that prints as its value (so f-strings and JSON read 'ok', not 'RankStatus.OK')."""

    def __str__(self) -> str:
        return str(self.value)

    def __hash__(self) -> int:  # equal to its value, so it hashes like it: dict lookups by 'ok' work
        return hash(self.value)


class RankStatus(_Text):
    """How one rank ended a cell."""

    PENDING = "pending"
    OK = "ok"
    ERROR = "error"  # the cell raised on this rank
    INTERRUPTED = "interrupted"  # nbdist released it (another rank failed, or Ctrl-C)
    TIMEOUT = "timeout"  # released by --timeout or the watchdog
    DEAD = "dead"  # its process died, or nbdist killed it after it would not stop


class RankState(_Text):
    """What a rank is doing now (world/board.py keeps each rank's)."""

    IDLE = "idle"  # waiting for a cell; its last one (if any) succeeded
    BUSY = "busy"  # running a cell
    DEBUGGING = "debugging"  # stopped at its debugger's prompt in a cell (breakpoint())
    FAILED = "failed"  # its last cell raised; it waits for the next one
    EXITED = "exited"  # its last cell's code exited (exit(), sys.exit()); the rank is up and waits
    RESTARTING = "restarting"  # its engine is being replaced (a restart, or automatic recovery)
    DEAD = "dead"  # its process is gone


# The one vocabulary of a rank's state: its word (RankState), its colour, the phrase with its cell line, and how
# ranks are grouped above GROUP_ABOVE. The dashboard's chips, %dist_status, %dist_where and the world panel (served
# by server/worlds.py; js/src/panel.ts draws what it is given) all take them from here.
STATE_COLOURS: dict[str, str] = {
    RankState.IDLE.value: "#2e7d32",  # green: ready
    RankState.BUSY.value: "#1565c0",  # blue: working
    RankState.DEBUGGING.value: "#6a1b9a",  # purple: a person at its prompt
    RankState.FAILED.value: "#c62828",  # red: its cell raised
    RankState.EXITED.value: "#546e7a",  # blue-grey: its code exited, the rank is up
    RankState.RESTARTING.value: "#f9a825",  # amber: coming back
    RankState.DEAD.value: "#424242",  # dark grey: gone (restart it)
}
GROUP_ABOVE = 8  # ranks: up to this many, one entry per rank; above, one line per kind of rank


def state_phrase(state: str, line: int | None = None) -> str:
    """'busy at cell line 7', 'debugging at cell line 3', 'idle': a state as every view says it."""
    return f"{state} at cell line {line}" if line and state in (RankState.BUSY, RankState.DEBUGGING) else str(state)


def state_groups(states: dict[int, Any]) -> list[tuple[list[int], str]]:
    """The ranks by state, in rank order of each state's first rank: [([0, 1, 2], 'busy'), ([3], 'failed')]."""
    groups: dict[str, list[int]] = {}
    for rank, state in sorted(states.items()):
        groups.setdefault(str(state), []).append(rank)
    return [(ranks, state) for state, ranks in groups.items()]


def chips(states: dict[int, Any]) -> list[tuple[str, str, int | None]]:
    """The cell's dashboard's chips, (label, state, rank): one per rank up to GROUP_ABOVE ranks ('rank 3: busy'),
    above it one per state, as the panel groups them ('ranks 0-13,15: busy', rank None)."""
    if len(states) <= GROUP_ABOVE:
        return [(f"rank {rank}: {state}", str(state), rank) for rank, state in sorted(states.items())]
    return [(f"{ranks_text(ranks)}: {state}", state, None) for ranks, state in state_groups(states)]


def grouped(rows: Iterable[dict[str, Any]]) -> list[str]:
    """The ranks as one line per kind (state phrase and what they run on), each naming its hosts:
    'ranks 0-13,15: busy at cell line 7 on node1, node2 (cpu, gloo)'. A row: rank, state, line, host, device
    ('cpu', 'cuda:0'), and where known backend and gpu (its card's name first)."""
    kinds: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        card = str(row.get("gpu") or "").split(",")[0]
        kind = (str(row.get("device") or "").split(":")[0], card if card != "busy" else "", row.get("backend") or "")
        kinds.setdefault((state_phrase(row["state"], row.get("line")), ", ".join(x for x in kind if x)), []).append(row)
    lines = []
    for (phrase, what), members in kinds.items():
        hosts = sorted({m["host"] for m in members if m.get("host")})
        on = f" on {', '.join(hosts)}" if hosts else ""
        lines.append(f"{ranks_text([m['rank'] for m in members])}: {phrase}{on}" + (f" ({what})" if what else ""))
    return lines


class Release(_Text):
    """Why nbdist interrupted the ranks still running a cell."""

    FAILURE = "failure"
    TIMEOUT = "timeout"
    INTERRUPT = "interrupt"
    WATCHDOG = "watchdog"
    EXITED = "exited"

    @property
    def because(self) -> str:
        return {
            Release.FAILURE: "a rank failed",
            Release.TIMEOUT: "the cell ran past its timeout",
            Release.INTERRUPT: "of Ctrl-C",
            Release.WATCHDOG: "other ranks had finished the cell and it waited in a collective past the watchdog",
            Release.EXITED: "a rank's code had exited (exit(), quit() or sys.exit()) and it waited in a collective",
        }[self]


# The order in which failures are reported: the rank that raised is the cause, the others follow.
_BLAME = {RankStatus.ERROR: 0, RankStatus.DEAD: 1, RankStatus.TIMEOUT: 2, RankStatus.INTERRUPTED: 3}


@dataclass(slots=True)
class RankResult:
    """What one rank did with a cell."""

    rank: int
    engine_id: int
    status: RankStatus = RankStatus.PENDING
    stdout: str = ""
    stderr: str = ""
    outputs: list[dict[str, Any]] = field(default_factory=list)
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None  # ename, evalue, traceback, line (see remote_error)
    wall_s: float | None = None
    host: str = ""  # set when the rank runs on another host than the notebook
    exited: dict[str, Any] | None = None  # the cell's code exited here (engine/exits.py): status, line, code

    def __post_init__(self) -> None:
        self.status = RankStatus(self.status)

    def failure(self) -> Failure:
        """This rank's failure as RankError reports it."""
        err = self.error or {}
        ename, evalue = err.get("ename", str(self.status)), err.get("evalue", "")
        line = err.get("line")
        where = f" in {err['where']}" if err.get("where") else (f" in cell line {line}" if line else "")
        who = f"rank {self.rank}" + (f" (on {self.host})" if self.host else "")
        summary = {
            RankStatus.DEAD: f"{who} died while running the cell (its process ended: killed, out of memory or crashed)",
            RankStatus.INTERRUPTED: f"{who} was interrupted{where}",
            RankStatus.TIMEOUT: f"{who} did not finish in time{where}",
        }.get(self.status, f"{who} raised {ename}{where}: {mismatch(evalue) or evalue}")
        return Failure(
            rank=self.rank,
            engine_id=self.engine_id,
            status=str(self.status),
            ename=ename,
            evalue=evalue,
            line=line,
            traceback=[ANSI.sub("", text) for text in err.get("traceback", [])],
            summary=summary,
        )

    def __repr__(self) -> str:
        """One line: the rank, how it ended, its time, and its error's first line or how much it printed."""
        took = f", {self.wall_s:.2f} s" if self.wall_s is not None else ""
        if self.error:
            first = ANSI.sub("", str(self.error.get("evalue") or "")).strip().splitlines()
            where = f" (cell line {self.error['line']})" if self.error.get("line") else ""
            return f"rank {self.rank}: {self.status}{took}, {self.error.get('ename')}: {first[0][:120] if first else ''}{where}"
        lines = len(self.stdout.splitlines()) + len(self.stderr.splitlines())
        if self.exited is not None:
            at = f" at cell line {self.exited['line']}" if self.exited.get("line") else ""
            return f"rank {self.rank}: {self.status}{took}, exited with status {self.exited['status']}{at}"
        return f"rank {self.rank}: {self.status}{took}, {lines} line(s) of output"

    def text(self) -> str:
        """Everything this rank printed, then its traceback, without terminal colours."""
        parts = [self.stdout, self.stderr, *(ANSI.sub("", t) for t in (self.error or {}).get("traceback", []))]
        return "\n".join(p.rstrip("\n") for p in parts if p)

    def broke_the_world(self) -> bool:
        """Did this rank's error come from a broken process group?"""
        return bool(self.error and _DIST_ERROR.search(self.error.get("evalue") or ""))


@dataclass(slots=True)
class RunResult:
    """Per-rank results of one cell, plus what nbdist did about failures."""

    ranks: list[RankResult]
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    released: Release | None = None  # why ranks were interrupted, if they were
    reports: dict[int, dict[str, Any]] = field(default_factory=dict)  # where each released rank waited
    # nbdist.log rows by rank: all of a short cell's; a long one's thinned (cells/rows.py), the last 1,000 exact
    metrics: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    checkpoint: dict[str, Any] | None = None  # the cell's last save_checkpoint: path, variable names
    recovered: list[str] = field(default_factory=list)  # what automatic recovery did, a line each time

    def __post_init__(self) -> None:
        if self.released is not None:
            self.released = Release(self.released)

    @property
    def ok(self) -> bool:
        return all(r.status == RankStatus.OK for r in self.ranks)

    @property
    def exited(self) -> dict[int, int]:
        """The ranks whose code exited in this cell (exit(), quit(), sys.exit()), with each one's status."""
        return {r.rank: int(r.exited["status"]) for r in self.ranks if r.exited is not None}

    @property
    def failed(self) -> list[RankResult]:
        return [r for r in self.ranks if r.status != RankStatus.OK]

    def __repr__(self) -> str:
        """A line for the cell and a line per rank; ``show()`` prints each rank's whole text."""
        failed = [r.rank for r in self.failed]
        head = f"RunResult({len(self.ranks)} rank(s), {self.wall_s:.2f} s, " + (
            f"not ok on rank(s) {', '.join(map(str, failed))})" if failed else "ok)"
        )
        return "\n".join([head, *(f"  {r!r}" for r in self.ranks)])

    def show(self) -> None:
        """Print each rank's whole output and traceback (ANSI colours removed), then the notes."""
        for r in self.ranks:
            print(f"---- {r!r}")
            if r.text():
                print(r.text())
        for note in self.notes:
            print(note)

    def __getitem__(self, rank: int) -> RankResult:
        for r in self.ranks:
            if r.rank == rank:
                return r
        raise KeyError(f"rank {rank} did not run this cell; it ran on ranks {[r.rank for r in self.ranks]}.")

    def raise_for_error(self) -> RunResult:
        """Raise RankError (RunTimeout for a timeout) if any rank did not finish cleanly."""
        if self.ok:
            return self
        failed = sorted(self.failed, key=lambda r: (_BLAME.get(r.status, 9), r.rank))
        failures = [r.failure() for r in failed]
        message = "\n".join(_folded(f.summary for f in failures))
        cls = RunTimeout if self.released in (Release.TIMEOUT, Release.WATCHDOG) else RankError
        raise cls(message, failures=failures, notes=self.notes)

    def explain(self) -> None:
        """Add the notes a user needs: diverged state, and where each released rank waited."""
        errored = [r.rank for r in self.ranks if r.status == RankStatus.ERROR]
        ok = [r.rank for r in self.ranks if r.status == RankStatus.OK]
        if errored and ok:
            self.notes.append(
                f"note: rank(s) {', '.join(map(str, ok))} finished this cell, so state on the ranks may now differ: "
                "fix the cell and run it again (on every rank), or %dist_restart for fresh ranks."
            )
        if self.released is None:
            return
        odd = odd_ranks(self.reports)
        waited = []
        for rank, rep in sorted(self.reports.items()):
            if rep.get("busy"):
                where = f"cell line {rep['cell_line']}" if rep.get("cell_line") else "library code"
                waiting = " (inside torch.distributed)" if rep.get("in_collective") else ""
                last = collective_text(rep)
                waited.append(
                    f"rank {rank} was at {where}, in {rep.get('function')}{waiting}, "
                    f"when released because {self.released.because}."
                    + (f" Last collective: {last}." if last else "")
                    + (f" <-- {odd[rank]}" if rank in odd else "")
                )
        self.notes += _folded(waited)


_WHO = re.compile(r"^rank (\d+)(?: \(engine \d+[^)]*\))? was (.*)$", re.S)


def _folded(lines: Iterable[str]) -> list[str]:
    """'rank N ... was X' lines that say the same X of several ranks, as one: 'ranks 1-15 were X'.
    Other lines, and an X said of one rank, stay as they are (in their first one's place)."""
    lines = list(lines)
    groups: dict[str, list[int]] = {}
    for line in lines:
        found = _WHO.match(line)
        if found:
            groups.setdefault(found.group(2), []).append(int(found.group(1)))
    out, done = [], set()
    for line in lines:
        found = _WHO.match(line)
        if not found or len(groups[found.group(2)]) == 1:
            out.append(line)
        elif found.group(2) not in done:
            done.add(found.group(2))
            out.append(f"{ranks_text(groups[found.group(2)])} were {found.group(2)}")
    return out


def mismatch(evalue: str) -> str:
    """torch's 'Detected mismatch between collectives' in one line naming both ranks and both calls; '' otherwise."""
    calls = _MISMATCH.findall(evalue or "")
    if "mismatch between collectives" not in (evalue or "") or len(calls) < 2:
        return ""
    text = [
        f"rank {r} called {op.lower()}({f'[{shape}]' if shape else ''}{' ' + dt.lower() if dt else ''}) as its collective #{int(seq) + 1}"
        for r, seq, op, shape, dt in calls[:2]
    ]
    return (
        f"ranks called different collectives: {text[0]}, but {text[1]}. Every rank must call the same "
        "collectives, with the same shapes, in the same order (--debug-collectives caught it)."
    )


def remote_error(exc: BaseException) -> dict[str, Any]:
    """ename, evalue, traceback (lines) and the cell line of an error an engine reported."""
    ename = getattr(exc, "ename", None) or type(exc).__name__
    evalue = getattr(exc, "evalue", None)
    if evalue is None:
        evalue = str(exc)
    tb = getattr(exc, "traceback", None)
    lines = tb.splitlines() if isinstance(tb, str) else list(tb or [])
    line = None
    for text in lines:
        m = _CELL_LINE.search(ANSI.sub("", text))
        if m:
            line = int(m.group(1))
    out = {"ename": ename, "evalue": str(evalue), "traceback": lines, "line": line}
    return _script_frames(out)


def _script_frames(error: dict[str, Any]) -> dict[str, Any]:
    """A %dist_run script's error: its own frames from the script's first on, and where in the script."""
    lines = error["traceback"]
    plain = [ANSI.sub("", text) for text in lines]
    runner = next((i for i, text in enumerate(plain) if _SCRIPT_RUNNER.search(text)), None)
    if runner is None:
        return error
    start = next((j for j in range(runner + 1, len(plain)) if _FILE_LINE.match(plain[j])), None)
    if start is None:  # raised by the runner itself (the script's sys.exit status)
        return {**error, "traceback": lines[:2] + lines[runner:], "line": None}
    script = _FILE_LINE.match(plain[start]).group(1)  # type: ignore[union-attr]
    deepest = [m.group(2) for text in plain[start:] if (m := _FILE_LINE.match(text)) and m.group(1) == script]
    name = script.rsplit("/", 1)[-1]
    return {**error, "traceback": lines[:2] + lines[start:], "line": None, "where": f"{name} line {deepest[-1]}"}


def classify(error: dict[str, Any], released: Release | None) -> RankStatus:
    """How a rank that reported this error ended the cell."""
    if error["ename"] == "EngineError":  # ipyparallel's word for an engine that died
        return RankStatus.DEAD
    if error["ename"] == "KeyboardInterrupt" or (released and _DIST_ERROR.search(error["evalue"] or "")):
        return RankStatus.TIMEOUT if released in (Release.TIMEOUT, Release.WATCHDOG) else RankStatus.INTERRUPTED
    return RankStatus.ERROR
