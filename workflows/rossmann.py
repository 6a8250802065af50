"""Rossmann store sales: prepare with Spark, train on many ranks, predict, as a Flyte workflow.

    pyflyte run workflows/rossmann.py horovod_spark_wf                        # synthetic data
    pyflyte run workflows/rossmann.py horovod_spark_wf --dataset /data/rossmann \\
        --hp '{"epochs": 20, "num_proc": 4}' --work_dir s3://bucket/rossmann

Tasks: ``download_data`` (cached) -> ``prepare`` (Spark) -> ``train`` (Spark, ``KerasEstimator``
on ``hp.num_proc`` ranks, an executor per rank through ``train_on_ranks``) -> ``predict`` (Spark,
``transform``) -> ``summarize``. ``work_dir`` is the Store prefix: prepared data, checkpoints,
TensorBoard logs, the model and the submission land under it (``<work_dir>/runs/<run_id>/``).
The launch plan ``rossmann_weekly_retrain`` retrains every Monday, warm-starting from the newest
run's checkpoint under ``work_dir``. The tasks wrap ``workflows/rossmann_steps.py``, which the
Flyte 2 pipeline (``workflows/rossmann_flyte2.py``) wraps too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import NamedTuple

from flytekit import CronSchedule, LaunchPlan, current_context, dynamic, task, workflow
from flytekit.types.directory import FlyteDirectory
from flytekit.types.file import FlyteFile
from flytekit.types.structured import StructuredDataset
from flytekitplugins.spark import Spark

from flyte_hvd.spark import ship_package
from workflows import rossmann_steps as steps
from workflows.rossmann_steps import (
    DEFAULT_HP,
    DEFAULT_WORK_DIR,
    SPARK_CONF,
    SYNTHETIC,
    Hyperparameters,
)


def _remote_execution() -> bool:
    """Whether this task runs in a Flyte execution on a cluster (not ``pyflyte run``)."""
    return "FLYTE_INTERNAL_EXECUTION_ID" in os.environ


if not _remote_execution():
    steps.use_local_spark()


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

    def __repr__(self) -> str:
        return steps.report_repr(self.run_id, self.val_rmspe, self.baseline_rmspe)


class Prepared(NamedTuple):
    train: StructuredDataset
    test: StructuredDataset
    vocab: dict[str, list[str]]
    max_sales: float
    mean_sales: float
    baseline_rmspe: float


@task(cache=True, cache_version="1", retries=steps.RETRIES, timeout=steps.TASK_TIMEOUT)
def download_data(dataset: str = SYNTHETIC) -> FlyteDirectory:
    """The seven CSV files: ``synthetic`` generates them; otherwise an archive URL
    (``http(s)://``, ``s3://``, ``file://``; ``.tgz``/``.tar.gz``/``.zip``) or a directory."""
    dest = os.path.join(current_context().working_directory, "rossmann")
    return FlyteDirectory(steps.download(dataset, dest))


@task(retries=steps.RETRIES, timeout=steps.TASK_TIMEOUT)
def check_work_dir(work_dir: str) -> str:
    """Fail before any Spark work when the Store prefix cannot be written, or when a remote
    execution was given a local path."""
    return steps.check_work_dir(work_dir, on_cluster=_remote_execution())


@task(task_config=Spark(spark_conf=SPARK_CONF), retries=steps.RETRIES, timeout=steps.TASK_TIMEOUT)
def prepare(data: FlyteDirectory, hp: Hyperparameters) -> Prepared:
    """Feature preparation in Spark, and the naive baseline's validation RMSPE."""
    spark = current_context().spark_session
    ship_package(spark, __name__)  # the UDFs below are pickled by reference to this package
    f = steps.prepare_features(spark, data.download(), hp)
    return Prepared(
        StructuredDataset(dataframe=f.train),
        StructuredDataset(dataframe=f.test),
        f.vocab,
        f.max_sales,
        f.mean_sales,
        f.baseline_rmspe,
    )


@task(
    task_config=Spark(spark_conf=SPARK_CONF),
    enable_deck=True,
    # A retry resumes the run from its last completed epoch: preemptible nodes cost little.
    retries=steps.TRAIN_RETRIES,
    interruptible=True,
    timeout=steps.TRAIN_TIMEOUT,
)
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
    import pyspark

    from flyte_hvd.data.store import Store
    from flyte_hvd.estimators.keras import KerasEstimator

    ship_package(current_context().spark_session, __name__)  # the ranks load its custom objects
    df = train.open(pyspark.sql.DataFrame).all()
    store = Store.create(work_dir)
    model = steps.start_model(store, warm_start, vocab, max_sales, mean_sales, hp.seed)
    run_id = steps.new_run_id(store)  # the same in every attempt of this task: it resumes
    estimator = KerasEstimator(
        num_proc=hp.num_proc,
        store=store,
        model=model,
        validation=steps.VALIDATION,
        run_id=run_id,
        **steps.training_settings(hp),
    )
    fitted = estimator.fit(df).setOutputCols(["Predicted"])
    history = {k: [float(v) for v in values] for k, values in fitted.getHistory().items()}
    best = steps.best_epoch(history)
    val_rows, val_rmspe = steps.score_validation(fitted, df)

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


@task(task_config=Spark(spark_conf=SPARK_CONF), retries=steps.RETRIES, timeout=steps.TASK_TIMEOUT)
def predict(test: StructuredDataset, result: TrainResult, work_dir: str) -> FlyteFile:
    """Sales for the test rows (0 where the store is closed), as ``submission.csv``
    (``Id,Sales`` sorted by ``Id``), also written to the run's folder in the Store."""
    import pyspark

    from flyte_hvd.data.store import Store

    ship_package(current_context().spark_session, __name__)  # the UDF loads its custom objects
    df = test.open(pyspark.sql.DataFrame).all()
    with open(result.model.download(), "rb") as f:
        model = steps.keras_model(f.read(), result.run_id)
    path = os.path.join(current_context().working_directory, "submission.csv")
    steps.write_submission(model, df, path, Store.create(work_dir), result.run_id)
    return FlyteFile(path)


@task(retries=steps.RETRIES, timeout=steps.TASK_TIMEOUT)
def summarize(
    result: TrainResult, baseline_rmspe: float, submission: FlyteFile, work_dir: str
) -> Report:
    """The validation RMSPE against the baseline's, the test rows predicted closed, and where
    the outputs are: printed, and as a typed ``Report``."""
    from flyte_hvd.data.store import Store

    summary = steps.summarize(
        result.val_rmspe, result.best_epoch, baseline_rmspe, result.validation_rows,
        submission.download(), Store.create(work_dir), result.run_id, result.checkpoint_uri,
    )  # fmt: skip
    print(summary.text)
    return Report(
        val_rmspe=result.val_rmspe,
        baseline_rmspe=baseline_rmspe,
        validation_rows=result.validation_rows,
        run_id=result.run_id,
        checkpoint_uri=result.checkpoint_uri,
        submission_uri=summary.submission_uri,
        model=result.model,
        submission=submission,
        test_rows=summary.test_rows,
        closed_test_rows=summary.closed_test_rows,
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
    name=steps.RETRAIN_NAME,
    schedule=CronSchedule(schedule=steps.RETRAIN_CRON),  # Mondays 03:00 UTC
    default_inputs=steps.RETRAIN_INPUTS,
)
