"""The Rossmann pipeline's steps, free of any Flyte SDK: the flytekit workflow
(``workflows/rossmann.py``) and the Flyte 2 one (``workflows/rossmann_flyte2.py``) are thin
task wrappers around these functions, so both read the same data, train the same model the
same way and report the same numbers.
"""

from __future__ import annotations

import datetime
import os
import sys
import tempfile
import uuid
import warnings
from dataclasses import dataclass
from typing import Any

import fsspec
from dataclasses_json import dataclass_json

from flyte_hvd.spark import quiet_local_conf

# Every module the tasks import, loaded with this one: `pyflyte run --remote` (`--copy auto`)
# ships only the workflow's modules loaded when its file is imported, and the tasks, Spark's
# Python workers and the ranks import these in the pods.
from workflows import rossmann_data, rossmann_features, rossmann_model  # noqa: F401

# The Store prefix when none is given. Registering with FLYTE_HVD_WORK_DIR=s3://bucket/prefix
# makes that the default of the pipeline and of its scheduled retraining.
DEFAULT_WORK_DIR = os.environ.get("FLYTE_HVD_WORK_DIR") or os.path.join(
    tempfile.gettempdir(), "flyte-hvd", "rossmann"
)
SYNTHETIC = "synthetic"
LATEST = "latest"
LABEL = "Sales"
VALIDATION = "Validation"

# The weekly retraining: Mondays 03:00 UTC, from the newest run's checkpoint.
RETRAIN_NAME = "rossmann_weekly_retrain"
RETRAIN_CRON = "0 3 * * 1"
RETRAIN_INPUTS = {"warm_start": LATEST}

# Settings for the Spark tasks. On Kubernetes the SparkApplication gets them; a local run's
# session gets them too. Training needs a task slot per rank (hp.num_proc): the launcher
# checks the slots before any rank starts. Memory is the deployment's (the propeller
# defaults in k8s/, smaller in the sandbox): a task's setting would override them.
SPARK_CONF = {
    "spark.sql.shuffle.partitions": "8",
    "spark.executor.instances": "2",
    "spark.executor.cores": "1",
    "spark.dynamicAllocation.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
}


# The JVM of a local run; spark-submit reads SPARK_DRIVER_MEMORY when no setting names it.
LOCAL_DRIVER_MEMORY = "4g"


def use_local_spark() -> None:
    """For a local run: the SDKs bind Spark's driver to 127.0.0.1 but let it advertise the
    host's address, where nothing listens, so fetching a broadcast or shuffle block would fail.
    Spark (and its JVM, started by the first Spark task) advertises SPARK_LOCAL_IP instead.
    Spark's Python workers, and so the ranks, must be this interpreter (with flyte_hvd and
    TensorFlow), not whichever `python3` comes first on PATH.

    In a container of its own (a driver whose executors run elsewhere), SPARK_DRIVER_BIND_ADDRESS
    (the image's variable for a driver) is where the driver listens instead of 127.0.0.1, which
    the SDKs set and which executors in other network namespaces cannot reach."""
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    # A local master runs the executors in the driver's JVM: it gets the memory of both.
    os.environ.setdefault("SPARK_DRIVER_MEMORY", LOCAL_DRIVER_MEMORY)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    SPARK_CONF.update(quiet_local_conf())  # the console: Spark's errors, no import notices
    # pyspark 4.x warns that it does not fully support pandas 3 at every conversion; this
    # pipeline's conversions are tested on pandas 3 (lock/), so the notice says nothing here.
    warnings.filterwarnings(
        "ignore", "PySpark does not yet fully support pandas >= 3", FutureWarning
    )
    if os.environ.get("SPARK_DRIVER_BIND_ADDRESS"):
        SPARK_CONF["spark.driver.bindAddress"] = os.environ["SPARK_DRIVER_BIND_ADDRESS"]


@dataclass_json
@dataclass
class Hyperparameters:
    """Training settings. The learning rate is the single-rank one; ranks scale it."""

    batch_size: int = 256
    sample_rate: float = 1.0
    learning_rate: float = 2e-3
    num_proc: int = 2
    epochs: int = 5
    seed: int = 0
    # Keras' output on rank 0: 2 one line per epoch (a task's log, read after the fact), 1 the
    # progress bar redrawn during the epoch, 0 none. flyte-hvd's own line per epoch (metrics,
    # pace, time left) comes with 1 and 2.
    verbose: int = 2

    def __post_init__(self) -> None:
        for name in ("batch_size", "num_proc", "epochs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Hyperparameters.{name} must be an int >= 1; found {value!r}.")
        if isinstance(self.verbose, bool) or self.verbose not in (0, 1, 2):
            raise ValueError(
                f"Hyperparameters.verbose must be 0 (silent), 1 (Keras' progress bar) or 2 "
                f"(one line per epoch); found {self.verbose!r}."
            )
        if not 0 < self.sample_rate <= 1:
            raise ValueError(
                f"Hyperparameters.sample_rate must be in (0, 1] (the fraction of training rows "
                f"kept); found {self.sample_rate}."
            )
        if not self.learning_rate > 0:
            raise ValueError(
                f"Hyperparameters.learning_rate must be > 0; found {self.learning_rate}."
            )


DEFAULT_HP = Hyperparameters()


# -- the steps ----------------------------------------------------------------------------


def download(dataset: str, dest: str) -> str:
    """The seven CSV files in ``dest``: ``synthetic`` generates them; otherwise an archive URL
    (``http(s)://``, ``s3://``, ``file://``; ``.tgz``/``.tar.gz``/``.zip``) or a directory."""
    from workflows.rossmann_data import fetch_dataset, write_synthetic

    if dataset == SYNTHETIC:
        return write_synthetic(dest)
    return fetch_dataset(dataset, dest)


def check_work_dir(work_dir: str, on_cluster: bool) -> str:
    """The Store prefix, checked before any Spark work: it must be writable, and not a local
    path in an execution on a cluster (it would vanish with the pod, and a warm start would
    never find it)."""
    from flyte_hvd.data.store import DBFSLocalStore, LocalStore, Store

    store = Store.create(work_dir)
    pod_local = isinstance(store, LocalStore) and not isinstance(store, DBFSLocalStore)
    if on_cluster and pod_local:
        raise ValueError(
            f"work_dir {work_dir!r} is a local path, but this execution runs on a cluster: what "
            f"it writes is lost with the pod. Pass --work_dir s3://bucket/prefix, or register "
            f"with FLYTE_HVD_WORK_DIR=s3://bucket/prefix to make that the default."
        )
    return store.prefix_path


@dataclass
class Features:
    """What feature preparation hands on: Spark DataFrames (cached) and plain values."""

    train: Any  # feature columns, Sales (log), Date, Validation
    test: Any  # feature columns, Id, Date, Open
    vocab: dict[str, list[str]]
    max_sales: float
    mean_sales: float
    baseline_rmspe: float  # the naive forecast's, on the validation rows


def prepare_features(spark: Any, directory: str, hp: Hyperparameters) -> Features:
    """Feature preparation in Spark, and the naive baseline's validation RMSPE."""
    from workflows.rossmann_data import check_dataset
    from workflows.rossmann_features import baseline_rmspe, prepare_frames

    check_dataset(directory)
    train_df, test_df, vocab, max_sales, mean_sales = prepare_frames(
        spark, directory, sample_rate=hp.sample_rate, seed=hp.seed
    )
    train_df, test_df = train_df.cache(), test_df.cache()
    baseline = baseline_rmspe(train_df)
    return Features(train_df, test_df, vocab, max_sales, mean_sales, baseline)


def new_run_id(store: Any = None) -> str:
    """A run id that sorts by its UTC start time (``latest`` picks the largest). Inside a Flyte
    execution, given the ``store``, the task's own: its suffix derives from the execution and
    the node, and the run an earlier attempt of the task started is resumed
    (``flyte_hvd.estimators.runs.task_run_id``)."""
    from flyte_hvd.estimators.runs import task_run_id

    started = f"rossmann-{datetime.datetime.now(datetime.UTC):%Y%m%d-%H%M%S}"
    own = task_run_id(store, lambda key: f"{started}-{key}") if store is not None else None
    return own or f"{started}-{uuid.uuid4().hex[:6]}"


# What Flyte may do with the pipeline's tasks (both SDKs). A retry of ``train`` resumes its
# run from the last completed epoch (at most one epoch of work lost), so it may run on
# preemptible nodes; every task is bounded, so a stuck one frees its pods.
RETRIES = 2
TRAIN_RETRIES = 3
TASK_TIMEOUT = datetime.timedelta(hours=1)
TRAIN_TIMEOUT = datetime.timedelta(hours=12)
PIPELINE_TIMEOUT = datetime.timedelta(hours=18)  # Flyte 2's parent task waits for all of them


def start_model(store: Any, warm_start: str, vocab: dict[str, list[str]], max_sales: float,
                mean_sales: float, seed: int) -> Any:  # fmt: skip
    """The model training starts from: ``warm_start``'s checkpoint, or fresh weights."""
    from workflows.rossmann_model import build_model

    return initial_model(store, warm_start) or build_model(vocab, max_sales, mean_sales, seed=seed)


def initial_model(store: Any, warm_start: str) -> Any:
    """The model to continue from, or None for fresh weights.

    ``warm_start``: empty to start from fresh weights, ``latest`` for the newest run's
    checkpoint under the Store (fresh weights if there is none), or a checkpoint's URI."""
    import keras

    from workflows.rossmann_model import CUSTOM_OBJECTS

    if not warm_start:
        return None
    uri = warm_start
    if warm_start == LATEST:
        runs = [r for r in _run_ids(store) if store.exists(store.get_checkpoint_path(r, ".keras"))]
        if not runs:
            print(f"warm start: no checkpoint under {store.get_runs_path()}; fresh weights")
            return None
        uri = store.get_checkpoint_path(max(runs), ".keras")  # run ids start with their UTC time
    fs, path = fsspec.core.url_to_fs(uri)
    if not fs.exists(path):
        raise FileNotFoundError(
            f"warm_start checkpoint {uri!r} does not exist. Pass the checkpoint_uri of an "
            f"earlier run, '{LATEST}', or '' for fresh weights."
        )
    with tempfile.TemporaryDirectory() as tmp:
        local = os.path.join(tmp, "checkpoint.keras")
        fs.get(path, local)
        print(f"warm start from {uri}")
        return keras.models.load_model(local, custom_objects=CUSTOM_OBJECTS)


def _run_ids(store: Any) -> list[str]:
    runs = store.get_runs_path()
    if not store.exists(runs):
        return []
    return [os.path.basename(p.rstrip("/")) for p in store.fs.ls(store.fs_path(runs), detail=False)]


def training_settings(hp: Hyperparameters) -> dict[str, Any]:
    """How the model trains, as ``KerasEstimator`` parameters: Adam at the single-rank rate
    (ranks scale it), MAE on log sales, the RMSPE metric, the best epoch by validation loss."""
    import keras

    from flyte_hvd.keras.callbacks import BestModelCheckpoint
    from workflows.rossmann_features import FEATURE_COLS
    from workflows.rossmann_model import CUSTOM_OBJECTS, exp_rmspe

    return dict(
        optimizer=keras.optimizers.Adam(hp.learning_rate, epsilon=1e-3),
        loss="mae",
        metrics=[exp_rmspe],
        custom_objects=CUSTOM_OBJECTS,
        feature_cols=FEATURE_COLS,
        label_cols=[LABEL],
        batch_size=hp.batch_size,
        epochs=hp.epochs,
        verbose=hp.verbose,
        random_seed=hp.seed,
        checkpoint_callback=BestModelCheckpoint(monitor="val_loss"),
    )


def best_epoch(history: dict[str, list[float]]) -> int:
    """The index of the epoch with the lowest validation loss."""
    return min(range(len(history["val_loss"])), key=history["val_loss"].__getitem__)


def keras_model(model_bytes: bytes, run_id: str) -> Any:
    """A trained model (``.keras`` bytes) as the Spark transformer that adds ``Predicted``."""
    from flyte_hvd.estimators.keras import KerasModel
    from workflows.rossmann_features import FEATURE_COLS
    from workflows.rossmann_model import CUSTOM_OBJECTS

    return KerasModel(
        model_bytes=model_bytes,
        feature_columns=FEATURE_COLS,
        label_columns=[LABEL],
        custom_objects=CUSTOM_OBJECTS,
        run_id=run_id,
    ).setOutputCols(["Predicted"])


def score_validation(model: Any, train_df: Any) -> tuple[int, float]:
    """``(rows, RMSPE)`` of the model on every validation row, as the baseline is scored."""
    from pyspark.sql import functions as F

    from workflows.rossmann_features import rmspe

    validation = model.transform(train_df.filter(F.col(VALIDATION)))
    scored = validation.select(F.exp(LABEL).alias("Actual"), F.exp("Predicted").alias("Forecast"))
    return scored.count(), rmspe(scored, "Actual", "Forecast")


def write_submission(model: Any, test_df: Any, path: str, store: Any, run_id: str) -> None:
    """Sales for the test rows (0 where the store is closed) as ``submission.csv`` (``Id,Sales``
    sorted by ``Id``) at ``path``, also written to the run's folder in the Store."""
    from workflows.rossmann_features import submission_sales

    predicted = model.transform(test_df).select("Id", submission_sales().alias(LABEL))
    predicted.orderBy("Id").toPandas().to_csv(path, index=False, float_format="%.1f")
    store.upload_file(path, submission_uri(store, run_id))


def submission_uri(store: Any, run_id: str) -> str:
    return store.join(store.get_run_path(run_id), "submission.csv")


@dataclass
class Summary:
    text: str  # the lines to print
    test_rows: int  # rows of submission.csv, one per test Id
    closed_test_rows: int  # of which predicted closed (Sales exactly 0)
    submission_uri: str


def report_repr(run_id: str, val_rmspe: float, baseline_rmspe: float) -> str:
    """How a pipeline's ``Report`` prints: `pyflyte run` and `flyte run` print the outputs, and
    the summary printed before them has every path; here the run and its scores."""
    return (
        f"Report(run_id={run_id!r}, val_rmspe={val_rmspe:.4f}, baseline_rmspe={baseline_rmspe:.4f})"
    )


def summarize(val_rmspe: float, best: int, baseline_rmspe: float, validation_rows: int,
              submission: str, store: Any, run_id: str,
              checkpoint_uri: str) -> Summary:  # fmt: skip
    """One line to compare with the baseline, how many test rows were predicted closed (a
    glance catches a pipeline that reads no store as closed), and where the outputs are."""
    import pandas as pd

    sales = pd.read_csv(submission).Sales
    closed = int((sales == 0).sum())
    uri = submission_uri(store, run_id)
    verdict = "beats" if val_rmspe < baseline_rmspe else "does NOT beat"
    text = (
        f"validation RMSPE {val_rmspe:.4f} (best epoch {best}) {verdict} "
        f"the per-store, per-weekday median baseline's {baseline_rmspe:.4f} on the same "
        f"{validation_rows} rows\n"
        f"test rows:  {len(sales)} predicted, {closed} of them closed (Sales 0), "
        f"{len(sales) - closed} open\n"
        f"model:      {checkpoint_uri}\n"
        f"submission: {uri}\n"
        f"logs:       {store.get_logs_path(run_id)}  (tensorboard --logdir ...)"
    )
    return Summary(text, len(sales), closed, uri)


def training_curves_html(history: dict[str, list[float]], best: int) -> str:
    """Loss and RMSPE per epoch, training and validation, as inline SVG charts."""
    from flyte_hvd.estimators.report import training_curves_html as curves

    return curves(history, best, {"loss": "loss (MAE of log sales)", "exp_rmspe": "RMSPE"})
