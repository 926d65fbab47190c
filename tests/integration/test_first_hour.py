"""What a newcomer sees in the first hour (#51), read where they read it: the outputs of a real Jupyter kernel
(jupyter_client, as a page gets them), a real 2-rank cluster.

- Stop during a collective: nbdist's lines (who was where, the process group rebuilt), then one line, not the
  frames of nbdist that waited (``NBDIST_TRACEBACK=full`` shows them);
- a rank killed under ``--max-restarts``: the living rank that nbdist released prints no ``KeyboardInterrupt``
  of its own before the recovery's line (a second release signal used to interrupt it while it formatted its
  traceback).

Time bounds only catch hangs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading

import pytest

from tests.helpers import Kernel

ANSI = re.compile(r"\x1b\[[0-9;]*m")
BARRIER = """%%distributed
import time
if dist.get_rank() == 1:
    time.sleep(30)
dist.barrier()
"""
SETUP = """%%distributed --setup
import torch
from nbdist.parallel import apply_ddp, shard
torch.manual_seed(0)
model = apply_ddp(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
X = torch.randn(512, 4)
loader = shard(torch.utils.data.TensorDataset(X, X.sum(1, keepdim=True)), batch_size=8)
"""
TRAIN = """%%distributed
import time
for x, y in loader:
    loss = torch.nn.functional.mse_loss(model(x), y); opt.zero_grad(); loss.backward(); opt.step()
    open(PROGRESS + str(dist.get_rank()), "w").write(str(loader.step))
    time.sleep(0.1)
print('done', loader.step)
"""


@pytest.fixture(scope="module")
def kernel():
    k = Kernel(env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        content, text, _ = k.run(
            "%load_ext nbdist\n%dist_start -n 2 --max-restarts 1\nimport json, nbdist\n"
            "print(json.dumps([r.pid for r in nbdist.current().ranks]))"
        )
        assert content["status"] == "ok", text
        k.pids = json.loads(text.strip().splitlines()[-1])
        yield k
    finally:
        k.run("%dist_stop")
        k.close()


def _interrupted(kernel: Kernel) -> tuple[dict, str]:
    """Stop (the kernel's interrupt, as the toolbar's button) 3 s into a barrier that rank 1 is late to."""
    timer = threading.Timer(3.0, kernel.km.interrupt_kernel)
    timer.start()
    try:
        content, text, _ = kernel.run(BARRIER, timeout=120)
    finally:
        timer.cancel()
    return content, ANSI.sub("", text)


def test_an_interrupted_cell_ends_with_nbdists_lines_and_one_line_not_a_traceback(kernel):
    content, text = _interrupted(kernel)
    assert content["status"] == "error", text
    lines = text.strip().splitlines()
    assert lines[0].startswith("rank 0 was at cell line 4, in barrier"), text
    assert any(line.startswith("rank 1 was at cell line 3") and "behind" in line for line in lines), text
    assert "the process group was rebuilt in" in text and "variables on every rank are kept" in text
    assert lines[-1] == "KeyboardInterrupt: every rank stopped; what each was doing is said above", text
    assert "Traceback" not in text and "nbdist/" not in text and len(lines) <= 5, text

    content, text, _ = kernel.run("import os\nos.environ['NBDIST_TRACEBACK'] = 'full'")
    try:
        content, text = _interrupted(kernel)
        assert content["status"] == "error" and "Traceback" in text and "nbdist/cells/watch.py" in text, text
    finally:
        kernel.run("del os.environ['NBDIST_TRACEBACK']")


def test_a_rank_nbdist_released_for_a_recovery_prints_no_keyboardinterrupt(kernel, tmp_path):
    progress = str(tmp_path / "progress-")
    content, text, _ = kernel.run(f"{SETUP}PROGRESS = {progress!r}\n")
    assert content["status"] == "ok", text

    def kill() -> None:
        deadline = 60
        while deadline > 0:
            try:
                if int(open(progress + "1").read() or 0) >= 25:
                    break
            except (OSError, ValueError):
                pass
            threading.Event().wait(0.01)
            deadline -= 0.01
        os.kill(kernel.pids[1], signal.SIGKILL)

    threading.Thread(target=kill, daemon=True).start()
    content, text, _ = kernel.run(TRAIN, timeout=120)
    text = ANSI.sub("", text)
    assert content["status"] == "ok", text
    assert "rank(s) 1 died during the cell; restarted rank(s) 1" in text and "(nothing recomputed)" in text, text
    assert "KeyboardInterrupt" not in text, text  # nbdist's release is not the user's Ctrl-C
    assert text.strip().splitlines()[-1] == "[ranks 0,1] done 32", text


def test_a_finished_progress_bar_is_ordinary_output_not_an_error_box(kernel):
    """tqdm writes to stderr, which JupyterLab shows in a problem's pink box: the bar's last state comes as stdout;
    a warning stays on stderr."""
    streams: list[tuple[str, str]] = []

    def hook(msg: dict) -> None:
        if msg["msg_type"] == "stream":
            streams.append((msg["content"]["name"], msg["content"]["text"]))

    cell = (
        "%%distributed\nimport warnings\nfrom tqdm import tqdm\nfor _ in tqdm(range(50), desc='train', mininterval=0.01):"
        "\n    pass\nwarnings.warn('look at this')\n"
    )
    reply = kernel.kc.execute_interactive(cell, timeout=60, output_hook=hook)
    assert reply["content"]["status"] == "ok", streams
    out = "".join(text for name, text in streams if name == "stdout")
    err = "".join(text for name, text in streams if name == "stderr")
    assert "[rank 0] train: 100%" in out and "[rank 1] train: 100%" in out and "50/50" in out, streams
    assert "train:" not in err and "UserWarning: look at this" in err, streams


def test_a_rank_error_speaks_of_ranks_and_the_notebooks_cell_once_with_a_next_step(kernel):
    """One rank raises: its traceback says the notebook's own count for the cell (the rank counts apart), no
    engine ids, the error line once (the summary with the rank), and the note says what to do next."""
    kernel.run("x = 1")
    content, text, _ = kernel.run("%%distributed\nif dist.get_rank() == 1:\n    print(undefined_name)\nprint('ok')")
    text = ANSI.sub("", text)
    assert content["status"] == "error", text
    assert f"Cell In[{content['execution_count']}], line 2" in text, (content["execution_count"], text)
    assert "engine" not in text, text
    assert "--- traceback from rank 1 ---" in text
    assert text.count("name 'undefined_name' is not defined") == 1, text
    assert "rank 1 raised NameError in cell line 2: name 'undefined_name' is not defined" in text
    assert (
        "note: rank(s) 0 finished this cell, so state on the ranks may now differ: fix the cell and run it again "
        "(on every rank), or %dist_restart for fresh ranks." in text
    )
