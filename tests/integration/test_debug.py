"""%dist_debug: post-mortem pdb on the rank that raised, typed into the notebook, on a real cluster."""

from __future__ import annotations

import pytest

from nbdist.errors import ConfigError
from nbdist.tools.debug import debug

CELL = """
def scale(x):
    y = x * 2
    raise ValueError(f"bad {y}")

z = 5
if dist.get_rank() == 1:
    scale(z)
"""


def _session(cluster, commands, rank=None):
    said: list[str] = []
    asked: list[str] = []

    def ask(prompt: str) -> str:
        asked.append(prompt)
        return commands.pop(0)

    debug(cluster, rank, ask=ask, say=said.append)
    return said, asked


def test_dist_debug_opens_pdb_on_the_rank_that_raised_and_reads_its_frames(cluster):
    result = cluster.run(CELL)
    assert not result.ok and result[1].status == "error"
    said, asked = _session(cluster, ["p y", "up", "p z", "l", "clear", "", "q"])
    assert asked[0] == "(Pdb rank 1) ", "the prompt names the rank"
    assert said[0].startswith("post-mortem pdb on rank 1") and "ValueError: bad 10" in said[0]
    assert "raise ValueError" in said[0], "it starts at the line that raised"
    assert said[1] == "10", "p y: the frame that raised"
    assert "<module>" in said[2]
    assert said[3] == "5", "up, p z: the cell's own frame"
    assert "scale(z)" in said[4] and "z = 5" in said[4], "l shows the cell's own source"
    assert len(asked) == 7, "clear (which asks a question of its own) did not hang, and q ended the session"
    assert len(said) == 5 and not any("***" in text for text in said), "clear's own question got end-of-input"
    cluster.run("t = torch.ones(1)\ndist.all_reduce(t)\nassert t.item() == 2.0").raise_for_error()


def test_dist_debug_names_a_rank_with_nothing_to_debug(cluster):
    cluster.run("fine = 1").raise_for_error()
    with pytest.raises(ConfigError, match="the last cell raised on no rank; name one"):
        debug(cluster, ask=lambda prompt: "q", say=print)
    with pytest.raises(ConfigError, match="rank 7 is not in this world"):
        debug(cluster, 7, ask=lambda prompt: "q", say=print)


def test_dist_debug_names_a_dead_rank_and_the_fix(cluster):
    import os
    import signal

    from tests.helpers import wait_gone

    cluster.run(CELL)
    pid = cluster.engines.ranks[1].pid
    os.kill(pid, signal.SIGKILL)
    assert wait_gone([pid], 10) == []
    try:
        with pytest.raises(ConfigError, match=r"rank 1 is dead: .* %dist_restart --ranks 1"):
            debug(cluster, 1, ask=lambda prompt: "q", say=print)
    finally:
        cluster.restart([1])
    cluster.run("t = torch.ones(1)\ndist.all_reduce(t)\nassert t.item() == 2.0").raise_for_error()
