"""A rank's death during a cell is seen from its process the moment it ends (launch/exits.py: the kernel tells the
cell through a pidfd), and the dead rank's replacement re-forms the group in three calls to the ranks
(world/rendezvous.py, ``rejoin``), on a real 2-rank world that recovers by itself. Issue 52: the first was 0.04-0.16 s
of a recovery's 0.6 s at 8 ranks (the cell looked at /proc every 0.1 s), the second two round trips (0.04 s).

The cell's periodic /proc look is turned off here (DEATH_CHECK_S), so only the kernel's word can tell the cell that
the rank's process ended. ipyparallel's nanny tells the controller too, and the rank's reply then says it died; but
a reply alone is a failure, which the release policy gives ``grace`` (1 s) before it releases the others, and that
release is not the one a death gets: the death's release breaks the process group at once, and says so in the world's
BREAK_NOW file (world/reports.py, ``break_now``). That file is what this test reads. Time bounds only catch hangs.
"""

from __future__ import annotations

import os

import pytest

import nbdist
from nbdist import wire
from nbdist.cells import watch
from nbdist.cells.output import Sink
from nbdist.launch.exits import EXITS
from nbdist.world import engineset

HANG_S = 120.0

pytestmark = pytest.mark.skipif(not EXITS.works, reason="this kernel has no pidfd_open (Linux 5.3 or later)")

# Rank 0 waits outside any collective while rank 1 dies, so only a release can stop it. In a collective, gloo's own
# error ("connection closed by peer") could end rank 0's cell before the watch looked, and a cell whose ranks have
# all ended releases nobody (CI saw that once, on a loaded machine). Each rank reads MARK before the barrier: both
# agree on whether this is the first run.
CELL = """
import os, signal, time
first = not os.path.exists(MARK)
dist.barrier()
if first and dist.get_rank() == 1:
    open(MARK, "w").close()
    os.kill(os.getpid(), signal.SIGKILL)
if first and dist.get_rank() == 0:
    time.sleep(HANG_S)  # only the release ends this
dist.barrier()
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
"""


def test_a_rank_killed_in_a_cell_is_released_as_a_death_and_its_replacement_joins_in_three_calls(
    monkeypatch, tmp_path
):
    monkeypatch.setattr(watch, "DEATH_CHECK_S", 1e9)  # no periodic look at /proc: only the kernel's word is left
    calls: list[str] = []
    original = engineset.EngineSet.call_each

    def counted(self, each, **kwargs):
        calls.append(sorted({fn.__name__ for fn, _, _ in each.values()})[0])
        return original(self, each, **kwargs)

    with nbdist.start(2, max_restarts=1, timeout=90, progress=lambda s: None) as c:
        pids = [r.pid for r in c.engines.ranks]
        port = c.membership.world.master_port
        breaks = os.path.join(c.engines.workdir, wire.BREAK_NOW)
        assert not os.path.exists(breaks)
        monkeypatch.setattr(engineset.EngineSet, "call_each", counted)
        result = c.run(f"MARK = {str(tmp_path / 'killed')!r}\nHANG_S = {HANG_S / 2}\n" + CELL, sink=Sink(), timeout=HANG_S)
        monkeypatch.setattr(engineset.EngineSet, "call_each", original)
        assert result.ok, result
        assert any("rank(s) 1 died during the cell" in line for line in result.recovered), result.recovered
        assert os.path.exists(breaks), "the release was not a death's: the cell never saw the process end"
        assert "leave_then" in calls, calls
        forming = calls[calls.index("leave_then") : calls.index("join_world") + 1]
        assert forming == ["leave_then", "configure", "join_world"], calls
        assert c.membership.world.master_port == port  # rank 0's store, kept
        assert c.engines.ranks[0].pid == pids[0] and c.engines.ranks[1].pid != pids[1]
        assert [float(t) for t in c.pull("t")] == [3.0, 3.0]
