"""A cell sent as one request that the controller's broadcast schedulers hand to each engine (cells/run.py's
``BROADCAST_FROM``) is the cell sent to each engine by the notebook: the same lines, folded the same way, the same
result, each rank's failure its own, a killed rank named, and nothing of a finished cell kept in the notebook's client.
A real 3-rank world with a real gloo group; the reference is the same cells sent the direct way on the same world.
HANG_S only catches a hang."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import threading

import pytest

import nbdist
from nbdist import compat
from nbdist.cells import run as cellrun
from nbdist.errors import RankError
from tests.helpers import poll

HANG_S = 60.0
CELLS = [
    "print('the same on every rank')",
    "import sys\nprint(f'rank {dist.get_rank()} of {dist.get_world_size()}')\nprint('a warning', file=sys.stderr)",
    "t = torch.ones(2) * (dist.get_rank() + 1)\ndist.all_reduce(t)\nprint(t.tolist())",
    "import time\nfor i in range(3):\n    print('line', i, flush=True)\n    time.sleep(0.05)",
    "from IPython.display import display\ndisplay({'text/plain': f'shown by {dist.get_rank()}'}, raw=True)",
]


@pytest.fixture(scope="module")
def world():
    c = nbdist.start(n=3, oversubscribe=True, timeout=120)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def sent(monkeypatch):
    """Every cell of the test goes out as one broadcast request; the list of the cells that did."""
    monkeypatch.setattr(cellrun, "BROADCAST_FROM", 1)
    went: list[str] = []
    real = compat.execute_heard_broadcast

    def spy(view, code, heard):
        went.append(code)
        return real(view, code, heard)

    monkeypatch.setattr(compat, "execute_heard_broadcast", spy)
    return went


def shown(cluster, code: str, each: bool = False) -> tuple[str, bool, str]:
    """What the notebook shows of a cell (stdout and stderr, in order), whether it succeeded, and its error's text."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        result = cluster.run(code, each=each)
    error = ""
    if not result.ok:
        try:
            result.raise_for_error()
        except RankError as exc:
            error = str(exc)
    # each rank's (or folded ranks') lines in their own order; different ranks' lines interleave as they arrive
    text = "".join(sorted(out.getvalue().splitlines(keepends=True), key=lambda line: line.split("]", 1)[0]))
    return text, result.ok, error


def test_a_broadcast_cell_shows_what_a_direct_cell_shows_folded_and_each(world, sent):
    cellrun.BROADCAST_FROM = 10**9  # the reference, sent to each engine (the fixture's monkeypatch restores it)
    direct = [shown(world, code, each) for code in CELLS for each in (False, True)]
    assert sent == []
    cellrun.BROADCAST_FROM = 1
    broadcast = [shown(world, code, each) for code in CELLS for each in (False, True)]
    assert len(sent) == 2 * len(CELLS)  # every one of them went out as one request
    assert broadcast == direct
    assert broadcast[0][0].count("the same on every rank") == 1, broadcast[0][0]  # folded
    assert all(f"shown by {r}" in broadcast[-1][0] for r in range(3)), broadcast[-1][0]


def test_a_rank_that_raises_in_a_broadcast_cell_is_named_as_in_a_direct_one(world, sent):
    code = "if dist.get_rank() == 1:\n    raise ValueError('only rank 1')\nok = True"
    said = shown(world, code)
    assert sent == [code]
    assert not said[1] and "rank 1" in said[2] and "ValueError" in said[2] and "only rank 1" in said[2], said
    assert world.pull("ok", ranks=[0, 2]) == [True, True]
    cellrun.BROADCAST_FROM = 10**9  # the monkeypatch restores it after the test: the reference, sent directly
    world.run("globals().pop('ok', None)").raise_for_error()
    direct = shown(world, code)
    assert said == direct


def sleeps_then_all_reduces(flag) -> str:
    """Cell code: each rank marks that it started (``flag`` + its rank), sleeps 1 s, then all-reduces."""
    return (
        "import os, time\n"
        f"open({str(flag)!r} + str(dist.get_rank()), 'w').close()\n"
        "t = torch.ones(1)\n"
        "time.sleep(1.0)\n"
        "dist.all_reduce(t)"
    )


def kill_once_started(flag, pid: int, ranks: int = 3) -> threading.Thread:
    """A thread that SIGKILLs ``pid`` once every rank marked that it started (``sleeps_then_all_reduces``)."""

    def kill() -> None:
        for _ in range(600):
            if all(os.path.exists(f"{flag}{r}") for r in range(ranks)):
                os.kill(pid, signal.SIGKILL)
                return
            threading.Event().wait(0.01)

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    return killer


def works_again(world) -> None:
    """The world's all-reduce gives 1+2+3 on each of its 3 ranks."""
    world.run("t = torch.ones(1) * (dist.get_rank() + 1)\ndist.all_reduce(t)\nproof = t.item()").raise_for_error()
    assert world.pull("proof") == [6.0, 6.0, 6.0]


def nothing_pending(futures):
    def pending() -> bool:
        """the dead rank's request failed with its engine (the hub's word on it may come after the restart)"""
        return not [msg_id for msg_id, future in list(futures.items()) if not future.done()]

    return pending


def as_before(client):
    """A check that the client's caches are as long as now and nothing is outstanding (after cells that end)."""
    caches = (client.results, client._futures, client._output_futures, client.metadata)  # noqa: SLF001
    before = [len(c) for c in caches]

    def same() -> bool:
        """each rank's future and output left the caches with its cell (the client's IO thread drops the last)"""
        return [len(c) for c in caches] == before and len(client.outstanding) == 0

    return same


def test_a_rank_killed_during_a_broadcast_cell_fails_the_cell_naming_it_and_is_restarted(world, sent, tmp_path):
    flag = tmp_path / "started"
    code = sleeps_then_all_reduces(flag)
    futures = world.client._futures  # noqa: SLF001
    killer = kill_once_started(flag, world.ranks[2].pid)
    result = world.run(code, timeout=HANG_S)
    killer.join(timeout=HANG_S)
    assert sent == [code]
    assert not result.ok
    with pytest.raises(RankError) as err:
        result.raise_for_error()
    assert "rank 2" in str(err.value) and "died" in str(err.value), str(err.value)
    world.restart([2])
    works_again(world)
    poll(nothing_pending(futures), within=HANG_S)


def test_a_finished_broadcast_cell_leaves_nothing_in_the_notebooks_client(world, sent):
    client = world.client
    world.run("x = 1").raise_for_error()  # the views and their sockets made
    assert len(client.outstanding) == 0
    unchanged = as_before(client)
    for i in range(10):
        world.run(f"print('cell {i}')\nx = {i}").raise_for_error()
    assert len(sent) == 11
    poll(unchanged, within=HANG_S)
    assert world.pull("x") == [9, 9, 9]
