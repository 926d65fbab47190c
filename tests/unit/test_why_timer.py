"""engine/why.py's Timer in this process (a world of one, DDP over gloo): it finds the loop's top modules with
torch's global hooks, then hooks only those; what it times stays right, and a model copied or saved meanwhile is
unharmed. The verdicts on real ranks: tests/integration/test_why.py."""

from __future__ import annotations

import copy
import io

import torch
from torch import nn

from nbdist import compat
from nbdist.engine import metrics, why


def test_after_the_first_steps_only_the_top_modules_are_hooked_and_an_evaluation_is_still_timed(monkeypatch):
    torch.manual_seed(0)
    calls = [0]  # the Timer's forward pre-hook, called for each module it hooks
    pre = vars(why.Timer)["_pre"]

    def counted(self, module, args):
        calls[0] += 1
        return pre(self, module, args)

    monkeypatch.setattr(why.Timer, "_pre", counted)
    with compat.world_of_one():
        net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        model = nn.parallel.DistributedDataParallel(net)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y, val = torch.randn(32, 8), torch.randn(32, 1), torch.randn(4096, 8)
        metrics.flush()
        seen = len(metrics.local_rows())
        why.begin()
        per_step, copies = [], []
        try:
            for step in range(6):
                calls[0] = 0
                loss = nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                net.eval()  # an evaluation inside the loop, with the inner model called at the top
                with torch.no_grad():
                    net(val)
                net.train()
                if step == 4:
                    with torch.no_grad():
                        expected = net(x)
                    copies.append(copy.deepcopy(model))  # an EMA-style copy while hooked
                    saved = io.BytesIO()
                    torch.save(net, saved)  # the whole module pickled while hooked
                per_step.append(calls[0])
                opt.step()
        finally:
            steps = why.end()
        assert steps == 6
        # finding (FIND_STEPS = 2): DDP, the Sequential in it and its 3 layers, then the evaluation's Sequential and
        # its 3 layers; then only the two found at the top: DDP, and the Sequential (inside DDP, and for the
        # evaluation; step 4 calls it once more, for ``expected``)
        assert why.FIND_STEPS == 2 and per_step == [9, 9, 3, 3, 4, 3], per_step
        calls[0] = 0
        model(x), net(val), copies[0](x)
        assert calls[0] == 0, "nothing is hooked once the timer ends (a copy's hooks do nothing)"
        metrics.flush()  # outside an engine the rows stay in this process
        rows = [r for r in metrics.local_rows()[seen:] if "why/step_s" in r]
        assert len(rows) == 6
        assert all(r["why/eval_s"] > 0 and r["why/forward_s"] > 0 for r in rows), rows
        saved.seek(0)
        loaded = torch.load(saved, weights_only=False)
        with torch.no_grad():
            assert torch.equal(loaded(x), expected)
            assert torch.equal(copies[0](x), expected)


def test_ddps_split_of_backward_is_read_on_the_first_steps_then_every_few():
    torch.manual_seed(0)
    with compat.world_of_one():
        model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = torch.randn(32, 8), torch.randn(32, 1)
        metrics.flush()
        seen = len(metrics.local_rows())
        why.begin()
        try:
            for _ in range(17):
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
        finally:
            why.end()
        metrics.flush()
        rows = [r for r in metrics.local_rows()[seen:] if "why/step_s" in r]
    split = [i for i, r in enumerate(rows) if "why/exposed_s" in r]
    assert (why.DDP_ALL, why.DDP_EVERY) == (8, 4) and split == [0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 16], split
    assert all(0 < rows[i]["why/backward_compute_s"] and 0 <= rows[i]["why/exposed_s"] for i in split), rows
