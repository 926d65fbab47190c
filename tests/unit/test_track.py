"""A tracked run's steps (tracking/steps.py), its writer (tracking/tracker.py) and each tracker's run
(tracking/sinks.py, runs.py), read back with the tracker's own reader (tests/trackers.py). The world's end to end: tests/integration/test_track.py."""

from __future__ import annotations

import sys
import threading

import pytest

from nbdist.errors import ConfigError
from nbdist.tracking import Tracker, open_run, tracker
from nbdist.tracking.steps import WORLD_SIZE, Steps
from tests import trackers


def _rows(steps, rank, **extra):
    return [{"step": s, "loss": float(rank * 100 + s), **extra} for s in steps]


def _by_tag(points):
    out: dict[str, list[tuple[int, float]]] = {}
    for tag, value, step in points:
        out.setdefault(tag, []).append((step, value))
    return out


def test_cells_go_on_from_the_runs_last_step_and_the_world_is_the_mean_over_its_ranks():
    steps = Steps()
    points = steps.cell(2)
    for _ in range(2):  # the same cell twice: its loop counts from 0 again, the run's step goes on
        points += steps.cell(2)
        points += steps.add(0, _rows(range(3), 0))
        points += steps.add(1, _rows(range(3), 1))
    tags = _by_tag(points)
    assert tags["rank0/loss"] == [(s, float(s % 3)) for s in range(6)]
    assert tags["rank1/loss"] == [(s, float(100 + s % 3)) for s in range(6)]
    assert tags["loss"] == [(s, 50.0 + s % 3) for s in range(6)]  # written once both ranks logged the step
    assert tags[WORLD_SIZE] == [(0, 2.0)], "the size once, where it was first known"


def test_a_step_logged_again_inside_a_cell_is_left_out_and_throughput_is_summed():
    steps = Steps()
    steps.cell(2)
    points = steps.add(0, _rows(range(4), 0, **{"throughput/samples_per_s": 10.0}))
    points += steps.add(0, _rows([2, 3, 4], 0, **{"throughput/samples_per_s": 10.0}))  # a loop that went back
    points += steps.add(1, _rows(range(5), 1, **{"throughput/samples_per_s": 30.0}))
    tags = _by_tag(points)
    assert [s for s, _ in tags["rank0/loss"]] == [0, 1, 2, 3, 4]
    assert tags["throughput/samples_per_s"] == [(s, 40.0) for s in range(5)]


def test_a_world_that_shrinks_and_grows_says_its_size_at_the_step_and_renumbers_its_ranks():
    steps = Steps()
    points = steps.cell(3)
    points += steps.add(0, _rows(range(2), 0)) + steps.add(1, _rows(range(2), 1)) + steps.add(2, _rows(range(1), 2))
    points += steps.resized({0: 0, 2: 1}, 2, None)  # rank 1 lost: rank 2 is rank 1 from the cell's step 2
    points += steps.add(1, _rows([2], 2))
    points += steps.add(0, _rows([2], 0))
    points += steps.resized({0: 0, 1: 1}, 3, [2])  # grown back to 3 at step 3
    tags = _by_tag(points)
    assert tags[WORLD_SIZE] == [(0, 3.0), (2, 2.0), (3, 3.0)]
    assert (1, 51.0) in tags["loss"], "step 1 lacked rank 2: written with the ranks that logged it at the resize"
    assert tags["loss"][-1] == (2, 102.0)  # ranks 0 and 2 (now 1: its rows say 2) at step 2


def test_timings_and_non_numbers_are_left_out():
    steps = Steps()
    steps.cell(1)
    points = steps.add(0, [{"why/step_s": 0.1}, {"step": 0, "loss": 1.0, "note": "x", "ok": True, "t": 3.0}])
    assert sorted(tag for tag, _, _ in points) == ["loss", "rank0/loss"]


class _Held:
    """A run whose writes wait until released: a tracker that is slow, or stuck."""

    where = "memory"

    def __init__(self) -> None:
        self.go = threading.Event()
        self.points: list = []
        self.texts: list = []
        self.closed = False

    def scalars(self, points):
        self.go.wait()
        self.points += points

    def params(self, params):
        self.texts.append(("params", 0))

    def cell(self, code, step):
        self.texts.append(("cell", step))

    def close(self):
        self.closed = True


def test_nothing_waits_for_a_slow_tracker_and_a_full_queue_drops_and_says_so_once(monkeypatch, capsys):
    monkeypatch.setattr(tracker, "QUEUE", 50)
    run = _Held()
    t = Tracker(run, "held", {"n": 2})
    t.cell("for step in range(100): ...", 1)
    for step in range(200):  # the writer is stuck on the first batch: every call returns
        t.metrics(0, [{"step": step, "loss": 1.0}])
    assert t.dropped > 0
    said = capsys.readouterr().err
    assert said.count("does not keep up") == 1 and "training goes on" in said, said
    run.go.set()
    assert t.wait(10)
    t.close()
    steps = [s for tag, _, s in run.points if tag == "rank0/loss"]
    assert steps == sorted(set(steps)) and steps[0] == 0, "what was kept is in order, once each"
    assert run.closed


def test_a_tracker_that_fails_is_said_once_and_the_rows_keep_coming(capsys):
    run = _Held()
    run.go.set()

    def broken(points):
        raise OSError("disk full")

    run.scalars = broken
    t = Tracker(run, "broken", {})
    t.cell("x", 1)
    for step in range(5):
        t.metrics(0, [{"step": step, "loss": 1.0}])
    assert t.wait(10)
    t.close()
    said = capsys.readouterr().err
    assert said.count("failed to write (OSError: disk full)") == 1, said


@pytest.mark.parametrize("kind", trackers.KINDS)
def test_each_trackers_run_reads_back_with_its_own_reader(kind, tmp_path):
    where = trackers.place(kind, tmp_path)
    params = {"n": 2, "launcher": "local", "timeout": 60.0}
    run = open_run(kind, "one", **where, params=params)
    t = Tracker(run, kind, params)
    for _ in range(2):
        t.cell("for step in range(3): nbdist.log(step=step, loss=...)", 2)
        for rank in (1, 0):  # a rank's later steps before another's earlier ones
            t.metrics(rank, _rows(range(3), rank))
    t.close()
    got = trackers.read(kind, tmp_path, "one")
    assert got["runs"] == 1
    assert sorted(k for k in got if k not in ("cells", "params", "runs", "status")) == [
        "loss",
        "rank0/loss",
        "rank1/loss",
        WORLD_SIZE,
    ]
    assert got["loss"] == [(s, 50.0 + s % 3) for s in range(6)]
    assert got["rank1/loss"] == [(s, 100.0 + s % 3) for s in range(6)]
    assert got[WORLD_SIZE] == [(0, 2.0)]
    assert got["cells"] == [0, 3]
    assert {k: str(v) for k, v in got["params"].items()} == {k: str(v) for k, v in params.items()}
    if kind == "mlflow":
        assert got["status"] == "FINISHED"


def test_bad_input_is_one_line_naming_the_value_and_the_fix(tmp_path):
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "events.out.tfevents.1.host").write_bytes(b"")
    (tmp_path / "a-file").write_text("")
    cases = {
        ("tensorbord", None, None): "'tensorbord' is not a tracker nbdist knows; did you mean 'tensorboard'?",
        ("tensorboard", "one", str(tmp_path)): "the run name 'one' is taken in",
        ("tensorboard", "x", str(tmp_path / "a-file")): "cannot be written",
        ("tensorboard", "a/b", str(tmp_path)): "run name 'a/b' is not one word",
    }
    for args, expected in cases.items():
        with pytest.raises(ConfigError) as err:
            open_run(*args)
        assert expected in str(err.value) and "\n" not in str(err.value), (args, str(err.value))


def test_each_tracker_refuses_a_taken_name_an_unwritable_place_and_an_option_it_does_not_take(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    for kind in trackers.KINDS:  # a run named "taken" in each tracker's place, one step logged, ended
        taken = Tracker(open_run(kind, "taken", **trackers.place(kind, tmp_path / kind)), kind, {})
        taken.cell("nbdist.log(step=0, loss=1.0)", 1)
        taken.metrics(0, _rows([0], 0))
        taken.close()
    (tmp_path / "a-file").write_text("")
    unwritable = str(tmp_path / "a-file" / "x")
    cases = [
        (
            "mlflow",
            {"name": "taken", **trackers.place("mlflow", tmp_path / "mlflow")},
            "the run name 'taken' is taken in MLflow's",
        ),
        ("wandb", {"name": "taken", **trackers.place("wandb", tmp_path / "wandb")}, "the run name 'taken' is taken in"),
        (
            "trackio",
            {"name": "taken", **trackers.place("trackio", tmp_path / "trackio")},
            "the run name 'taken' is taken in trackio",
        ),
        ("mlflow", {"uri": f"sqlite:///{unwritable}/m.db"}, f"MLflow cannot open a run at sqlite:///{unwritable}/m.db"),
        ("mlflow", {"folder": unwritable}, f"--dir {unwritable} cannot be written"),
        ("wandb", {"folder": unwritable}, f"--dir {unwritable} cannot be written"),
        ("mlflow", {"uri": "sqlite:///m.db", "folder": str(tmp_path)}, "either --uri"),
        ("tensorboard", {"uri": "sqlite:///m.db"}, "--uri is MLflow's tracking URI; tensorboard takes --dir"),
        ("tensorboard", {"project": "p"}, "TensorBoard has no projects"),
        ("wandb", {"project": "a b"}, "project 'a b' is not one word"),
        ("trackio", {"folder": str(tmp_path / "elsewhere")}, "set TRACKIO_DIR="),
    ]
    for kind, options, expected in cases:
        with pytest.raises(ConfigError) as err:
            open_run(kind, **options)
        assert expected in str(err.value) and "\n" not in str(err.value), (kind, options, str(err.value))
    monkeypatch.setenv("WANDB_MODE", "offlin")
    with pytest.raises(ConfigError, match="WANDB_MODE='offlin' is not a W&B mode; did you mean 'offline'"):
        open_run("wandb", "w", str(tmp_path))
    for kind in trackers.KINDS:
        assert trackers.read(kind, tmp_path / kind, "taken")["runs"] == 1, kind  # nothing was written by the refusals


def test_steps_a_rank_never_logged_are_written_with_the_others_in_order_before_a_later_complete_step():
    steps = Steps()
    steps.cell(2)
    points = steps.add(0, _rows(range(6), 0))
    points += steps.add(1, _rows([0, 1], 1))  # rank 1 killed after step 1: its rows for 2-3 died with it
    points += steps.add(1, _rows([4, 5], 1))  # rebuilt at step 4
    assert _by_tag(points)["loss"] == [(0, 50.0), (1, 51.0), (2, 2.0), (3, 3.0), (4, 54.0), (5, 55.0)]


def test_nbdist_track_is_the_function_whatever_was_imported():
    import nbdist
    import nbdist.tools.track
    import nbdist.tracking  # noqa: F401 - a package named track would shadow nbdist.track once imported

    assert nbdist.track is nbdist.tools.track.track and nbdist.untrack is nbdist.tools.track.untrack


@pytest.mark.parametrize("kind", trackers.KINDS)
def test_a_run_opened_again_from_the_worlds_directory_goes_on_after_its_last_step(kind, tmp_path, monkeypatch):
    """A kept world's kernel restarted: the run ends as the process does (its tracker's atexit), the state in the
    world's directory says where it was, and the new kernel's tracker goes on in the same run, no step twice."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    workdir = tmp_path / "world"
    workdir.mkdir()
    first = Tracker(
        open_run(kind, "kept", **trackers.place(kind, tmp_path / "runs"), params={"n": 2}), kind, {"n": 2}, str(workdir)
    )
    first.cell("a", 2)
    for rank in (0, 1):
        first.metrics(rank, _rows(range(4), rank))
    assert first.wait(10)
    first.run.close()  # the kernel goes: its run's own end, not nbdist's close
    assert (workdir / tracker.STATE).exists()
    said: list[str] = []
    again = tracker.resume(str(workdir), say=said.append)
    assert again is not None and said == [
        f"tracking this world in the {kind} run at {again.run.where} again (from step 4)"
    ]
    again.cell("b", 3)
    for rank in (0, 1, 2):
        again.metrics(rank, _rows(range(2), rank))
    again.close()
    assert not (workdir / tracker.STATE).exists() and tracker.resume(str(workdir), say=said.append) is None
    got = trackers.read(kind, tmp_path / "runs", "kept")
    assert got["runs"] == 1
    assert got["rank0/loss"] == [(s, float(s)) for s in range(4)] + [(4, 0.0), (5, 1.0)]
    assert got["rank2/loss"] == [(4, 200.0), (5, 201.0)]
    assert got[WORLD_SIZE] == [(0, 2.0), (4, 3.0)]
    assert got["cells"] == [0, 4]


def test_a_loop_that_keeps_its_own_count_across_cells_keeps_it_and_one_that_restarts_goes_on_after():
    steps = Steps()
    points = steps.cell(2)
    for rank in (0, 1):
        points += steps.add(rank, _rows(range(5), rank))
    points += steps.cell(2)  # a loader's step survives the cell: 5..9
    for rank in (0, 1):
        points += steps.add(rank, _rows(range(5, 10), rank))
    points += steps.cell(2)  # counts from 0 again: after the run's last step, 10..12
    for rank in (0, 1):
        points += steps.add(rank, _rows(range(3), rank))
    points += steps.cell(2)  # goes on from 2 (below the run's last): its first row moves it just past, 13..14
    for rank in (0, 1):
        points += steps.add(rank, _rows([2, 3], rank))
    points += steps.flush()
    got = _by_tag(points)
    assert [s for s, _ in got["rank0/loss"]] == list(range(15))
    assert [v for _, v in got["rank1/loss"]] == [100.0 + s for s in [*range(10), 0, 1, 2, 2, 3]]
    assert [s for s, _ in got["loss"]] == list(range(15))
    assert steps.base == 13


@pytest.mark.parametrize("crc", ["google-crc32c", "tensorboard's own"])
def test_nbdists_event_file_is_read_by_tensorboard_with_its_own_checksums(crc, tmp_path, monkeypatch):
    """tracking/tfevents.py writes TensorBoard's record format itself: TensorBoard's reader (which checks every
    record's checksums) reads each step's scalars and the text back; every record's checksum is TensorBoard's."""
    import struct

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    from nbdist.tracking.runs import TensorBoardRun

    if crc != "google-crc32c":
        monkeypatch.setitem(sys.modules, "google_crc32c", None)  # not installed
    tb = TensorBoardRun(str(tmp_path))
    tb.params({"n": 2})
    tb.scalars([("loss", 1.0, 0), ("rank0/loss", 2.0, 0), ("loss", 0.5, 1), ("loss", 0.25, 7)])
    tb.cell("print('hi')", 1)
    tb.close()
    data = open(tb.events.path, "rb").read()
    at, records = 0, 0
    while at < len(data):  # each record: length, its checksum, the event, its checksum
        (size,) = struct.unpack("<Q", data[at : at + 8])
        assert struct.unpack("<I", data[at + 8 : at + 12])[0] == masked_crc32c(data[at : at + 8])
        event = data[at + 12 : at + 12 + size]
        assert struct.unpack("<I", data[at + 12 + size : at + 16 + size])[0] == masked_crc32c(event)
        at, records = at + 16 + size, records + 1
    assert records == 6  # the file's version, the config, three steps, the cell
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(0, 1.0), (1, 0.5), (7, 0.25)]
    assert [(e.step, e.value) for e in acc.Scalars("rank0/loss")] == [(0, 2.0)]
    assert [e.step for e in acc.Tensors("nbdist/cell/text_summary")] == [1]
    assert acc.Tensors("nbdist/config/text_summary")[0].tensor_proto.string_val[0].decode().startswith("```")


def test_a_metric_only_some_ranks_log_is_written_as_it_comes_not_when_the_cell_ends():
    """Rank 0 logs val_acc every 5 steps, ranks 0 and 1 a loss of their own (tensor-parallel rank 0's), rank 2
    neither: once every other rank has logged a step or a later one without it, the step's value is the world's over
    the ranks that log it, written at once; before every rank has sent a row, it may be everyone's, so it waits; a
    metric every rank logs still waits for all of them, also when another rank's first batch held only nbdist's own
    timings."""
    steps = Steps()
    steps.cell(3)

    def rows(rank, span):
        return [{"step": s, "loss": float(rank + 1), **({"tp0": 10.0 * (rank + 1) + s} if rank < 2 else {}),
                 **({"val_acc": s / 10} if rank == 0 and s % 5 == 0 else {})} for s in span]

    assert steps.add(1, [{"step": None, "why/compute_s": 0.1}]) == []  # a timing row: not a step of rank 1's
    points = steps.add(0, rows(0, range(5)))
    points += steps.add(1, rows(1, range(10)))
    points += steps.add(0, rows(0, range(5, 10)))
    assert not {"val_acc", "tp0"} & set(_by_tag(points)), points  # rank 2 has sent nothing: it may log them too
    points += steps.add(2, rows(2, range(10)))  # it logs neither: both are written now, before the cell ends
    tags = _by_tag(points)
    assert tags["val_acc"] == [(0, 0.0), (5, 0.5)]
    assert tags["tp0"] == [(s, 15.0 + s) for s in range(10)]  # the mean of ranks 0 and 1
    assert tags["loss"] == [(s, 2.0) for s in range(10)]
    # rank 1, the last to pass step 10, logs tp0 but not val_acc: its rows complete both
    points = steps.add(0, rows(0, range(10, 15))) + steps.add(2, rows(2, range(10, 15)))
    assert not {"val_acc", "tp0"} & set(_by_tag(points)), points
    tags = _by_tag(steps.add(1, rows(1, range(10, 15))))
    assert tags["val_acc"] == [(10, 1.0)] and tags["tp0"] == [(s, 15.0 + s) for s in range(10, 15)], tags


@pytest.mark.parametrize("kind", trackers.KINDS)
def test_a_process_that_exits_with_its_run_open_loses_no_row_and_keeps_the_state(kind, tmp_path):
    """A kernel restarted under a kept world exits with its run open: what its tracker was handed is written before
    the process ends (trackio's own writer thread, every 0.5 s, used to die with it), and the run's state stays in
    the world's directory for the kernel that attaches next."""
    import json
    import subprocess

    script = f"""
import sys
sys.path[:0] = {sys.path!r}
from nbdist.tracking import Tracker, open_run
params = {{"n": 2}}
t = Tracker(open_run({kind!r}, "left", **{trackers.place(kind, tmp_path)!r}, params=params), {kind!r}, params,
            {str(tmp_path)!r})
t.cell("for step in range(3): nbdist.log(step=step, loss=...)", 2)
for rank in (0, 1):
    t.metrics(rank, {_rows(range(3), 0)!r} if rank == 0 else {_rows(range(3), 1)!r})
"""  # and the process ends at once, the run open
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    got = trackers.read(kind, tmp_path, "left")
    assert got["rank1/loss"] == [(s, 100.0 + s) for s in range(3)], got
    assert json.loads((tmp_path / tracker.STATE).read_text())["last"] == 2
