"""world/published.py: each rank's state and place as a file the panel reads while the kernel is busy."""

from __future__ import annotations

import json
import os
import stat
import threading
import time

from nbdist.results import RankState
from nbdist.world import published
from nbdist.world.board import Board
from nbdist.world.engineset import RankInfo
from tests.helpers import poll


def test_every_change_of_the_board_is_in_the_file_whole(tmp_path):
    board = Board()
    ranks = [RankInfo(0, 0, pid=11, host="a"), RankInfo(1, 1, pid=12, host="b", local=False, gpu=1)]
    pub = published.Published(str(tmp_path), board, lambda: ranks)
    board.subscribe(pub)
    board.reset([0, 1])
    board.set([0, 1], RankState.BUSY, cell="train()")
    board.reported({1: (True, 3)})
    pub.flush()  # written by a thread of its own, off the cell's path
    rows = published.read(str(tmp_path))
    assert [(r["rank"], r["state"], r["cell"], r["line"]) for r in rows] == [
        (0, "busy", "train()", None),
        (1, "debugging", "train()", 3),
    ]
    assert rows[0]["pid"] == 11 and rows[1]["pid"] == 0  # another host's pid is not shown as one of this host
    assert (rows[0]["device"], rows[1]["device"]) == ("cpu", "cuda:1")
    assert stat.S_IMODE(os.stat(tmp_path / published.FILE).st_mode) == 0o600
    # writers on two threads at once (the client's IO thread and the kernel's): the file is always whole
    stop = threading.Event()
    seen: list[int] = []

    def reader():
        while not stop.is_set():
            found = published.read(str(tmp_path))
            seen.append(len(found) if found is not None else -1)

    t = threading.Thread(target=reader)
    t.start()
    assert poll(lambda: seen, 10)  # the reader runs before the writers start (on busy cores it might not, after)
    writers = [
        threading.Thread(target=lambda s=s: [board.set([0], s) for _ in range(200)])
        for s in (RankState.IDLE, RankState.BUSY)
    ]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    pub.flush()
    stop.set()
    t.join()
    assert seen and set(seen) == {2}
    assert json.load(open(tmp_path / published.FILE))["ranks"][1]["state"] == "debugging"
    pub.close()


def test_a_burst_of_changes_is_a_few_writes_off_the_changing_thread(tmp_path, monkeypatch):
    """A cell's start sets 64 ranks busy, one change each: the file is written a few times, not 64, and never on
    the thread that changed the board (the kernel's, on the cell's path); close() writes the last change."""
    board = Board()
    pub = published.Published(str(tmp_path), board, lambda: [RankInfo(r, r) for r in range(64)])
    board.subscribe(pub)
    writes: list[str] = []
    real = pub.write
    monkeypatch.setattr(pub, "write", lambda: (writes.append(threading.current_thread().name), real()))
    board.reset(list(range(64)))
    board.set(list(range(64)), RankState.BUSY, cell="x = 1")
    pub.close()
    assert 1 <= len(writes) <= 8 and set(writes) == {"nbdist-published"}, writes
    assert {r["state"] for r in published.read(str(tmp_path))} == {"busy"}


def test_a_world_directory_gone_or_a_damaged_file(tmp_path):
    board = Board()
    pub = published.Published(str(tmp_path / "gone"), board, lambda: [RankInfo(0, 0)])
    pub.write()  # no error: nobody to show it to
    assert published.read(str(tmp_path / "gone")) is None
    (tmp_path / published.FILE).write_text("{not json")
    assert published.read(str(tmp_path)) is None


def test_writes_are_a_gap_apart_and_a_flush_writes_the_last_change_at_once(tmp_path, monkeypatch):
    """A cell's replies change the board one rank at a time: the writer writes at most once per GAP (it is not woken
    in between: a woken thread takes the GIL from the one handling the replies), and flush() writes what is pending
    without waiting out the gap."""
    board = Board()
    pub = published.Published(str(tmp_path), board, lambda: [RankInfo(r, r) for r in range(16)])
    board.subscribe(pub)
    at: list[float] = []
    real = pub.write
    monkeypatch.setattr(pub, "write", lambda: (at.append(time.monotonic()), real()))
    board.reset(list(range(16)))
    for k in range(40):  # 40 changes over about 0.4 s
        board.set([k % 16], RankState.BUSY if k % 2 else RankState.IDLE, cell=f"cell {k}")
        time.sleep(0.01)
    gaps = [b - a for a, b in zip(at, at[1:], strict=False)]
    assert all(g >= published.GAP * 0.99 for g in gaps), gaps
    assert 2 <= len(at) <= 1 + 0.5 / published.GAP + 1, at
    pub.flush()  # written now: the writer's gap begins
    board.set([3], RankState.DEBUGGING, cell="last")
    asked = time.monotonic()
    pub.flush()
    assert published.read(str(tmp_path))[3]["state"] == "debugging"
    assert at[-1] - asked < 0.8 * published.GAP, "flush waited out the gap"
    pub.close()
