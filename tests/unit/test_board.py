"""The board of rank states (world/board.py): one change is one event, in order, to every listener."""

from __future__ import annotations

import threading

from nbdist.results import RankState
from nbdist.world.board import Board, RankNow


def heard(board: Board) -> list[tuple[int, str, str, int | None]]:
    events: list[tuple[int, str, str, int | None]] = []
    board.subscribe(lambda now: events.append((now.rank, str(now.state), now.cell, now.line)))
    return events


def test_a_change_is_one_event_and_the_same_state_again_is_none():
    board = Board()
    events = heard(board)
    board.reset([0, 1])
    board.set([0, 1], RankState.BUSY, cell="train(model)")
    board.set([0], RankState.BUSY)  # no news
    board.set([1], RankState.FAILED)
    board.set([0], RankState.IDLE)
    assert events == [
        (0, "idle", "", None),
        (1, "idle", "", None),
        (0, "busy", "train(model)", None),
        (1, "busy", "train(model)", None),
        (1, "failed", "train(model)", None),  # the cell it failed in stays named
        (0, "idle", "train(model)", None),
    ]
    assert {r: str(n.state) for r, n in board.get().items()} == {0: "idle", 1: "failed"}


def test_a_busy_ranks_line_comes_from_reports_and_stays_until_it_moves():
    board = Board()
    board.reset([0, 1])
    board.set([0, 1], RankState.BUSY, cell="loop()")
    events = heard(board)
    board.reported({0: (False, 12), 1: (False, 12)})
    since = board.get()[0].since
    board.reported({0: (False, 12)})  # the same line: no event
    board.set([0], RankState.BUSY)  # busy again without a line: the known line stays
    assert board.get()[0].line == 12 and board.get()[0].since == since
    board.reported({0: (False, 14)})
    board.set([1], RankState.IDLE)
    board.reported({1: (True, 3)})  # a rank out of its cell: its late report changes nothing
    assert events == [(0, "busy", "loop()", 12), (1, "busy", "loop()", 12), (0, "busy", "loop()", 14),
                      (1, "idle", "loop()", None)]
    assert board.get()[0].since == since  # the line moved; the rank has been busy since the cell began
    board.reported({0: (True, 15)})
    board.reported({0: (False, 16)})  # it left its debugger
    assert events[-2:] == [(0, "debugging", "loop()", 15), (0, "busy", "loop()", 16)]


def test_a_listener_that_raises_is_dropped_and_the_others_still_hear(caplog):
    board = Board()
    events = heard(board)

    def broken(now: RankNow) -> None:
        raise RuntimeError("widget gone")

    board.subscribe(broken)
    later = heard(board)
    board.reset([0])
    board.set([0], RankState.BUSY)
    assert len(events) == 2 and len(later) == 2
    assert "listener raised" in caplog.text and caplog.text.count("listener raised") == 1


def test_unsubscribe_and_reset_to_a_smaller_world():
    board = Board()
    events: list[RankNow] = []
    stop = board.subscribe(events.append)
    board.reset([0, 1, 2])
    stop()
    stop()  # twice is harmless
    board.set([0], RankState.DEAD)
    assert len(events) == 3
    board.reset([0, 1], RankState.RESTARTING)
    assert {r: str(n.state) for r, n in board.get().items()} == {0: "restarting", 1: "restarting"}


def test_writers_on_several_threads_lose_no_change():
    board = Board()
    board.reset(list(range(8)))
    count = [0]
    lock = threading.Lock()

    def listen(now: RankNow) -> None:
        with lock:
            count[0] += 1

    board.subscribe(listen)

    def flip(rank: int) -> None:
        for i in range(200):
            board.set([rank], RankState.BUSY if i % 2 == 0 else RankState.IDLE)

    threads = [threading.Thread(target=flip, args=(r,)) for r in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert count[0] == 8 * 200
    assert all(n.state == RankState.IDLE for n in board.get().values())


def test_the_line_a_ranks_debugger_stopped_at_is_read_from_what_pdb_printed():
    from nbdist.cells.watch import _pdb_line

    text = "> /tmp/ipykernel_4242/2716.py(3)<module>()\n-> nbdist.breakpoint(rank=1)\n"
    assert _pdb_line(text) == 3
    assert _pdb_line("> /x/a.py(7)f()\n-> y = 1\n> /x/a.py(9)f()\n-> z = 2\n") == 9  # the last stop
    assert _pdb_line("*** NameError: name 'q' is not defined\n") is None
