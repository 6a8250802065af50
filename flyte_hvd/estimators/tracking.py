"""MLflow tracking of a distributed run: the driver opens the run before any rank starts (the
check that the tracking server answers and takes runs in the experiment), rank 0 logs into it.

An estimator fit (``mlflow=True`` or an ``MlflowConfig``) logs its parameters (from the
driver), each epoch's averaged metrics (step = epoch), the best checkpoint as an artifact and
the model in its framework's MLflow flavour, optionally registered. A ``HorovodSpark`` task
makes the run rank 0's active run while its body runs. MLflow is imported only here and only
when asked for (``pip install 'flyte-hvd[mlflow]'``; ``mlflow-skinny`` is enough).

With nothing set (no ``tracking_uri``, no ``MLFLOW_TRACKING_URI``), MLflow 3's own default is
``sqlite:///mlflow.db`` in the working directory. Its SQL store needs SQLAlchemy and alembic,
which ``mlflow-skinny`` (our extra, to keep images small) does not install: there the run goes
to MLflow's file store ``mlruns/`` in the working directory instead (what MLflow 2 used by
default; ``mlflow ui --backend-store-uri ./mlruns`` shows it), with one line saying so. Where
SQLAlchemy is installed the default stays MLflow's, as an absolute path: rank 0 runs in a
folder of its own, where a relative one would open another database.

Inside a Flyte execution a fit's (or task's) MLflow run carries the Flyte task's run as a tag:
a retry of the task continues the same MLflow run instead of opening a new one.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import socket
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from flyte_hvd.core.log import get_logger
from flyte_hvd.launch import progress

logger = get_logger(__name__)

# Seconds the driver waits for the tracking server to accept a connection: MLflow's own
# client retries a refused or silent server with backoff for minutes.
CONNECT_TIMEOUT = 5.0
_PARAM_CHARS = 6000  # MLflow's limit on a param value

# Logs the trained model in its framework's flavour: ``fn(mlflow, registered_model_name)``
# (what the flavour's ``log_model`` returns is not used).
ModelLogger = Callable[[ModuleType, str | None], object]


@dataclass(frozen=True)
class MlflowConfig:
    """Where and how a run is tracked. Fields left None take what MLflow itself would use:
    ``MLFLOW_TRACKING_URI`` and ``MLFLOW_EXPERIMENT_NAME`` (or ``MLFLOW_EXPERIMENT_ID``).

    Attributes:
        experiment: experiment name; created when it does not exist.
        run_name: the run's name (default: the estimator's ``run_id`` or the task's name).
        tags: tags of the run.
        registered_model_name: register the trained model under this name.
        tracking_uri: the tracking server (``http://host:5000``, ``databricks``) or store.
    """

    experiment: str | None = None
    run_name: str | None = None
    tags: Mapping[str, str] | None = None
    registered_model_name: str | None = None
    tracking_uri: str | None = None

    def __post_init__(self) -> None:
        for name in ("experiment", "run_name", "registered_model_name", "tracking_uri"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(
                    f"MlflowConfig `{name}` must be a non-empty str or None; found {value!r}."
                )
        tags = self.tags
        if tags is not None:
            if not isinstance(tags, Mapping) or not all(isinstance(k, str) for k in tags):
                raise ValueError(f"MlflowConfig `tags` must map str to values; found {tags!r}.")
            object.__setattr__(self, "tags", {k: str(v) for k, v in tags.items()})


def resolve_config(value: object) -> MlflowConfig | None:
    """An ``mlflow`` param or task setting as a config: None/False (off), True (MLflow's own
    settings) or an ``MlflowConfig``."""
    if value is None or value is False:
        return None
    if value is True:
        return MlflowConfig()
    if isinstance(value, MlflowConfig):
        return value
    raise ValueError(
        f"`mlflow` must be True (MLflow's own MLFLOW_TRACKING_URI and "
        f"MLFLOW_EXPERIMENT_NAME), an MlflowConfig(experiment=..., tracking_uri=...), or "
        f"False/None; found {value!r}."
    )


@dataclass(frozen=True)
class MlflowRun:
    """An open MLflow run, as plain values the ranks get: rank 0 logs into ``run_id``."""

    tracking_uri: str
    run_id: str
    experiment_id: str
    registered_model_name: str | None
    env: dict[str, str]  # the driver's MLFLOW_* settings, for the ranks


def import_mlflow() -> ModuleType:
    try:
        import mlflow
    except ImportError as error:
        raise RuntimeError(
            f"`mlflow` tracking needs MLflow, which is not installed here ({error}); install "
            f"it with `pip install 'flyte-hvd[mlflow]'` (or mlflow-skinny), or leave `mlflow` "
            f"unset."
        ) from error
    return mlflow


def start_run(config: MlflowConfig, default_name: str, params: dict[str, Any]) -> MlflowRun:
    """Open the run on the driver, before any rank starts, and log ``params``: an error says
    what is wrong if MLflow is missing, the tracking server does not answer, or it refuses
    a run in the experiment."""
    mlflow = import_mlflow()
    from mlflow import MlflowClient
    from mlflow.entities import Param

    uri = config.tracking_uri or default_tracking_uri(mlflow)
    _check_reachable(uri)
    _check_sql_store(uri)
    experiment = config.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME")
    experiment_id = os.environ.get("MLFLOW_EXPERIMENT_ID", "0")
    task_run = _task_run(default_name)
    try:
        client = MlflowClient(tracking_uri=uri)
        if experiment is not None:
            found = client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else client.create_experiment(experiment)
        run_id = _earlier_attempts_run(client, experiment_id, task_run)
        if run_id is None:
            tags = dict(config.tags or {})
            if task_run is not None:
                tags[TASK_RUN_TAG] = task_run
            run = client.create_run(
                experiment_id, run_name=config.run_name or default_name, tags=tags
            )
            run_id = run.info.run_id
            client.log_batch(run_id, params=[Param(k, _param_text(v)) for k, v in params.items()])
    except Exception as error:
        where = f"experiment `{experiment}`" if experiment else f"experiment id {experiment_id!r}"
        raise RuntimeError(
            f"MLflow at `{uri}` did not open a run in {where} ({type(error).__name__}: "
            f"{_first_line(error)}). Check that the account may create runs there (the "
            f"experiment's permissions), the `experiment` name, and the tracking URI "
            f"(MLFLOW_TRACKING_URI or MlflowConfig(tracking_uri=...)); no rank was started."
        ) from error
    env = {k: v for k, v in os.environ.items() if k.startswith("MLFLOW_")}
    env.update(MLFLOW_TRACKING_URI=uri)
    logger.info("MLflow run %s in experiment %s at %s", run_id, experiment_id, uri)
    return MlflowRun(uri, run_id, experiment_id, config.registered_model_name, env)


# The tag of an MLflow run opened inside a Flyte execution: the Flyte task's run it tracks
# (execution, node and the fit's run id or the task's name), the same in every attempt.
TASK_RUN_TAG = "flyte_hvd.task_run"


def default_tracking_uri(mlflow: ModuleType) -> str:
    """The tracking URI when ``MlflowConfig`` names none: MLflow's (``MLFLOW_TRACKING_URI``,
    which ``mlflow.set_tracking_uri`` sets too), else its default made to work here (see the
    module's docstring)."""
    uri = str(mlflow.get_tracking_uri())
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return uri
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme in ("", "file"):  # MLflow's default where ./mlruns holds runs already
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for the opt-in
        return pathlib.Path(os.path.abspath(parsed.path)).as_uri()
    if parsed.scheme != "sqlite":
        return uri
    if all(importlib.util.find_spec(name) for name in ("sqlalchemy", "alembic")):
        path = uri[len("sqlite:///") :]
        return f"sqlite:///{os.path.abspath(path)}"  # the ranks run in folders of their own
    fallback = pathlib.Path(os.path.abspath("mlruns")).as_uri()
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    logger.warning(
        "MLflow's default store %s needs SQLAlchemy and alembic, which mlflow-skinny does not "
        "install: this run is tracked in MLflow's file store %s instead. Set "
        "MLFLOW_TRACKING_URI (a tracking server, for runs on a cluster), or `pip install "
        "mlflow` for MLflow's default.",
        uri,
        fallback,
    )
    return fallback


def _task_run(name: str) -> str | None:
    """Inside a Flyte execution: the tag value that names this fit's (or task's) run in every
    attempt of the task; None outside one."""
    from flyte_hvd.launch import task_identity

    identity = task_identity.current()
    if identity is None:
        return None
    return f"{identity.execution}/{identity.node_key}/{name}"[:_PARAM_CHARS]


def _earlier_attempts_run(client: Any, experiment_id: str, task_run: str | None) -> str | None:
    """The MLflow run an earlier attempt of this Flyte task opened, set running again; None
    when there is none (or outside Flyte)."""
    if task_run is None:
        return None
    quoted = task_run.replace("'", "\\'")
    found = client.search_runs(
        [experiment_id], filter_string=f"tags.`{TASK_RUN_TAG}` = '{quoted}'", max_results=1
    )
    if not found:
        return None
    run_id = str(found[0].info.run_id)
    client.update_run(run_id, status="RUNNING")
    logger.info("MLflow run %s of an earlier attempt of this task: continued", run_id)
    return run_id


def end_run(run: MlflowRun | None, failed: bool) -> None:
    """The driver's end of the run: FAILED when the launch failed (rank 0 ends a successful
    run FINISHED itself). Never raises: the launch's own error matters more."""
    if run is None or not failed:
        return
    try:
        from mlflow import MlflowClient

        MlflowClient(tracking_uri=run.tracking_uri).set_terminated(run.run_id, "FAILED")
    except Exception as error:  # the server may be what failed
        logger.warning("could not mark MLflow run %s FAILED: %s", run.run_id, error)


def _check_reachable(uri: str) -> None:
    """A tracking server that refuses connections fails here in at most ``CONNECT_TIMEOUT``
    seconds, not after MLflow's minutes of retries."""
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme not in ("http", "https"):
        return
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname or "", port), timeout=CONNECT_TIMEOUT):
            pass
    except OSError as error:
        raise RuntimeError(
            f"the MLflow tracking server at `{uri}` is not reachable ({error}); start it, or "
            f"fix MLFLOW_TRACKING_URI / MlflowConfig(tracking_uri=...). No rank was started."
        ) from None


# The schemes of MLflow's SQL stores, which need SQLAlchemy and alembic (not in mlflow-skinny).
_SQL_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")


def _check_sql_store(uri: str) -> None:
    scheme = urllib.parse.urlparse(uri).scheme.split("+")[0]
    if scheme not in _SQL_SCHEMES:
        return
    missing = [n for n in ("sqlalchemy", "alembic") if importlib.util.find_spec(n) is None]
    if missing:
        raise RuntimeError(
            f"the MLflow tracking store `{uri}` is a SQL database, which MLflow opens with "
            f"{' and '.join(missing)}, not installed here (`mlflow-skinny` has no SQL store). "
            f"Install them with `pip install mlflow`, or set MLFLOW_TRACKING_URI / "
            f"MlflowConfig(tracking_uri=...) to a tracking server or a file: store. No rank "
            f"was started."
        )


def _param_text(value: object) -> str:
    return str(value)[:_PARAM_CHARS]


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def loggable_params(values: dict[str, Any]) -> dict[str, Any]:
    """Values that mean something as MLflow params: numbers, strings, booleans and short
    lists of them as they are; functions, classes and objects by their name."""
    out: dict[str, Any] = {}
    for name, value in values.items():
        if value is None or value == [] or value == {}:
            continue
        if isinstance(value, bool | int | float | str):
            out[name] = value
        elif isinstance(value, list | tuple) and all(
            isinstance(v, bool | int | float | str) for v in value
        ):
            out[name] = list(value)
        elif isinstance(value, list | tuple):
            out[name] = [_name_of(v) for v in value]
        else:
            out[name] = _name_of(value)
    return out


def _name_of(value: object) -> str:
    return getattr(value, "__name__", None) or type(value).__name__


# -- on rank 0 ---------------------------------------------------------------------------------


def enter_rank(run: MlflowRun, rank: int) -> ModuleType | None:
    """Every rank gets the tracking URI (and the driver's MLflow settings) in its environment;
    rank 0 also gets ``MLFLOW_RUN_ID`` and the run as MLflow's active run, so the user's own
    ``mlflow.log_*`` calls land there, and returns the ``mlflow`` module (the others None)."""
    os.environ.update(run.env)
    if rank != 0:
        return None
    os.environ["MLFLOW_RUN_ID"] = run.run_id
    mlflow = import_mlflow()
    mlflow.set_tracking_uri(run.tracking_uri)
    mlflow.start_run(run_id=run.run_id)
    progress.add_listener(lambda epoch: _log_epoch(mlflow, epoch))
    return mlflow


def pinned(*distributions: str) -> list[str]:
    """``name==version`` of each installed distribution: a logged model's pip requirements.
    MLflow would otherwise infer them by loading the model in a new process that imports the
    framework again (22 s against 0.2 s for a Keras model, measured on 2 loaded cores)."""
    from importlib import metadata

    found = []
    for name in distributions:
        try:
            found.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return found


def _log_epoch(mlflow: ModuleType, epoch: progress.Epoch) -> None:
    metrics = dict(epoch.metrics, epoch_seconds=epoch.seconds)
    mlflow.log_metrics(metrics, step=epoch.number - 1)


def log_outcome(
    mlflow: ModuleType, run: MlflowRun, checkpoint: str | None, log_model: ModelLogger | None
) -> None:
    """Rank 0, after training: the best checkpoint as an artifact (``checkpoint/``) and the
    model in its framework's flavour (``log_model(mlflow, registered_model_name)``)."""
    if checkpoint and os.path.exists(checkpoint):
        mlflow.log_artifact(checkpoint, artifact_path="checkpoint")
    if log_model is not None:
        log_model(mlflow, run.registered_model_name)


def leave_rank(mlflow: ModuleType | None, failed: bool) -> None:
    """Rank 0 ends the run: FINISHED, or FAILED when its training raised."""
    if mlflow is not None:
        mlflow.end_run("FAILED" if failed else "FINISHED")
