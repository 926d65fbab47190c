"""A rank's death during a cell is seen from its process the moment it ends (launch/exits.py: the kernel tells the
cell through a pidfd), and the rank's replacement re-forms the group in three calls to the ranks (world/rendezvous.py,
``rejoin``), on a real 2-rank world. Issue 52: the first was 0.04-0.16 s of a recovery's 0.6 s at 8 ranks (the cell
looked at /proc every 0.1 s), the second two round trips (0.04 s).

The cell's periodic /proc look is turned off here (DEATH_CHECK_S), so only the kernel's word can make the death
seen as the end of the rank's process: without it, the controller's heart monitor says the engine died, later and
in other words. Time bounds only catch hangs.
"""

from __future__ import annotations

import pytest

import nbdist
from nbdist.cells import watch
from nbdist.cells.output import Sink
from nbdist.launch.exits import EXITS
from nbdist.world import engineset

HANG_S = 120.0

pytestmark = pytest.mark.skipif(not EXITS.works, reason="this kernel has no pidfd_open (Linux 5.3 or later)")

CELL = """
import os, signal, time
dist.barrier()
if dist.get_rank() == 1:
    os.kill(os.getpid(), signal.SIGKILL)
for _ in range(1200):
    time.sleep(0.1)
"""


def test_a_rank_killed_in_a_cell_is_seen_as_its_process_ending_and_its_replacement_joins_in_three_calls(
    monkeypatch,
):
    monkeypatch.setattr(watch, "DEATH_CHECK_S", 1e9)  # no periodic look at /proc: only the kernel's word is left
    with nbdist.start(2, timeout=90, progress=lambda s: None) as c:
        pids = [r.pid for r in c.engines.ranks]
        result = c.run(CELL, sink=Sink(), timeout=HANG_S)
        assert not result.ok
        dead = result.ranks[1]
        assert dead.error["evalue"] == f"its process (pid {pids[1]}) ended", dead.error
        assert result.ranks[0].status.value != "dead", result.ranks[0].error  # released, not ended

        calls: list[str] = []
        original = engineset.EngineSet.call_each

        def counted(self, each, **kwargs):
            calls.append(sorted({fn.__name__ for fn, _, _ in each.values()})[0])
            return original(self, each, **kwargs)

        monkeypatch.setattr(engineset.EngineSet, "call_each", counted)
        port = c.membership.world.master_port
        c.restart([1])
        monkeypatch.setattr(engineset.EngineSet, "call_each", original)
        assert calls == ["leave_then", "configure", "join_world"], calls
        assert c.membership.world.master_port == port  # rank 0's store, kept
        assert c.engines.ranks[0].pid == pids[0] and c.engines.ranks[1].pid != pids[1]
        c.run("t = torch.ones(1) * (dist.get_rank() + 1)\ndist.all_reduce(t)", sink=Sink()).raise_for_error()
        assert [float(t) for t in c.pull("t")] == [3.0, 3.0]
