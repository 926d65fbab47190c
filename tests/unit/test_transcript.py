"""A distributed cell's transcript (cells/transcript.py): what a page opened later shows. Written as
the sink shows output, read back as a page merges it; bounded; private to the user; damage and a
deleted directory cost what they touch and are said in one line."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys

from nbdist.cells import pointers as P
from nbdist.cells import transcript as T
from nbdist.cells.output import TaggedPrinter
from nbdist.errors import RankError
from nbdist.results import RankState


class Failed:
    def raise_for_error(self):
        raise RankError("rank 1 (engine 1) raised ValueError in cell line 2: bad batch", failures=[], notes=[])


def _open(tmp_path, **cell):
    return T.Transcript.open(str(tmp_path), {"id": "c1", "count": 4, "code": "%%distributed\nprint(1)", **cell})


def test_what_the_sink_shows_is_read_back_as_a_page_shows_it(tmp_path):
    kept = _open(tmp_path)
    sink = TaggedPrinter(ranks=[0, 1], transcript=kept)
    sink.stream(0, "stdout", "epoch 0\n")
    sink.stream(1, "stdout", "epoch 0\n")
    sink.tick()  # as the watch does after each batch it hands over
    sink.metrics(0, [{"step": 0, "loss": 1.0}])
    sink.state(1, RankState.FAILED)
    sink.stream(0, "stderr", "warning\n")
    sink.flush()
    kept.end(Failed())
    [path] = T.cells(str(tmp_path))
    cell = T.read(path)
    assert (cell.id, cell.count, cell.code, cell.running) == ("c1", 4, "%%distributed\nprint(1)", False)
    texts = [(o["output_type"], o.get("name"), o.get("text")) for o in cell.outputs]
    assert texts[0] == ("stream", "stdout", "[ranks 0,1] epoch 0\n")  # folded, as the cell printed it
    assert ("stream", "stderr", "[rank 0] warning\n") in texts
    assert cell.outputs[-1]["output_type"] == "error" and "bad batch" in cell.outputs[-1]["evalue"]
    assert cell.metrics == {0: [{"step": 0, "loss": 1.0}]} and cell.states == {1: "failed"}
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(T.directory(str(tmp_path))).st_mode) == 0o700


def test_a_running_cell_and_a_half_written_line(tmp_path):
    kept = _open(tmp_path)
    kept.output({"output_type": "stream", "name": "stdout", "text": "a\n"})
    kept.flush()
    with open(kept.path, "a") as fh:
        fh.write('{"out": {"output_type": "stream", "name": "stdout", "text": "b')  # a write cut in the middle
    cell = T.read(kept.path)
    assert cell.running and [o["text"] for o in cell.outputs] == ["a\n"]
    with open(kept.path, "a") as fh:
        fh.write('\\n"}}\nnot json\n{"end": 1}\n')  # completed, then a damaged line: that line is lost
    cell = T.read(kept.path)
    assert not cell.running and [o["text"] for o in cell.outputs] == ["a\nb\n"]


def test_output_beyond_the_bound_is_counted_not_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(T, "MAX_OUTPUT_BYTES", 2000)
    kept = _open(tmp_path)
    for i in range(100):
        kept.output({"output_type": "stream", "name": "stdout", "text": f"line {i:03d} " + "x" * 40 + "\n"})
    kept.end()
    assert os.path.getsize(kept.path) < 2000 + 1000
    text = T.read(kept.path).outputs
    assert text[0]["text"].startswith("line 000") and "line 099" not in text[0]["text"]
    assert "more characters were shown than this transcript keeps" in text[-1]["text"]


def test_metric_rows_are_thinned_beyond_the_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(T, "MAX_METRIC_ROWS", 100)
    kept = _open(tmp_path)
    for step in range(1000):
        kept.metrics(0, [{"step": step}])
    kept.end()
    steps = [r["step"] for r in T.read(kept.path).metrics[0]]
    assert steps[:100] == list(range(100))  # every row up to the bound
    assert steps[-1] >= 990 and len(steps) < 400  # then thinner and thinner, to the last steps


def test_a_world_keeps_its_last_cells(tmp_path, monkeypatch):
    monkeypatch.setattr(T, "MAX_CELLS", 3)
    for i in range(5):
        _open(tmp_path, id=f"c{i}").end()
    assert [T.read(p).id for p in T.cells(str(tmp_path))] == ["c2", "c3", "c4"]


def test_a_transcript_deleted_mid_run_begins_again_says_so_once_and_keeps_what_follows(tmp_path, capsys):
    kept = _open(tmp_path)
    kept.output({"output_type": "stream", "name": "stdout", "text": "earlier\n"})
    kept.flush()
    os.unlink(kept.path)  # by hand, or a clean-up script, while the cell runs
    kept.output({"output_type": "stream", "name": "stdout", "text": "a\n"})
    kept.metrics(0, [{"step": 5, "loss": 1.0}])
    kept.flush()
    kept.output({"output_type": "stream", "name": "stdout", "text": "b\n"})
    kept.end()
    err = capsys.readouterr().err
    assert err.count("was deleted while the cell ran; kept again from here") == 1 and kept.path in err
    cell = T.read(kept.path)
    assert cell is not None and cell.id == "c1" and not cell.running  # a page finds it by its id, and its end
    text = "".join(o.get("text", "") for o in cell.outputs)
    assert "transcript was deleted at" in text and "a\nb\n" in text and "earlier" not in text
    assert cell.metrics[0] == [{"step": 5, "loss": 1.0}]
    assert stat.S_IMODE(os.stat(kept.path).st_mode) == 0o600


def test_a_deleted_world_directory_is_said_once_and_the_cell_goes_on(tmp_path, capsys):
    kept = _open(tmp_path)
    shutil.rmtree(os.path.dirname(kept.path))
    kept.output({"output_type": "stream", "name": "stdout", "text": "a\n"})
    kept.flush()
    kept.output({"output_type": "stream", "name": "stdout", "text": "b\n"})
    kept.end()
    err = capsys.readouterr().err
    assert err.count("no longer kept for pages opened later") == 1 and kept.path in err


def test_the_pointer_names_the_world_and_is_private(tmp_path, monkeypatch):
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    P.point(str(tmp_path / "world"), "k-123")
    path = P.pointer_path("k-123")
    assert json.load(open(path))["workdir"] == str(tmp_path / "world")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    P.point(str(tmp_path / "world"))  # outside a kernel: nothing to point from, nothing written
    assert os.listdir(os.path.dirname(path)) == ["k-123.json"]


def test_a_server_starting_removes_only_the_pointers_of_kernels_that_ended(tmp_path, monkeypatch):
    """Another Jupyter server of this user shares the runtime directory: the pointers of its running kernels stay
    (they did not: a second server's start removed them, and its reopened pages showed nothing of their cells)."""
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "-f", "/x/kernel-other.json"])
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    try:
        for kernel, pid in [("mine", 1), ("other", other.pid), ("ended", ended.pid), ("reused", os.getpid())]:
            P.point(str(tmp_path / kernel), kernel)
            with open(P.pointer_path(kernel), "w") as fh:  # as that kernel wrote it: its own pid
                json.dump({"workdir": str(tmp_path / kernel), "pid": pid}, fh)
        assert P.prune({"mine"}) == 2
        assert sorted(os.listdir(os.path.dirname(P.pointer_path("mine")))) == ["mine.json", "other.json"]
    finally:
        other.kill()
        other.wait()
    assert P.prune({"mine"}) == 1  # the other server's kernel ended since


def test_outside_a_kernel_nothing_is_kept(tmp_path):
    assert T.start(str(tmp_path)) is None and not os.path.exists(T.directory(str(tmp_path)))


def test_the_same_run_of_a_cell_sent_to_the_ranks_again_is_one_transcript(tmp_path):
    """Recovery runs a failed cell again, a magic may run several: one notebook cell, one transcript."""
    first = _open(tmp_path)
    first.output({"output_type": "stream", "name": "stdout", "text": "try 1\n"})
    first.end(Failed())
    again = _open(tmp_path)  # the same cell id and count
    assert again.path == first.path and T.read(again.path).running
    again.output({"output_type": "stream", "name": "stdout", "text": "try 2\n"})
    again.end()
    other = _open(tmp_path, count=5)  # the next run of the cell: a transcript of its own
    other.end()
    assert len(T.cells(str(tmp_path))) == 2
    cell = T.read(first.path)
    assert not cell.running and [o.get("text", o.get("evalue")) for o in cell.outputs][0] == "try 1\n"
    assert cell.outputs[-1]["text"] == "try 2\n" and cell.outputs[1]["output_type"] == "error"
