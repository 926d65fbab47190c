"""The four trackers' runs, each the same four calls for the writer thread (tracker.py's ``Run``): ``params`` once,
then ``scalars`` and ``cell`` (a cell's source where its steps begin) as the world trains, ``close`` at the end.
Each is opened by sinks.py, which checks its place first; each writes offline or locally unless told otherwise:

- TensorBoard: event files in one folder, written by nbdist (tfevents.py: torch's ``SummaryWriter`` costs six
  times as much), one event per step with all its tags, each batch written and flushed at once.
- MLflow: one run in an experiment of a tracking URI (a SQLite file by default: MLflow's file store is in
  maintenance); metrics batched (log_batch), the config as parameters, each cell's source as an artifact.
- Weights & Biases: one run, offline unless WANDB_MODE says otherwise or an API key is set; the run's x axis is
  ``nbdist/step`` (W&B's own step only grows, and a rank's step may come after another rank's later one).
- trackio: one run of a local project (TRACKIO_DIR), its calls made in a context of its own, so the notebook's
  own ``trackio.log`` does not land in nbdist's run.
"""

from __future__ import annotations

import contextvars
import json
import os
import re
import time
from collections import defaultdict
from typing import Any

from .steps import Point
from .tfevents import EventFile

STEP = "nbdist/step"  # W&B's x axis for every metric of the run


def _by_step(points: list[Point]) -> dict[int, dict[str, float]]:
    rows: dict[int, dict[str, float]] = defaultdict(dict)
    for tag, value, step in points:
        rows[step][tag] = value
    return rows


class _Cells:
    """A run's cell files, by the step where each begins, then in the order they ran (two cells may begin at the
    same step: a cell that logs nothing, then the next); a run opened again begins after its last step."""

    def __init__(self) -> None:
        self.cells = 0

    def next_name(self, step: int) -> str:
        self.cells += 1
        return f"cells/step-{step:07d}-{self.cells:04d}.py"


class TensorBoardRun:
    """A TensorBoard run: one folder of event files (one more each time it is opened again), written by nbdist
    (tfevents.py): one event per step with all its tags."""

    spec: dict[str, Any] = {}  # what opens it again (sinks.py): the options it was opened with

    def __init__(self, folder: str) -> None:
        self.where = folder
        self.events = EventFile(folder)

    def params(self, params: dict[str, Any]) -> None:
        self._text("nbdist/config", "```\n" + json.dumps(params, indent=1, default=str) + "\n```", 0)

    def scalars(self, points: list[Point]) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        self.events.summaries(
            [
                (step, Summary(value=[Summary.Value(tag=tag, simple_value=value) for tag, value in row.items()]))
                for step, row in sorted(_by_step(points).items())
            ]
        )

    def cell(self, code: str, step: int) -> None:
        self._text("nbdist/cell", "```python\n" + code + "\n```", step)

    def _text(self, tag: str, text: str, step: int) -> None:
        from torch.utils.tensorboard.summary import text as summary  # TensorBoard's text plugin, as add_text makes it

        self.events.summaries([(step, summary(tag, text))])

    def close(self) -> None:
        self.events.close()


MLFLOW_KEY = re.compile(r"[^\w\-. :/]")  # what MLflow refuses in a metric or parameter name
MLFLOW_BATCH = 1000  # metrics per log_batch, MLflow's limit
MLFLOW_PARAMS = 100  # parameters per log_batch
MLFLOW_VALUE = 6000  # a parameter's value, at most (characters)


class MLflowRun(_Cells):
    """An MLflow run, through ``MlflowClient`` (nothing of mlflow's global active run is touched)."""

    def __init__(self, client: Any, run_id: str, where: str, uri: str) -> None:
        super().__init__()
        self.client, self.run_id, self.where = client, run_id, where
        self.spec = {"run_id": run_id, "uri": uri}

    def params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(MLFLOW_KEY.sub("_", k), str(v)[:MLFLOW_VALUE]) for k, v in params.items()]
        for i in range(0, len(items), MLFLOW_PARAMS):
            self.client.log_batch(self.run_id, params=items[i : i + MLFLOW_PARAMS])

    def scalars(self, points: list[Point]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(MLFLOW_KEY.sub("_", tag), value, now, step) for tag, value, step in points]
        for i in range(0, len(items), MLFLOW_BATCH):
            self.client.log_batch(self.run_id, metrics=items[i : i + MLFLOW_BATCH], synchronous=True)

    def cell(self, code: str, step: int) -> None:
        self.client.log_text(self.run_id, code, self.next_name(step))

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class WandbRun(_Cells):
    """A Weights & Biases run, created apart from the notebook's own (``reinit="create_new"``)."""

    def __init__(self, run: Any, where: str) -> None:
        super().__init__()
        self.run, self.where = run, where
        self.spec: dict[str, Any] = {}
        run.define_metric(STEP)
        run.define_metric("*", step_metric=STEP)

    def params(self, params: dict[str, Any]) -> None:
        self.run.config.update(params, allow_val_change=True)

    def scalars(self, points: list[Point]) -> None:
        for step, row in sorted(_by_step(points).items()):
            self.run.log({**row, STEP: step})

    def cell(self, code: str, step: int) -> None:  # a file of the run's, uploaded with it
        path = os.path.join(self.run.dir, self.next_name(step))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as fh:
            fh.write(code)

    def close(self) -> None:
        self.run.finish()


class TrackioRun:
    """A trackio run: each call in the context the run was made in (trackio keeps its current run there)."""

    def __init__(self, context: contextvars.Context, run: Any, where: str) -> None:
        self.context, self.run, self.where = context, run, where
        self.spec: dict[str, Any] = {}

    def params(self, params: dict[str, Any]) -> None:
        pass  # given to trackio.init (sinks.py): a run's config is set when it is made

    def scalars(self, points: list[Point]) -> None:
        for step, row in sorted(_by_step(points).items()):
            self.context.run(self.run.log, row, step=step)

    def cell(self, code: str, step: int) -> None:
        import trackio

        self.context.run(self.run.log, {"nbdist/cell": trackio.Markdown("```python\n" + code + "\n```")}, step=step)

    def close(self) -> None:
        self.context.run(self.run.finish)
