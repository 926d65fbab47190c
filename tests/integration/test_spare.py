"""The spare engine a recovering world keeps (nbdist/world/spare.py; docs/faults.md row 115), on real 2-rank worlds.

* a rank killed mid-training is replaced by the spare that registered before the kill (no engine started during the
  recovery), the cell goes on from the living rank's memory, and a new spare follows before the next cell; the
  spare's process ends with the world;
* a spare whose process ended is not taken: the recovery starts an engine as it did before spares, and recovers;
* a world that does not recover by itself, or runs with NBDIST_SPARE=0, keeps none.

The recovery's figures, with and without the spare in the same run: benchmarks/recovery_scale.py --spare both.
Time bounds only catch hangs.
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

import nbdist
from tests.helpers import poll

HANG_S = 90.0

SETUP = """
import os, torch
from nbdist.parallel import apply_ddp, shard
torch.manual_seed(0)
model = apply_ddp(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.5)
_g = torch.Generator().manual_seed(1)
X = torch.randn(256, 8, generator=_g)
loader = shard(torch.utils.data.TensorDataset(X, X.sum(1, keepdim=True)), batch_size=8, seed=2)
"""
TRAIN = """
for step, (x, y) in loader.steps(30):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    if step == 12 and dist.get_rank() == 1 and not os.path.exists(MARK):
        open(MARK, "w").close()
        os.kill(os.getpid(), 9)
final = torch.cat([p.detach().flatten() for p in model.parameters()])
"""


def _spares(c, gone: set[int] = frozenset()) -> list[int]:
    """The engines the controller knows that are no rank's, but ``gone`` (dead ranks' engines: the controller lets
    one go when its heartbeats stop, after the recovery)."""
    return sorted(set(c.engines.client.ids) - {r.engine_id for r in c.engines.ranks} - gone)


def _registered_spare(c, gone: set[int] = frozenset()) -> int:
    def one_spare():
        """a spare engine registered with the controller"""
        found = _spares(c, gone)
        return found[0] if len(found) == 1 else None

    return poll(one_spare, within=HANG_S)


def test_a_killed_rank_takes_the_spare_registered_before_it_died_and_a_new_spare_follows(tmp_path):
    with nbdist.start(2, max_restarts=2, timeout=90) as c:
        c.run(f"MARK = {str(tmp_path / 'mark')!r}\n" + SETUP, setup=True).raise_for_error()
        spare = _registered_spare(c)
        spare_pid = c.engines.client[spare].apply_sync(os.getpid)
        assert spare_pid not in {r.pid for r in c.engines.ranks}

        gone = {r.engine_id for r in c.engines.ranks}
        result = c.run(TRAIN)  # rank 1 kills itself at step 12; the cell goes on by itself
        assert result.ok, (result, result.notes)
        assert (tmp_path / "mark").exists()
        line = result.recovered[0]
        assert "restarted rank(s) 1" in line and "rebuilt step 13 from rank 0's memory" in line, line
        # rank 1 is now the engine that had registered before the kill: the recovery started none
        assert c.engines.ranks[1].engine_id == spare and c.engines.ranks[1].pid == spare_pid
        assert c.engines.spare.taken == [spare]
        final = c.pull("final")
        assert final[0].equal(final[1])  # DDP kept the two ranks alike through the recovery

        c.run("x = 1").raise_for_error()  # a new spare is started before the next cell
        follower = _registered_spare(c, gone)
        assert follower != spare
        follower_pid = c.engines.client[follower].apply_sync(os.getpid)
    poll(lambda: not psutil.pid_exists(follower_pid), within=30)  # it ends with the world


def test_a_spare_whose_process_ended_is_not_taken_and_the_recovery_starts_an_engine(tmp_path):
    with nbdist.start(2, max_restarts=1, timeout=90) as c:
        c.run(f"MARK = {str(tmp_path / 'mark')!r}\n" + SETUP, setup=True).raise_for_error()
        spare = _registered_spare(c)
        os.kill(c.engines.client[spare].apply_sync(os.getpid), signal.SIGKILL)

        result = c.run(TRAIN)
        assert result.ok, (result, result.notes)
        assert "restarted rank(s) 1" in result.recovered[0], result.recovered
        assert c.engines.ranks[1].engine_id != spare and c.engines.spare.taken == []
        final = c.pull("final")
        assert final[0].equal(final[1])


@pytest.mark.parametrize("way", ["no automatic recovery", "NBDIST_SPARE=0"])
def test_a_world_that_does_not_recover_by_itself_or_turns_it_off_keeps_no_spare(way, monkeypatch):
    if way == "NBDIST_SPARE=0":
        monkeypatch.setenv("NBDIST_SPARE", "0")
    with nbdist.start(2, max_restarts=0 if way == "no automatic recovery" else 1, timeout=90) as c:
        for _ in range(2):
            c.run("x = 1").raise_for_error()
        time.sleep(1.0)  # a spare started would have registered by now (about 0.3 s here)
        assert _spares(c) == [] and c.engines.spare.key is None
