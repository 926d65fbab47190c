"""engine/released.py in a real IPython shell without a cluster: a cell whose process group was lost ends with torch's
grad mode as it began (a recovery runs it again); a cell that failed for its own reasons, or ended well, keeps what
it set, as in one process."""

from __future__ import annotations

import pytest
import torch
from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config

from nbdist.engine import released
from nbdist.engine.state import STATE

OFF = "import torch\ntorch._C._set_grad_enabled(False)\n"
GLOO = "raise RuntimeError('[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:400: Connection reset by peer')"
RELEASED_IN_GLOOS_ERROR = f"try:\n    {GLOO}\nexcept RuntimeError:\n    raise KeyboardInterrupt\n"


@pytest.fixture
def shell():
    config = Config()
    config.HistoryManager.hist_file = ":memory:"
    sh = InteractiveShell(config=config)
    sh._showtraceback = lambda *a: None  # noqa: SLF001
    sh.events.register("pre_run_cell", lambda info=None: released.at_start())
    sh.events.register("post_run_cell", released.at_end)
    yield sh
    torch.set_grad_enabled(True)
    STATE.aborted = False


@pytest.mark.parametrize(
    ("ending", "aborted", "after"),
    [
        (GLOO, False, True),  # gloo lost a peer
        (RELEASED_IN_GLOOS_ERROR, False, True),  # the release's KeyboardInterrupt, raised while gloo's error unwound
        ("raise KeyboardInterrupt", True, True),  # the watcher broke the group
        ("raise KeyboardInterrupt", False, False),  # the person's own Ctrl-C, the group whole
        ("1 / 0", False, False),  # the cell's own error
        ("pass", True, False),  # the cell ended well
    ],
    ids=["gloo", "released-in-gloos-error", "aborted", "own-ctrl-c", "own-error", "ended-well"],
)
def test_grad_mode_is_put_back_only_after_a_cell_whose_group_was_lost(shell, ending, aborted, after):
    STATE.aborted = aborted
    shell.run_cell(OFF + ending)
    assert torch.is_grad_enabled() is after
