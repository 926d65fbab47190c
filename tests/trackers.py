"""The four trackers' runs read back with each tracker's own reader, the same shape for all: each tag's points as
(step, value) in the order the run holds them, ``cells`` the steps where a cell's source was recorded, ``params``
the world's config as the run keeps it, ``runs`` how many runs the place holds.

Where each test puts a run: ``place(kind, tmp_path)`` gives %dist_track's options for a folder of the test's own.
trackio reads TRACKIO_DIR once per process, so its runs go to one folder for the whole session (this module sets
it before anything imports trackio) and each test has a project of its own instead.

W&B keeps an offline run in one ``.wandb`` file, a LevelDB-style log of its own protobuf ``Record``s; W&B no longer
ships a Python reader for it (its Go core reads it), so ``_wandb_records`` unframes the log (a 7-byte header, then
records of crc32c/length/type in 32 KiB blocks) and parses each record with W&B's own ``wandb_internal_pb2``.
W&B 0.31's ``run.finish()`` can return before its service process has written the run's records (3 reads in 16
found only the file's header right after it; all were whole a second later), so the reader waits for the run's
exit record.
"""

from __future__ import annotations

import atexit
import glob
import hashlib
import json
import os
import shutil
import struct
import tempfile
import time

KINDS = ("tensorboard", "mlflow", "wandb", "trackio")
HANG_S = 60.0  # a run's writes not done by then: a hang
if "TRACKIO_DIR" not in os.environ:  # a folder this process made, removed when it exits
    os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="nbdist-trackio-")
    atexit.register(shutil.rmtree, os.environ["TRACKIO_DIR"], True)
TRACKIO_DIR = os.environ["TRACKIO_DIR"]


def place(kind: str, folder) -> dict[str, str]:
    """%dist_track's options (nbdist.track's keywords) that put a run of ``kind`` in the test's own ``folder``."""
    if kind == "trackio":
        return {"project": "t-" + hashlib.sha1(str(folder).encode()).hexdigest()[:16]}  # one per test folder
    return {"folder": str(folder)}


def flags(kind: str, folder) -> str:
    """The same as %dist_track flags."""
    return " ".join(f"--{'dir' if k == 'folder' else k} {v}" for k, v in place(kind, folder).items())


def read(kind: str, folder, name: str) -> dict:
    return {"tensorboard": _tensorboard, "mlflow": _mlflow, "wandb": _wandb, "trackio": _trackio}[kind](folder, name)


def _tensorboard(folder, name: str) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(str(folder), name), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    out: dict = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    out["cells"] = [e.step for e in acc.Tensors("nbdist/cell/text_summary")]
    config = acc.Tensors("nbdist/config/text_summary")[0].tensor_proto.string_val[0].decode()
    out["params"] = json.loads(config.strip("`\n"))
    out["runs"] = len(os.listdir(str(folder)))
    return out


def _mlflow(folder, name: str) -> dict:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{os.path.join(str(folder), 'mlflow.db')}")
    experiment = client.get_experiment_by_name("nbdist")
    runs = client.search_runs([experiment.experiment_id])
    (run,) = [r for r in runs if r.info.run_name == name]
    out: dict = {}
    for key in run.data.metrics:
        history = sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: (m.step, m.timestamp))
        out[key] = [(m.step, m.value) for m in history]
    cells = client.list_artifacts(run.info.run_id, "cells")
    out["cells"] = [int(os.path.basename(a.path)[5:12]) for a in sorted(cells, key=lambda a: a.path)]
    out["params"] = dict(run.data.params)
    out["runs"] = len(runs)
    out["status"] = run.info.status
    return out


def _wandb_records(path: str):
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", data[:7]
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        pending += chunk
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _finished(path: str) -> list:
    """The records of one offline run's file, once it holds the run's exit record (see the module's docstring)."""
    records: list = []
    deadline = time.monotonic() + HANG_S
    while not any(r.WhichOneof("record_type") == "exit" for r in records):
        assert time.monotonic() < deadline, f"{path} has no exit record after {HANG_S} s"
        time.sleep(0.05)
        records = list(_wandb_records(path))
    return records


def _wandb(folder, name: str) -> dict:
    """A run is its id; a run opened again (resumed) offline is one more folder of the same id, synced as one (W&B
    names it offline-run-TIME-ID, or offline-run-TIME-ID-1 within the same second: the id is read from the file)."""
    opened: dict[str, list] = {}  # run id -> its folders' records, in the order the folders were made
    for run in sorted(glob.glob(os.path.join(str(folder), "wandb", "offline-run-*"))):
        (path,) = glob.glob(os.path.join(run, "run-*.wandb"))
        records = _finished(path)
        run_id = next(r.run.run_id for r in records if r.WhichOneof("record_type") == "run")
        opened.setdefault(run_id, []).append((run, records))
    out: dict = {"params": {}, "runs": len(opened)}
    records = [r for _, folder_records in opened[name] for r in folder_records]
    for record in records:
        which = record.WhichOneof("record_type")
        if which == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            step = row.pop("nbdist/step")
            for key, value in row.items():
                if not key.startswith("_"):
                    out.setdefault(key, []).append((step, value))
        elif which == "config":
            for item in record.config.update:
                value = json.loads(item.value_json)
                out["params"][item.key] = value.get("value", value) if isinstance(value, dict) else value
    out["cells"] = [
        int(os.path.basename(c)[5:12])
        for run, _ in opened[name]
        for c in sorted(glob.glob(os.path.join(run, "files", "cells", "*")))
    ]
    return out


def _trackio(folder, name: str) -> dict:
    from trackio.sqlite_storage import SQLiteStorage

    project = place("trackio", folder)["project"]
    out: dict = {"cells": [], "runs": len(SQLiteStorage.get_runs(project))}
    for row in SQLiteStorage.get_logs(project, name):
        step = row["step"]
        for key, value in row.items():
            if key == "nbdist/cell":
                out["cells"].append(step)
            elif key not in ("step", "timestamp"):
                out.setdefault(key, []).append((step, value))
    config = SQLiteStorage.get_run_config(project, name) or {}
    out["params"] = {k: v for k, v in config.items() if not k.startswith("_")}  # trackio's own: _Created, ...
    return out
