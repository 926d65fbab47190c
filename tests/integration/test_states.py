"""Each rank's state as events (world/board.py) on a real 2-rank gloo world: what ``Cluster.states()``,
``%dist_status``, ``%dist_where`` and a cell's sink (the dashboard's rank line) read, and what a listener
hears, in order, while cells run, fail, exit, and ranks die and come back.

Time bounds here only catch a hang (``poll``'s ``within``)."""

from __future__ import annotations

import os
import signal
import textwrap

import psutil
import pytest

from nbdist.cells.output import Sink
from nbdist.results import RankState
from tests.helpers import poll, run_cell, wait_for, wait_for_file

BUSY, IDLE, FAILED = RankState.BUSY, RankState.IDLE, RankState.FAILED


@pytest.fixture
def heard(cluster):
    """(rank, state, line) of each change a listener hears from now on, in order."""
    events: list[tuple[int, str, int | None]] = []
    stop = cluster.subscribe(lambda now: events.append((now.rank, str(now.state), now.line)))
    yield events
    stop()


def of(events, rank):
    return [(state, line) for r, state, line in events if r == rank]


def test_a_noblock_cell_shows_busy_with_its_line_a_failed_rank_at_once_and_idle_after(cluster, ip, capsys, tmp_path,
                                                                                       heard):
    go, here = tmp_path / "go", tmp_path / "here"
    code = (
        "import os, time\n"
        "if dist.get_rank() == 1:\n"
        "    raise ValueError('rank 1 stops here')\n"
        f"open({str(here)!r}, 'w').close()\n"
        f"while not os.path.exists({str(go)!r}):\n"
        "    time.sleep(0.01)\n"
    )
    pending = cluster.run(code, block=False)
    wait_for(here)

    def rank1_failed():
        """rank 1's reply is on the board while nobody follows the cell"""
        return cluster.states()[1].state == FAILED

    poll(rank1_failed, 30, every=0.02)
    now = cluster.states(lines=True)
    assert now[0].state == BUSY and now[0].cell == "import os, time" and now[0].line in (5, 6), now
    rows = {r["rank"]: r for r in cluster.status()}
    assert (rows[0]["state"], rows[0]["cell"], rows[1]["state"]) == ("busy", "import os, time", "failed")
    run_cell(ip, "%dist_status")
    out = capsys.readouterr().out
    assert "busy at cell line" in out and "failed" in out, out
    go.touch()
    poll(lambda: cluster.states()[0].state == IDLE, 30, every=0.02)  # its reply, still uncollected
    result = pending.wait(show=False)
    assert [str(r.status) for r in result.ranks] == ["ok", "error"]
    assert {r: n.state for r, n in cluster.states().items()} == {0: IDLE, 1: IDLE}  # the cell is over
    assert of(heard, 1) == [("busy", None), ("failed", None), ("idle", None)]
    assert of(heard, 0)[0] == ("busy", None) and of(heard, 0)[-1] == ("idle", None)
    assert [s for s, line in of(heard, 0)] == ["busy", "busy", "idle"] and of(heard, 0)[1][1] in (5, 6)


class Badges(Sink):
    """What a cell's sink is told of each rank's state (the dashboard's rank line reads the same)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, str]] = []

    def state(self, rank: int, state: RankState) -> None:
        self.seen.append((rank, str(state)))


def test_an_exit_on_one_rank_is_its_state_in_the_cell_and_idle_after(cluster, heard):
    badges = Badges()
    result = cluster.run(
        "import time\nif dist.get_rank() == 1:\n    exit(0)\ntime.sleep(0.5)\n", sink=badges
    )
    assert result.ok and result.exited == {1: 0}
    assert (1, "exited") in badges.seen and (0, "idle") in badges.seen, badges.seen
    assert of(heard, 1) == [("busy", None), ("exited", None), ("idle", None)]
    assert of(heard, 0) == [("busy", None), ("idle", None)]


def test_a_rank_that_ends_its_part_early_is_told_to_the_sink_while_the_others_run(cluster, tmp_path):
    """Rank 1 ends its part once the sink was told it is busy; rank 0 waits (at most 30 s) for the file the sink makes
    when told rank 1 is idle: it can see it only if that state reached the sink while the cell still ran. Each waits
    for a file the sink makes, so nothing here depends on when the notebook first looks."""
    told_busy, told_idle = tmp_path / "rank-1-busy", tmp_path / "rank-1-idle"

    class Told(Badges):
        def state(self, rank: int, state: RankState) -> None:
            super().state(rank, state)
            if rank == 1:
                {BUSY: told_busy, IDLE: told_idle}.get(state, tmp_path / "other").touch()

    told = Told()
    waits = [textwrap.indent(wait_for_file(flag), "    ") for flag in (told_idle, told_busy)]
    cluster.run(f"if dist.get_rank() == 0:\n{waits[0]}else:\n{waits[1]}", sink=told).raise_for_error()
    assert cluster.pull("seen") == ["seen", "seen"], told.seen
    assert told.seen.index((1, "idle")) < told.seen.index((0, "idle")), told.seen


def test_a_rank_that_dies_between_cells_is_dead_then_restarting_then_idle(cluster, ip, capsys, heard):
    pid = cluster.engines.ranks[1].pid
    os.kill(pid, signal.SIGKILL)
    psutil.Process(pid).wait(10) if psutil.pid_exists(pid) else None
    assert cluster.states()[1].state == RankState.DEAD and cluster.states()[0].state == IDLE
    run_cell(ip, "%dist_where")
    out = capsys.readouterr().out
    assert "rank 1: dead (run %dist_restart)" in out, out
    cluster.restart([1])
    assert of(heard, 1) == [("dead", None), ("restarting", None), ("idle", None)]
    assert of(heard, 0) == []
    cluster.run("z = torch.ones(1)\ndist.all_reduce(z)\nproof = z.item()").raise_for_error()
    assert cluster.pull("proof") == [2.0, 2.0]


class Chips(Sink):
    """A cell's sink with the dashboard's chips (widgets/dashboard.py) drawn from what it is told, as in a notebook."""

    def __init__(self) -> None:
        from nbdist.results import STATE_COLOURS
        from nbdist.widgets.dashboard import Dashboard

        self.board = Dashboard(palette=STATE_COLOURS)
        self.heard = ""  # every strip the chips showed, in order
        self.shown = ""

    def state(self, rank: int, state: RankState) -> None:
        self.board.set_state(rank, state)
        self.shown += self.board.strip_html()
        self.heard += f"rank {rank}: {state}\n"


def test_the_dashboard_status_the_panel_and_the_states_say_the_same_at_the_same_moment(cluster, ip, capsys, tmp_path):
    """One vocabulary (results.py): rank 1 fails while rank 0 still runs its cell, and the four views say so in the
    same words and colours. The panel's rows are what its route serves (server/worlds.py), which js/src/panel.ts
    draws as given."""
    from nbdist.cells import pointers
    from nbdist.results import STATE_COLOURS
    from nbdist.server import worlds

    go, here = tmp_path / "go", tmp_path / "here"
    chips = Chips()
    pending = cluster.run(
        "import os, time\n"
        "if dist.get_rank() == 1:\n"
        "    raise ValueError('rank 1 stops here')\n"
        f"open({str(here)!r}, 'w').close()\n"
        f"while not os.path.exists({str(go)!r}):\n"
        "    time.sleep(0.01)\n",
        block=False,
        sink=chips,
    )
    try:
        wait_for(here)
        poll(lambda: cluster.states()[1].state == FAILED, 30, every=0.02)
        now = cluster.states(lines=True)  # the board, rank 0's line fresh
        line = now[0].line
        assert now[0].state == BUSY and line in (5, 6) and now[1].state == FAILED, now
        run_cell(ip, "%dist_status")
        status = capsys.readouterr().out
        pointers.point(cluster.membership.workdir, "states-kernel")
        cluster.engines.published.flush()  # the panel's file is written off the cell's path, moments after a change
        try:
            panel = {row["rank"]: row for row in worlds.world("states-kernel", "")["ranks"]}
        finally:
            pointers.unpoint(cluster.membership.workdir)
        said = {0: f"busy at cell line {line}", 1: "failed"}
        for rank, phrase in said.items():
            assert phrase in status, status
            assert panel[rank]["text"] == phrase, panel[rank]
            assert panel[rank]["colour"] == STATE_COLOURS[str(now[rank].state)]
    finally:
        go.touch()
        pending.wait()  # followed (shown), as a notebook follows it: the sink is told each rank's state
    # the chips of the cell's dashboard heard the same states, in the same colours, as the cell went
    html = chips.board.strip_html()
    assert "rank 1: failed" in chips.heard and f"background:{STATE_COLOURS['failed']}" in chips.shown, chips.heard
    # and once the cell is over, the chips say what the board (so %dist_status and the panel) says then
    final = {rank: str(now.state) for rank, now in cluster.states().items()}
    assert final == {0: "idle", 1: "idle"}, final
    for rank, state in final.items():
        assert f"rank {rank}: {state}" in html, html
