"""Rossmann store sales on Flyte 2 (the ``flyte`` SDK): prepare with Spark, train on ranks,
predict, as tasks that call tasks.

    flyte run --local workflows/rossmann_flyte2.py rossmann             # synthetic data
    flyte run --local workflows/rossmann_flyte2.py rossmann --dataset /data/rossmann \\
        --hp '{"epochs": 20, "num_proc": 4}' --work_dir s3://bucket/rossmann
    flyte run workflows/rossmann_flyte2.py rossmann --work_dir s3://bucket/rossmann  # remote

``rossmann`` calls ``check_work_dir`` -> ``download_data`` (cached) -> ``prepare`` (Spark: the
features, the naive baseline, and the training rows written as Parquet into the Store) ->
``train`` (``HorovodSpark``: the body runs on ``hp.num_proc`` ranks, each reading its shard
of the Parquet, and returns rank 0's best model) -> ``predict`` (Spark: the validation RMSPE
and ``submission.csv``) -> ``summarize``. The steps are ``workflows/rossmann_steps.py``'s,
shared with the flytekit workflow (``workflows/rossmann.py``): the same data, model and
training. The trigger ``rossmann_weekly_retrain`` runs ``rossmann`` every Monday, warm-starting
from the newest run's checkpoint under ``work_dir``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import flyte
from flyte.io import DataFrame, Dir, File
from flyteplugins.spark import Spark

from flyte_hvd.flyte2 import HorovodSpark
from flyte_hvd.spark import ship_package
from workflows import rossmann_steps as steps
from workflows.rossmann_steps import (
    DEFAULT_HP,
    DEFAULT_WORK_DIR,
    SPARK_CONF,
    SYNTHETIC,
    Hyperparameters,
)

steps.use_local_spark()  # what it sets is for a local run; a pod's Spark ignores it


def ranks_config(num_proc: int) -> HorovodSpark:
    """``train``'s config for ``num_proc`` ranks: ``SPARK_CONF`` for what the barrier stage
    does not derive from ``num_proc`` (an executor, and a task slot, per rank)."""
    derived = HorovodSpark(num_proc=num_proc).derived_spark_conf()
    return HorovodSpark(
        num_proc=num_proc, spark_conf={k: v for k, v in SPARK_CONF.items() if k not in derived}
    )


spark_env = flyte.TaskEnvironment(name="rossmann_spark", plugin_config=Spark(spark_conf=SPARK_CONF))
ranks_env = flyte.TaskEnvironment(
    name="rossmann_ranks", plugin_config=ranks_config(DEFAULT_HP.num_proc)
)
env = flyte.TaskEnvironment(name="rossmann", depends_on=[spark_env, ranks_env])

weekly_retrain = flyte.Trigger(
    name=steps.RETRAIN_NAME,
    automation=flyte.Cron(steps.RETRAIN_CRON),  # Mondays 03:00 UTC
    inputs=steps.RETRAIN_INPUTS,
    description="Retrain from the newest run's checkpoint under work_dir.",
)


@dataclass
class Prepared:
    """What ``prepare`` hands on: the training rows as Parquet in the Store (for the ranks),
    the validation and test rows as DataFrames (for ``predict``), and plain values."""

    dataset_idx: str
    validation: DataFrame
    test: DataFrame
    vocab: dict[str, list[str]]
    max_sales: float
    mean_sales: float
    baseline_rmspe: float


@dataclass
class Trained:
    """Rank 0's result: the run, its best model (also in the Store) and the metrics per epoch."""

    run_id: str
    checkpoint_uri: str
    model: File
    history: dict[str, list[float]]


@dataclass
class Predicted:
    """What ``predict`` produces: the submission and the model's score on validation rows."""

    submission: File
    val_rmspe: float  # RMSPE of the best model over all validation rows
    validation_rows: int


@dataclass
class Report:
    """The run's model, scores and submission, and where the Store keeps them."""

    trained: Trained
    predicted: Predicted
    baseline_rmspe: float
    summary: steps.Summary  # the lines printed, the test rows predicted (closed), where

    def __repr__(self) -> str:
        return steps.report_repr(self.trained.run_id, self.predicted.val_rmspe, self.baseline_rmspe)


def _raw_path(name: str) -> str:
    """A new path under the run's raw data path: a local file uploaded there outlives the
    task's temporary folder (a local run would otherwise reference the file in place)."""
    return flyte.ctx().raw_data_path.get_random_remote_path(name)


def _on_cluster() -> bool:
    ctx = flyte.ctx()
    return bool(ctx and ctx.is_in_cluster())


@env.task(cache="auto", retries=steps.RETRIES, timeout=steps.TASK_TIMEOUT)
def download_data(dataset: str = SYNTHETIC) -> Dir:
    """The seven CSV files: ``synthetic`` generates them; otherwise an archive URL
    (``http(s)://``, ``s3://``, ``file://``; ``.tgz``/``.tar.gz``/``.zip``) or a directory."""
    with tempfile.TemporaryDirectory() as tmp:
        local = steps.download(dataset, os.path.join(tmp, "rossmann"))
        return Dir.from_local_sync(local, remote_destination=_raw_path("rossmann"))


@env.task(retries=steps.RETRIES, timeout=steps.TASK_TIMEOUT)
def check_work_dir(work_dir: str) -> str:
    """Fail before any Spark work when the Store prefix cannot be written, or when an
    execution on a cluster was given a local path."""
    return steps.check_work_dir(work_dir, on_cluster=_on_cluster())


@spark_env.task(retries=steps.RETRIES, timeout=steps.TASK_TIMEOUT)
def prepare(data: Dir, hp: Hyperparameters, work_dir: str) -> Prepared:
    """Feature preparation in Spark and the naive baseline's validation RMSPE; the training
    rows go to the Store as Parquet (``prepare_data``), split by ``Validation``."""
    from pyspark.sql import functions as F

    from flyte_hvd.data import Store, prepare_data
    from workflows.rossmann_features import FEATURE_COLS

    spark = flyte.ctx().data["spark_session"]
    ship_package(spark, steps.__name__)  # the UDFs are pickled by reference to it
    f = steps.prepare_features(spark, data.download_sync(), hp)
    store = Store.create(work_dir)
    with prepare_data(hp.num_proc, store, f.train, label_columns=[steps.LABEL],
                      feature_columns=FEATURE_COLS, validation=steps.VALIDATION,
                      verbose=1) as dataset_idx:  # fmt: skip
        return Prepared(
            dataset_idx=dataset_idx,
            validation=_parquet(f.train.filter(F.col(steps.VALIDATION))),
            test=_parquet(f.test),
            vocab=f.vocab,
            max_sales=f.max_sales,
            mean_sales=f.mean_sales,
            baseline_rmspe=f.baseline_rmspe,
        )


def _parquet(df) -> DataFrame:
    """A Spark DataFrame as Parquet at the run's raw data path, as the Spark plugin's encoder
    writes it (whose lookup misses pyspark 4's ``pyspark.sql.classic`` DataFrame class)."""
    path = _raw_path("rows")
    df.write.mode("overwrite").parquet(path)
    return DataFrame.from_existing_remote(path, format="parquet")


# A retry resumes the run from its last completed epoch: preemptible nodes cost little.
@ranks_env.task(retries=steps.TRAIN_RETRIES, interruptible=True, timeout=steps.TRAIN_TIMEOUT)
def train(prepared: Prepared, hp: Hyperparameters, work_dir: str, run_id: str,
          warm_start: str = "") -> Trained:  # fmt: skip
    """Runs on every rank: ``KerasEstimator``'s rank function (``train_on_rank``) on this
    rank's shard of the prepared Parquet, with the estimator's checkpoints, ``state.json``
    and TensorBoard logs under ``runs/<run_id>/``; the output is rank 0's best model.

    ``warm_start``: empty to start from fresh weights, ``latest`` for the newest run's
    checkpoint under ``work_dir`` (fresh weights if there is none), or a checkpoint's URI."""
    import flyte_hvd.core as hvd
    from flyte_hvd.data import Store, get_dataset_metadata
    from flyte_hvd.estimators.keras import KerasTrainingSpec, model_to_bytes, train_on_rank

    store = Store.create(work_dir)
    model = steps.start_model(store, warm_start, prepared.vocab, prepared.max_sales,
                              prepared.mean_sales, hp.seed)  # fmt: skip
    settings = steps.training_settings(hp)
    model.compile(optimizer=settings["optimizer"], loss=settings["loss"],
                  metrics=settings["metrics"])  # fmt: skip
    model.optimizer.build(model.trainable_variables)  # saved with its slots, as fit saves it
    spec = KerasTrainingSpec(
        store=store.to_remote(run_id, prepared.dataset_idx),
        model_bytes=model_to_bytes(model),
        features=settings["feature_cols"],
        labels=settings["label_cols"],
        sample_weight_col=None,
        metadata=get_dataset_metadata(store, prepared.dataset_idx),
        batch_size=hp.batch_size,
        val_batch_size=hp.batch_size,
        epochs=hp.epochs,
        verbose=hp.verbose,
        shuffle=True,
        shuffle_buffer_size=None,
        random_seed=hp.seed,
        train_steps_per_epoch=None,
        validation_steps_per_epoch=None,
        custom_objects=settings["custom_objects"],
        learning_rate=hp.learning_rate,
        checkpoint_callback=settings["checkpoint_callback"],
    )
    result = train_on_rank(spec)
    if hvd.rank() != 0:
        return None  # type: ignore[return-value]  # the task's outputs are rank 0's
    path = os.path.join(tempfile.mkdtemp(), "rossmann.keras")  # in the rank's own TMPDIR
    with open(path, "wb") as f:
        f.write(result["model"])
    checkpoint = store.get_checkpoint_path(run_id, ".keras")
    return Trained(run_id, checkpoint, File.from_local_sync(path), result["history"])


@spark_env.task(report=True, retries=steps.RETRIES, timeout=steps.TASK_TIMEOUT)
def predict(prepared: Prepared, result: Trained, work_dir: str) -> Predicted:
    """The best model's RMSPE on every validation row, and sales for the test rows (0 where
    the store is closed) as ``submission.csv``, also written to the run's folder in the
    Store; a report tab with the training curves."""
    import pyspark

    from flyte_hvd.data import Store

    ship_package(flyte.ctx().data["spark_session"], steps.__name__)  # for the UDF
    with open(result.model.download_sync(), "rb") as f:
        model = steps.keras_model(f.read(), result.run_id)
    validation = prepared.validation.open(pyspark.sql.DataFrame).all_sync()
    rows, val_rmspe = steps.score_validation(model, validation)
    test = prepared.test.open(pyspark.sql.DataFrame).all_sync()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "submission.csv")
        steps.write_submission(model, test, path, Store.create(work_dir), result.run_id)
        submission = File.from_local_sync(path, remote_destination=_raw_path("submission.csv"))
    curves = steps.training_curves_html(result.history, steps.best_epoch(result.history))
    flyte.report.get_tab("Training curves").replace(curves)
    flyte.report.flush()
    return Predicted(submission, val_rmspe, rows)


@env.task(retries=steps.RETRIES, timeout=steps.TASK_TIMEOUT)
def summarize(prepared: Prepared, result: Trained, predicted: Predicted,
              work_dir: str) -> Report:  # fmt: skip
    """The validation RMSPE against the baseline's, the test rows predicted closed, and where
    the outputs are: printed, and as a typed ``Report``."""
    from flyte_hvd.data import Store

    summary = steps.summarize(
        predicted.val_rmspe, steps.best_epoch(result.history) + 1, prepared.baseline_rmspe,
        predicted.validation_rows, predicted.submission.download_sync(), Store.create(work_dir),
        result.run_id, result.checkpoint_uri,
    )  # fmt: skip
    print(summary.text)
    return Report(result, predicted, prepared.baseline_rmspe, summary)


@env.task(triggers=weekly_retrain, timeout=steps.PIPELINE_TIMEOUT)
def rossmann(dataset: str = SYNTHETIC, hp: Hyperparameters = DEFAULT_HP,
             work_dir: str = DEFAULT_WORK_DIR, warm_start: str = "") -> Report:  # fmt: skip
    """Rossmann end to end; see the module's docstring. ``train`` gets ``hp.num_proc`` ranks
    (and on a cluster an executor per rank)."""
    from flyte_hvd.data import Store

    store_prefix = check_work_dir(work_dir=work_dir)
    # The same in every attempt of this run: a retried `train` resumes it.
    run_id = steps.new_run_id(Store.create(store_prefix))
    data = download_data(dataset=dataset)
    with _local_session(hp.num_proc):
        prepared = prepare(data=data, hp=hp, work_dir=store_prefix)
        result = train.override(plugin_config=ranks_config(hp.num_proc))(
            prepared=prepared, hp=hp, work_dir=store_prefix, run_id=run_id,
            warm_start=warm_start,
        )  # fmt: skip
        predicted = predict(prepared=prepared, result=result, work_dir=store_prefix)
    return summarize(prepared=prepared, result=result, predicted=predicted, work_dir=store_prefix)


@contextmanager
def _local_session(num_proc: int) -> Iterator[None]:
    """In a local run, the SparkSession that every Spark task of the run shares, started with
    ``SPARK_CONF`` and a task slot per rank, and stopped at the end if the run started it (its
    Python workers would otherwise die with the process, each printing a broken pipe). On a
    cluster each Spark task has its own SparkApplication."""
    from pyspark.sql import SparkSession

    from flyte_hvd.stage.flyte_task import start_local_session

    if _on_cluster() or SparkSession.getActiveSession() is not None:
        yield
        return
    start_local_session("rossmann", ranks_config(num_proc))
    try:
        yield
    finally:
        session = SparkSession.getActiveSession()
        if session is not None:
            session.stop()
