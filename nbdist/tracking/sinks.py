"""Opening a tracker's run (``open_run``), checked first: an unknown tracker, one not installed, an option it does
not take, a place that cannot be written, a run name already taken: one line each, naming the fix, before anything
is written (runs.py holds the runs themselves).

Where each run goes by default, offline: TensorBoard ``runs/NAME`` (TensorBoard's own habit); MLflow a SQLite
file, ``mlruns/mlflow.db``, its artifacts beside it (or ``--uri``, any MLflow tracking URI); W&B ``./wandb``,
offline without an API key; trackio its local directory (TRACKIO_DIR, or ``--dir``). A run's name defaults to
``nbdist-`` and the date and time; the project (MLflow's experiment) to ``nbdist``.
"""

from __future__ import annotations

import contextvars
import glob
import os
import re
import sys
import time
from typing import Any

from ..config.values import did_you_mean
from ..errors import ConfigError
from . import runs

KINDS = ("tensorboard", "mlflow", "wandb", "trackio")
EXTRA = 'pip install "nbdist[track]"'
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # a run name every tracker takes (W&B's id among them)
PROJECT = "nbdist"
WANDB_MODES = ("online", "offline", "shared", "disabled", "dryrun", "run")


def open_run(
    kind: str,
    name: str | None = None,
    folder: str | None = None,
    project: str | None = None,
    uri: str | None = None,
    params: dict[str, Any] | None = None,
) -> Any:
    """A new run of tracker ``kind`` named ``name`` (a dated one when None), checked before anything is written.
    ``params`` are for trackio, whose run takes its config when it is made (the others get it from the tracker)."""
    if kind not in KINDS:
        raise ConfigError(f"{kind!r} is not a tracker nbdist knows; {did_you_mean(kind, KINDS)}")
    if uri is not None and kind != "mlflow":
        raise ConfigError(f"--uri is MLflow's tracking URI; {kind} takes --dir instead.")
    if project is not None and kind == "tensorboard":
        raise ConfigError("TensorBoard has no projects: a run is a folder; give --dir (and a name) instead.")
    name = _word("run name", name or time.strftime("nbdist-%Y%m%d-%H%M%S"), f"%dist_track {kind} mnist-ddp")
    project = _word("project", project or PROJECT, "--project mnist")
    return _open({"kind": kind, "name": name, "folder": folder, "project": project, "uri": uri}, params or {})


def _word(what: str, value: str, example: str) -> str:
    if not NAME.fullmatch(value):
        raise ConfigError(
            f"{what} {value!r} is not one word of letters, digits, '.', '_' or '-'; give one such as {example}."
        )
    return value


def reopen(spec: dict[str, Any]) -> Any:
    """The run ``spec`` describes (a run's ``spec``), opened again to go on: its world's kernel was restarted."""
    return _open(spec, {}, again=True)


def _open(spec: dict[str, Any], params: dict[str, Any], again: bool = False) -> Any:
    kind, folder = spec["kind"], spec["folder"]
    if again and kind == "trackio" and "trackio" not in sys.modules:
        os.environ["TRACKIO_DIR"] = spec["trackio_dir"]  # where the run is, whatever this kernel's environment says
    if kind == "trackio" and folder is not None and "trackio" not in sys.modules:
        os.environ["TRACKIO_DIR"] = _writable(folder, "--dir")  # read by trackio once, when imported
    _importable(kind)
    if kind == "tensorboard":
        run: Any = _tensorboard(spec["name"], folder, again)
    elif kind == "mlflow":
        run = _mlflow(spec["name"], folder, spec["project"], spec["uri"], spec.get("run_id"))
    elif kind == "wandb":
        run = _wandb(spec["name"], folder, spec["project"], again)
    else:
        run = _trackio(spec["name"], folder, spec["project"], params, again)
    run.spec = {**spec, "folder": _absolute(folder), **run.spec}
    return run


def _absolute(folder: str | None) -> str | None:
    return os.path.abspath(folder) if folder is not None else None  # a new kernel may start elsewhere


def _importable(kind: str) -> None:
    module = "torch.utils.tensorboard" if kind == "tensorboard" else kind
    try:
        __import__(module)
    except ImportError as exc:
        raise ConfigError(
            f"%dist_track {kind} needs the {kind} package, which is not installed in {sys.executable} "
            f"({exc}); {EXTRA} (or pip install {kind}), then run %dist_track again."
        ) from None


def _writable(path: str, flag: str) -> str:
    path = os.path.abspath(path)
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".nbdist-probe-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as exc:
        raise ConfigError(
            f"{flag} {path} cannot be written ({exc.strerror or exc}); give a folder you can write to, such as "
            f"{flag} runs."
        ) from None
    return path


def _first_line(exc: BaseException) -> str:
    """A tracker's own error in one line (the first of its message, or its type)."""
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def _taken(name: str, where: str) -> ConfigError:
    return ConfigError(f"the run name {name!r} is taken in {where}; give another name, or remove that run first.")


def _tensorboard(name: str, folder: str | None, again: bool) -> runs.TensorBoardRun:
    base = os.path.abspath(folder or "runs")
    path = os.path.join(base, name)
    if not again and os.path.isdir(path) and any(f.startswith("events.out.tfevents") for f in os.listdir(path)):
        raise _taken(name, f"{base} (its events are in {path})")
    return runs.TensorBoardRun(_writable(path, "--dir"))


def _mlflow(name: str, folder: str | None, project: str, uri: str | None, again: str | None) -> runs.MLflowRun:
    """A new MLflow run; with ``again`` (its id), that run, running again."""
    from mlflow import MlflowClient

    artifacts = None
    if uri is None:
        base = _writable(folder or "mlruns", "--dir")
        uri, artifacts = f"sqlite:///{os.path.join(base, 'mlflow.db')}", os.path.join(base, "artifacts")
    elif folder is not None and not again:
        raise ConfigError(
            "give MLflow either --uri (its tracking URI) or --dir (a folder for a SQLite store), not both."
        )
    try:
        client = MlflowClient(tracking_uri=uri)
        if again:
            client.update_run(again, status="RUNNING")
            return runs.MLflowRun(client, again, f"{uri} (experiment {project!r}, run {name!r})", uri)
        experiment = client.get_experiment_by_name(project)
        eid = experiment.experiment_id if experiment else client.create_experiment(project, artifact_location=artifacts)
        if client.search_runs([eid], filter_string=f"attributes.run_name = '{name}'", max_results=1):
            raise _taken(name, f"MLflow's experiment {project!r} at {uri}")
        run = client.create_run(eid, run_name=name, tags={"nbdist.world": "1"})
    except ConfigError:
        raise
    except Exception as exc:  # MLflow's own: a URI it cannot open or write
        first = _first_line(exc)
        raise ConfigError(
            f"MLflow cannot open a run at {uri} ({first}); give --uri a tracking URI you can write to, such as "
            "--uri sqlite:///mlruns/mlflow.db, or --dir a folder."
        ) from None
    return runs.MLflowRun(client, run.info.run_id, f"{uri} (experiment {project!r}, run {name!r})", uri)


def _wandb_mode() -> str:
    """W&B's mode: WANDB_MODE when set, else online where an API key is (W&B's netrc login too), else offline."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        import netrc

        return "online" if netrc.netrc().authenticators("api.wandb.ai") else "offline"
    except (OSError, netrc.NetrcParseError):
        return "offline"


def _wandb(name: str, folder: str | None, project: str, again: bool) -> runs.WandbRun:
    import wandb

    base = _writable(folder or ".", "--dir")
    local = glob.glob(os.path.join(base, "wandb", f"*-{name}"))
    if local and not again:
        raise _taken(name, f"{os.path.join(base, 'wandb')} ({os.path.basename(local[0])})")
    mode: Any = _wandb_mode()
    if mode not in WANDB_MODES:
        raise ConfigError(f"WANDB_MODE={mode!r} is not a W&B mode; {did_you_mean(mode, WANDB_MODES)}")
    settings = wandb.Settings(mode=mode, silent=True, console="off", x_disable_stats=True, x_disable_meta=True)
    try:
        run = wandb.init(
            project=project,
            name=name,
            id=name,
            dir=base,
            settings=settings,
            reinit="create_new",
            resume="allow" if again else "never",
        )
    except Exception as exc:  # W&B's own: an id taken online, a login refused
        first = _first_line(exc)
        raise ConfigError(
            f"W&B cannot start the run {name!r} in project {project!r} ({mode}: {first}); give another name, or "
            "WANDB_MODE=offline to keep it on this machine."
        ) from None
    return runs.WandbRun(run, f"{run.dir.removesuffix('/files')} ({mode}, project {project!r})")


def _trackio(name: str, folder: str | None, project: str, params: dict[str, Any], again: bool) -> runs.TrackioRun:
    if folder is not None:  # trackio read TRACKIO_DIR once, when imported: was it this folder?
        from trackio import utils

        wanted = _writable(folder, "--dir")
        if os.path.abspath(str(utils.TRACKIO_DIR)) != wanted:
            raise ConfigError(
                f"trackio keeps its runs in {utils.TRACKIO_DIR} in this kernel (TRACKIO_DIR, read when trackio was "
                f"imported); set TRACKIO_DIR={wanted} before the kernel starts, or leave out --dir."
            )
    import trackio
    from trackio.sqlite_storage import SQLiteStorage

    where = f"{trackio.utils.TRACKIO_DIR} (project {project!r})"
    if not again and name in SQLiteStorage.get_runs(project):
        raise _taken(name, f"trackio's {where}")
    context = contextvars.Context()  # trackio's current run is set there, not in the notebook's context
    try:
        run = context.run(
            trackio.init,
            project=project,
            name=name,
            config=params,
            embed=False,
            auto_log_cpu=False,
            auto_log_gpu=False,
            resume="allow" if again else "never",
        )
    except Exception as exc:
        first = _first_line(exc)
        raise ConfigError(f"trackio cannot start the run {name!r} in {where} ({first}).") from None
    tracked = runs.TrackioRun(context, run, where)
    tracked.spec = {"trackio_dir": str(trackio.utils.TRACKIO_DIR)}
    return tracked
