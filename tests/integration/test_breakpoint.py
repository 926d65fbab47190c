"""breakpoint() on a rank, typed into a real kernel's input box as JupyterLab does (jupyter_client answering
input requests), on a real 2-rank cluster: inspect, continue, quit, two ranks in turn, Ctrl-C, a timeout
that waits for the person; and %dist_debug (post-mortem) through the same input box.

Time bounds here catch hangs only."""

from __future__ import annotations

import glob
import json
import os
import time

import psutil
import pytest

from tests.helpers import Kernel, poll, wait_gone

START = """
%load_ext nbdist
%dist_start -n 2
import json, nbdist
print(json.dumps(nbdist.current().pids()))
"""

STOP_HERE = """%%distributed{options}
import nbdist
x = torch.ones(2) * (dist.get_rank() + 1)
secret = 40 + dist.get_rank()
nbdist.breakpoint(rank=0)
dist.all_reduce(x)
print("sum", x.tolist())
"""

ALL_REDUCE = """%%distributed
t = torch.ones(1)
dist.all_reduce(t)
print("world works", t.item())
"""


@pytest.fixture(scope="module")
def kernel():
    k = Kernel()
    pids: list[int] = []
    try:
        content, text, _ = k.run(START)
        assert content["status"] == "ok", text
        pids = json.loads(text.strip().splitlines()[-1])
        yield k
        k.run("%dist_stop")
    finally:
        k.close()
        assert wait_gone(pids, 30) == [], "the cluster outlived its test"


def lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines()]


def test_breakpoint_on_rank_0_inspect_then_continue_while_rank_1_waits_in_all_reduce(kernel):
    content, text, asked = kernel.run(STOP_HERE.format(options=""), ["p secret", "p x", "l", "c"])
    assert content["status"] == "ok", text
    assert asked == ["(Pdb rank 0) "] * 4, "only rank 0 stopped, and its prompt names it"
    assert "rank 0 stopped at a breakpoint" in text
    assert "-> nbdist.breakpoint(rank=0)" in text, "it stops on the breakpoint line itself"
    assert "40" in lines(text), "p secret: rank 0's own variable"
    assert "tensor([1., 1.])" in lines(text), "p x: rank 0's tensor before the all-reduce"
    assert "secret = 40 + dist.get_rank()" in text, "l shows the cell's own source"
    assert "[ranks 0,1] sum [3.0, 3.0]" in text, "after c, the all-reduce rank 1 waited in completed"


def test_a_timeout_waits_while_a_person_is_at_the_prompt(kernel):
    def think() -> str:  # 4 s at the prompt, past the cell's 2 s timeout, then a command and another prompt
        time.sleep(4)
        return "p secret"

    # after the debugger, 1.2 s of work: inside the 2 s only if the 4 s at the prompt do not count
    cell = STOP_HERE.format(options=" --timeout 2") + "import time\ntime.sleep(1.2)\nprint('worked')\n"
    content, text, asked = kernel.run(cell, [think, "c"])
    assert content["status"] == "ok", text
    assert "[ranks 0,1] worked" in text
    assert asked == ["(Pdb rank 0) "] * 2 and "40" in lines(text)
    assert "[ranks 0,1] sum [3.0, 3.0]" in text, "no rank was released while rank 0 sat in its debugger"


def test_q_fails_the_cell_on_that_rank_releases_the_other_and_the_world_works_after(kernel):
    content, text, asked = kernel.run(STOP_HERE.format(options=""), ["q"])
    assert content["status"] == "error"
    assert asked == ["(Pdb rank 0) "]
    assert "BdbQuit: q in the debugger on rank 0: the cell stops here" in text
    assert "sum" not in text, "rank 1 never got past the all-reduce: it was released"
    content, text, _ = kernel.run(ALL_REDUCE)
    assert content["status"] == "ok", text
    assert "[ranks 0,1] world works 2.0" in text


def test_every_rank_at_a_breakpoint_is_debugged_in_turn_each_named(kernel):
    cell = "%%distributed\nmine = 100 + dist.get_rank()\nbreakpoint()\nprint('after', mine)\n"
    content, text, asked = kernel.run(cell, ["p mine", "c", "p mine", "c"])
    assert content["status"] == "ok", text
    first, second = asked[0], asked[2]
    assert {first, second} == {"(Pdb rank 0) ", "(Pdb rank 1) "} and asked == [first, first, second, second]
    ranks = [int(p.split()[2].rstrip(")")) for p in (first, second)]
    shown = [line for line in lines(text) if line in ("100", "101")]
    assert shown == [str(100 + r) for r in ranks], "each p mine answered from the rank its prompt named"
    assert "[ranks 0,1] after 100" in text or "[rank 0] after 100" in text


def test_ctrl_c_at_the_prompt_stops_the_cell_and_the_world_works_after(kernel):
    content, text, asked = kernel.run(STOP_HERE.format(options=""), [kernel.km.interrupt_kernel])
    assert content["status"] == "error" and content["ename"] == "KeyboardInterrupt", text
    assert asked == ["(Pdb rank 0) "]
    content, text, _ = kernel.run(ALL_REDUCE)
    assert content["status"] == "ok", text
    assert "[ranks 0,1] world works 2.0" in text


def test_dist_debug_post_mortem_through_the_input_box(kernel):
    cell = "%%distributed\ndef scale(v):\n    y = v * 2\n    raise ValueError(y)\nif dist.get_rank() == 1:\n    scale(5)\n"
    content, _, _ = kernel.run(cell)
    assert content["status"] == "error"
    content, text, asked = kernel.run("%dist_debug", ["p y", "q"])
    assert content["status"] == "ok", text
    assert asked == ["(Pdb rank 1) ", "(Pdb rank 1) "], "the rank that raised, named"
    assert "10" in lines(text), "p y: a local of the frame that raised"


def test_a_rank_in_its_debugger_shows_in_dist_where_and_its_line_comes_from_this_client_only(cluster, monkeypatch):
    """The API: a cell left running (block=False) with rank 1 at its prompt; %dist_where names it; a second
    client of the same cluster (same keys) cannot type into it; then the person answers."""
    from ipyparallel import Client

    from nbdist import compat, wire

    pending = cluster.run("import nbdist\nv = 7\nnbdist.breakpoint(rank=1)\nprint('v', v)", block=False)

    def in_debugger():
        """rank 1 in its debugger, per %dist_where"""
        text = "\n".join(cluster.where())
        return text if "in the debugger" in text else None

    text = poll(in_debugger, 30)
    assert "rank 1" in text.split("in the debugger")[0].splitlines()[-1]
    now = cluster.states()  # the reports %dist_where read put rank 1's state on the board
    assert (str(now[1].state), now[1].line, str(now[0].state)) == ("debugging", 3, "idle"), now
    security = os.path.join(cluster.engines.workdir, "profile", "security")
    other = Client(glob.glob(os.path.join(security, "ipcontroller-*client.json"))[0])  # same user, same keys
    try:
        reply = compat.send_control(other, cluster.engines.ranks[1].engine_id, wire.PDB_REQUEST, {"line": "c"})
        content = reply.result(timeout=10)[0]["content"]
        assert content == {"status": "refused", "why": "only the notebook running the cell can type here"}
    finally:
        other.close()
    answers = iter(["p v * 6", "c"])
    monkeypatch.setattr("builtins.input", lambda prompt: next(answers))
    result = pending.wait()
    assert result.ok
    assert psutil.pid_exists(cluster.engines.ranks[1].pid)
