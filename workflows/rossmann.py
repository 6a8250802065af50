"""Rossmann store sales: prepare with Spark, train on many ranks, predict, as a Flyte workflow.

    pyflyte run workflows/rossmann.py horovod_spark_wf                        # synthetic data
    pyflyte run workflows/rossmann.py horovod_spark_wf --dataset /data/rossmann \\
        --hp '{"epochs": 20, "num_proc": 4}' --work_dir s3://bucket/rossmann

Tasks: ``download_data`` (cached) -> ``prepare`` (Spark) -> ``train`` (Spark, ``KerasEstimator``
on ``hp.num_proc`` ranks, an executor per rank through ``train_on_ranks``) -> ``predict`` (Spark,
``transform``) -> ``summarize``. ``work_dir`` is the Store prefix: prepared data, checkpoints,
TensorBoard logs, the model and the submission land under it (``<work_dir>/runs/<run_id>/``).
The launch plan ``rossmann_weekly_retrain`` retrains every Monday, warm-starting from the newest
run's checkpoint under ``work_dir``.
"""

from __future__ import annotations

import datetime
import os
import sys
import tempfile
import uuid
from dataclasses import dataclass, field
from typing import NamedTuple

import fsspec
from dataclasses_json import dataclass_json
from flytekit import CronSchedule, LaunchPlan, current_context, dynamic, task, workflow
from flytekit.types.directory import FlyteDirectory
from flytekit.types.file import FlyteFile
from flytekit.types.structured import StructuredDataset
from flytekitplugins.spark import Spark

from flyte_hvd.flyte.shipping import ship_package

# The Store prefix when none is given. Registering with FLYTE_HVD_WORK_DIR=s3://bucket/prefix
# makes that the default of the workflow and of its scheduled launch plan.
DEFAULT_WORK_DIR = os.environ.get("FLYTE_HVD_WORK_DIR") or os.path.join(
    tempfile.gettempdir(), "flyte-hvd", "rossmann"
)
SYNTHETIC = "synthetic"
LATEST = "latest"

# Settings for the Spark tasks. Locally flytekit starts local[*] with these; on Kubernetes the
# SparkApplication gets them. `train` needs a task slot per rank (hp.num_proc): train_on_ranks
# sets its executors from hp, and the launcher checks the slots before any rank starts.
SPARK_CONF = {
    "spark.sql.shuffle.partitions": "8",
    "spark.driver.memory": "4g",
    "spark.executor.instances": "2",
    "spark.executor.cores": "1",
    "spark.executor.memory": "4g",
    "spark.dynamicAllocation.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
}


def _remote_execution() -> bool:
    """Whether this task runs in a Flyte execution on a cluster (not ``pyflyte run``)."""
    return "FLYTE_INTERNAL_EXECUTION_ID" in os.environ


if not _remote_execution():
    # A local run: flytekit binds Spark's driver to 127.0.0.1 but lets it advertise the host's
    # address, where nothing listens, so fetching a broadcast or shuffle block would fail.
    # Spark (and its JVM, started by the first Spark task) advertises SPARK_LOCAL_IP instead.
    # Spark's Python workers, and so the ranks, must be this interpreter (with flyte_hvd and
    # TensorFlow), not whichever `python3` comes first on PATH.
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)


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

    def __post_init__(self) -> None:
        for name in ("batch_size", "num_proc", "epochs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Hyperparameters.{name} must be an int >= 1; found {value!r}.")
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


@dataclass
class TrainResult:
    """What ``train`` produces: the best model, its history and where its run lives."""

    model: FlyteFile
    history: dict[str, list[float]]
    best_epoch: int
    best_val_rmspe: float  # the exp_rmspe metric at the best epoch (Keras' batch average)
    val_rmspe: float  # RMSPE of the best model over all validation rows
    validation_rows: int
    run_id: str
    checkpoint_uri: str


@dataclass
class Report:
    val_rmspe: float
    baseline_rmspe: float
    validation_rows: int
    run_id: str
    checkpoint_uri: str
    submission_uri: str
    model: FlyteFile
    submission: FlyteFile
    test_rows: int  # rows of submission.csv, one per test Id
    closed_test_rows: int  # of which predicted closed (Sales exactly 0)
    history: dict[str, list[float]] = field(default_factory=dict)


class Prepared(NamedTuple):
    train: StructuredDataset
    test: StructuredDataset
    vocab: dict[str, list[str]]
    max_sales: float
    mean_sales: float
    baseline_rmspe: float


@task(cache=True, cache_version="1")
def download_data(dataset: str = SYNTHETIC) -> FlyteDirectory:
    """The seven CSV files: ``synthetic`` generates them; otherwise an archive URL
    (``http(s)://``, ``s3://``, ``file://``; ``.tgz``/``.tar.gz``/``.zip``) or a directory."""
    from workflows.rossmann_data import fetch_dataset, write_synthetic

    dest = os.path.join(current_context().working_directory, "rossmann")
    if dataset == SYNTHETIC:
        write_synthetic(dest)
    else:
        fetch_dataset(dataset, dest)
    return FlyteDirectory(dest)


@task
def check_work_dir(work_dir: str) -> str:
    """Fail before any Spark work when the Store prefix cannot be written, or when a remote
    execution was given a local path (it would vanish with the pod, and a warm start would
    never find it)."""
    from flyte_hvd.data.store import DBFSLocalStore, LocalStore, Store

    store = Store.create(work_dir)
    pod_local = isinstance(store, LocalStore) and not isinstance(store, DBFSLocalStore)
    if _remote_execution() and pod_local:
        raise ValueError(
            f"work_dir {work_dir!r} is a local path, but this execution runs on a cluster: what "
            f"it writes is lost with the pod. Pass --work_dir s3://bucket/prefix, or register "
            f"with FLYTE_HVD_WORK_DIR=s3://bucket/prefix to make that the default."
        )
    return store.prefix_path


@task(task_config=Spark(spark_conf=SPARK_CONF))
def prepare(data: FlyteDirectory, hp: Hyperparameters) -> Prepared:
    """Feature preparation in Spark, and the naive baseline's validation RMSPE."""
    from workflows.rossmann_data import check_dataset
    from workflows.rossmann_features import baseline_rmspe, prepare_frames

    spark = current_context().spark_session
    ship_package(spark, __name__)  # the UDFs below are pickled by reference to this package
    directory = data.download()
    check_dataset(directory)
    train_df, test_df, vocab, max_sales, mean_sales = prepare_frames(
        spark, directory, sample_rate=hp.sample_rate, seed=hp.seed
    )
    train_df, test_df = train_df.cache(), test_df.cache()
    baseline = baseline_rmspe(train_df)
    return Prepared(
        StructuredDataset(dataframe=train_df),
        StructuredDataset(dataframe=test_df),
        vocab,
        max_sales,
        mean_sales,
        baseline,
    )


@task(task_config=Spark(spark_conf=SPARK_CONF), enable_deck=True)
def train(
    train: StructuredDataset,
    vocab: dict[str, list[str]],
    max_sales: float,
    mean_sales: float,
    hp: Hyperparameters,
    work_dir: str,
    warm_start: str = "",
) -> TrainResult:
    """``KerasEstimator`` on ``hp.num_proc`` ranks; returns the best epoch's model.

    ``warm_start``: empty to start from fresh weights, ``latest`` for the newest run's
    checkpoint under ``work_dir`` (fresh weights if there is none), or a checkpoint's URI."""
    import keras
    import pyspark
    from pyspark.sql import functions as F

    from flyte_hvd.data.store import Store
    from flyte_hvd.estimators.keras import KerasEstimator
    from flyte_hvd.keras.callbacks import BestModelCheckpoint
    from workflows.rossmann_features import FEATURE_COLS, rmspe
    from workflows.rossmann_model import CUSTOM_OBJECTS, build_model, exp_rmspe

    ship_package(current_context().spark_session, __name__)  # the ranks load its custom objects
    df = train.open(pyspark.sql.DataFrame).all()
    store = Store.create(work_dir)
    model = _initial_model(store, warm_start) or build_model(
        vocab, max_sales, mean_sales, seed=hp.seed
    )
    run_id = f"rossmann-{datetime.datetime.now(datetime.UTC):%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:6]}"
    estimator = KerasEstimator(
        num_proc=hp.num_proc,
        store=store,
        model=model,
        optimizer=keras.optimizers.Adam(hp.learning_rate, epsilon=1e-3),
        loss="mae",
        metrics=[exp_rmspe],
        custom_objects=CUSTOM_OBJECTS,
        feature_cols=FEATURE_COLS,
        label_cols=["Sales"],
        validation="Validation",
        batch_size=hp.batch_size,
        epochs=hp.epochs,
        random_seed=hp.seed,
        run_id=run_id,
        checkpoint_callback=BestModelCheckpoint(monitor="val_loss"),
    )
    fitted = estimator.fit(df).setOutputCols(["Predicted"])
    history = {k: [float(v) for v in values] for k, values in fitted.getHistory().items()}
    best = min(range(len(history["val_loss"])), key=history["val_loss"].__getitem__)

    # Score the best model on every validation row, as the baseline is scored.
    validation = fitted.transform(df.filter(F.col("Validation")))
    scored = validation.select(F.exp("Sales").alias("Actual"), F.exp("Predicted").alias("Forecast"))
    val_rows = scored.count()
    val_rmspe = rmspe(scored, "Actual", "Forecast")

    local_model = os.path.join(current_context().working_directory, "rossmann.keras")
    fitted.getModel().save(local_model)
    return TrainResult(
        model=FlyteFile(local_model),
        history=history,
        best_epoch=best + 1,
        best_val_rmspe=history["val_exp_rmspe"][best],
        val_rmspe=val_rmspe,
        validation_rows=val_rows,
        run_id=run_id,
        checkpoint_uri=store.get_checkpoint_path(run_id, ".keras"),
    )


def train_spark_conf(num_proc: int) -> dict[str, str]:
    """``train``'s Spark settings for ``num_proc`` ranks: ``SPARK_CONF`` with a task slot per
    rank, as ``HorovodSpark`` derives them for a barrier stage."""
    from flyte_hvd.flyte import HorovodSpark

    return {**SPARK_CONF, **HorovodSpark(num_proc=num_proc).derived_spark_conf(gpus=False)}


@dynamic
def train_on_ranks(
    train_data: StructuredDataset,
    vocab: dict[str, list[str]],
    max_sales: float,
    mean_sales: float,
    hp: Hyperparameters,
    work_dir: str,
    warm_start: str = "",
) -> TrainResult:
    """``train`` with Spark settings that follow ``hp.num_proc``: on a cluster its
    SparkApplication gets an executor per rank, so the launcher finds a slot for each."""
    return train(
        train=train_data,
        vocab=vocab,
        max_sales=max_sales,
        mean_sales=mean_sales,
        hp=hp,
        work_dir=work_dir,
        warm_start=warm_start,
    ).with_overrides(task_config=Spark(spark_conf=train_spark_conf(hp.num_proc)))


def _initial_model(store, warm_start: str):
    """The model to continue from, or None for fresh weights."""
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


def _run_ids(store) -> list[str]:
    runs = store.get_runs_path()
    if not store.exists(runs):
        return []
    return [os.path.basename(p.rstrip("/")) for p in store.fs.ls(store.fs_path(runs), detail=False)]


@task(task_config=Spark(spark_conf=SPARK_CONF))
def predict(test: StructuredDataset, result: TrainResult, work_dir: str) -> FlyteFile:
    """Sales for the test rows (0 where the store is closed), as ``submission.csv``
    (``Id,Sales`` sorted by ``Id``), also written to the run's folder in the Store."""
    import pyspark

    from flyte_hvd.data.store import Store
    from flyte_hvd.estimators.keras import KerasModel
    from workflows.rossmann_features import FEATURE_COLS, submission_sales
    from workflows.rossmann_model import CUSTOM_OBJECTS

    ship_package(current_context().spark_session, __name__)  # the UDF loads its custom objects
    df = test.open(pyspark.sql.DataFrame).all()
    with open(result.model.download(), "rb") as f:
        model = KerasModel(
            model_bytes=f.read(),
            feature_columns=FEATURE_COLS,
            label_columns=["Sales"],
            custom_objects=CUSTOM_OBJECTS,
            run_id=result.run_id,
        ).setOutputCols(["Predicted"])
    predicted = model.transform(df).select("Id", submission_sales().alias("Sales"))
    submission = predicted.orderBy("Id").toPandas()
    path = os.path.join(current_context().working_directory, "submission.csv")
    submission.to_csv(path, index=False, float_format="%.1f")
    store = Store.create(work_dir)
    store.upload_file(path, _submission_uri(store, result.run_id))
    return FlyteFile(path)


def _submission_uri(store, run_id: str) -> str:
    return store.join(store.get_run_path(run_id), "submission.csv")


@task
def summarize(
    result: TrainResult, baseline_rmspe: float, submission: FlyteFile, work_dir: str
) -> Report:
    """One line to compare with the baseline, how many test rows were predicted closed (a
    glance catches a pipeline that reads no store as closed), and where the outputs are."""
    import pandas as pd

    from flyte_hvd.data.store import Store

    sales = pd.read_csv(submission.download()).Sales
    closed = int((sales == 0).sum())
    store = Store.create(work_dir)
    submission_uri = _submission_uri(store, result.run_id)
    verdict = "beats" if result.val_rmspe < baseline_rmspe else "does NOT beat"
    print(
        f"validation RMSPE {result.val_rmspe:.4f} (best epoch {result.best_epoch}) {verdict} "
        f"the per-store, per-weekday median baseline's {baseline_rmspe:.4f} on the same "
        f"{result.validation_rows} rows\n"
        f"test rows:  {len(sales)} predicted, {closed} of them closed (Sales 0), "
        f"{len(sales) - closed} open\n"
        f"model:      {result.checkpoint_uri}\n"
        f"submission: {submission_uri}\n"
        f"logs:       {store.get_logs_path(result.run_id)}  (tensorboard --logdir ...)"
    )
    return Report(
        val_rmspe=result.val_rmspe,
        baseline_rmspe=baseline_rmspe,
        validation_rows=result.validation_rows,
        run_id=result.run_id,
        checkpoint_uri=result.checkpoint_uri,
        submission_uri=submission_uri,
        model=result.model,
        submission=submission,
        test_rows=len(sales),
        closed_test_rows=closed,
        history=result.history,
    )


@workflow
def horovod_spark_wf(
    dataset: str = SYNTHETIC,
    hp: Hyperparameters = DEFAULT_HP,
    work_dir: str = DEFAULT_WORK_DIR,
    warm_start: str = "",
) -> Report:
    """Rossmann end to end; see the module's docstring."""
    store_prefix = check_work_dir(work_dir=work_dir)
    data = download_data(dataset=dataset)
    prepared = prepare(data=data, hp=hp)
    result = train_on_ranks(
        train_data=prepared.train,
        vocab=prepared.vocab,
        max_sales=prepared.max_sales,
        mean_sales=prepared.mean_sales,
        hp=hp,
        work_dir=store_prefix,
        warm_start=warm_start,
    )
    submission = predict(test=prepared.test, result=result, work_dir=store_prefix)
    return summarize(
        result=result,
        baseline_rmspe=prepared.baseline_rmspe,
        submission=submission,
        work_dir=store_prefix,
    )


rossmann_weekly_retrain = LaunchPlan.get_or_create(
    workflow=horovod_spark_wf,
    name="rossmann_weekly_retrain",
    schedule=CronSchedule(schedule="0 3 * * 1"),  # Mondays 03:00 UTC
    default_inputs={"warm_start": LATEST},
)
