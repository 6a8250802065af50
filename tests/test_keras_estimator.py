"""KerasEstimator / KerasModel on local[2] with 2 ranks; small data so each fit takes seconds."""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
import uuid

import numpy as np
import pytest

pytestmark = [pytest.mark.spark, pytest.mark.mpi, pytest.mark.e2e]

keras = pytest.importorskip("keras")

import sys  # noqa: E402

import cloudpickle  # noqa: E402
from conftest import partition_leftovers  # noqa: E402

from flyte_hvd.data.loader import ArrowDataLoader  # noqa: E402
from flyte_hvd.data.store import Store  # noqa: E402
from flyte_hvd.estimators.keras import KerasEstimator, KerasModel  # noqa: E402

# Functions and callbacks of this module travel to the ranks by value (tests/ is not a package
# the rank processes can import).
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def exp_rmspe(y_true, y_pred):
    pct = keras.ops.square((keras.ops.exp(y_true) - keras.ops.exp(y_pred)) / keras.ops.exp(y_true))
    return keras.ops.sqrt(keras.ops.mean(pct))


def scaled_tanh(x):
    return keras.ops.tanh(x) * 3.0


def _regression_df(spark, rows=400, seed=0):
    from pyspark.ml.linalg import Vectors

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 3))
    y = x @ np.array([1.0, -2.0, 0.5]) + 0.3
    return spark.createDataFrame(
        [
            (Vectors.dense(a.tolist()), float(b), i % 5 == 0)
            for i, (a, b) in enumerate(zip(x, y, strict=False))
        ],
        ["features", "label", "is_val"],
    )


def _mlp(inputs=3, outputs=1, activation=None):
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((inputs,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(outputs, activation=activation),
        ]
    )


class _OwnBackend:
    """A user's backend (Horovod's interface), which cannot run over a DataFrame."""

    def num_processes(self):
        return 2

    def run(self, fn, args=(), kwargs=None, env=None):
        raise AssertionError("the fit must fail before it runs")


@pytest.fixture
def store(tmp_path):
    return Store.create(str(tmp_path / "store"))


def test_a_fit_leaves_spare_ranks_and_the_next_fit_trains_the_same(spark_local2, store):
    """Each task of a fit starts a spare rank process with Keras imported; a fit that runs
    on spares (one job each, a new communicator) trains exactly as one on new processes."""
    from conftest import idle_spares

    df = _regression_df(spark_local2, rows=200)

    def fit(run_id):
        return KerasEstimator(
            num_proc=2, store=store, model=_mlp(), optimizer=keras.optimizers.Adam(0.02),
            loss="mse", feature_cols=["features"], label_cols=["label"], batch_size=16,
            epochs=2, verbose=0, random_seed=1, run_id=run_id,
        ).fit(df).getHistory()  # fmt: skip

    before = idle_spares("flyte_hvd.estimators.keras")
    first = fit("spares_a")
    deadline = time.monotonic() + 60
    while len(idle_spares("flyte_hvd.estimators.keras") - before) < 2:
        assert time.monotonic() < deadline, "the fit's tasks started no spare rank processes"
        time.sleep(0.2)
    second = fit("spares_b")
    np.testing.assert_allclose(second["loss"], first["loss"], rtol=1e-5)


def test_regression_fit_transform_save_load(spark_local2, store, tmp_path, no_leftover_ranks):
    df = _regression_df(spark_local2)
    estimator = KerasEstimator(
        num_proc=2, store=store, model=_mlp(), optimizer=keras.optimizers.Adam(0.02), loss="mse",
        feature_cols=["features"], label_cols=["label"], validation=0.2, batch_size=16,
        epochs=5, verbose=0, random_seed=1,
    )  # fmt: skip
    model = estimator.fit(df)
    history = model.getHistory()
    assert len(history["loss"]) == 5 and len(history["val_loss"]) == 5
    assert history["loss"][-1] < history["loss"][0] / 3
    # The learning rate handed back is the one given, not the one scaled by the ranks.
    assert float(np.asarray(model.getModel().optimizer.learning_rate)) == pytest.approx(0.02)

    predicted = model.transform(df)
    assert predicted.columns == [*df.columns, "label__output"]
    assert dict(predicted.dtypes)["label__output"] == "double"
    rows = predicted.select("label", "label__output").collect()
    assert len(rows) == df.count()
    truth, guess = np.array([(r[0], r[1]) for r in rows]).T
    assert np.corrcoef(truth, guess)[0, 1] > 0.95
    # The Keras model also works outside Spark.
    assert model.getModel().predict(np.ones((2, 3)), verbose=0).shape == (2, 1)

    # Only rank 0 wrote the run: checkpoint, state and TensorBoard logs.
    run = model.getRunId()
    assert store.exists(store.get_checkpoint_path(run, ".keras"))
    state = json.loads(store.read(store.get_state_path(run)))
    assert state["epoch"] == 5 and len(state["history"]["loss"]) == 5
    assert store.fs.ls(store.fs_path(store.get_logs_path(run)))

    path = str(tmp_path / "saved")
    model.setOutputCols(["prediction"]).setTransformPartitionBytes(1 << 20).save(path)
    loaded = KerasModel.load(path)
    assert loaded.getOutputCols() == ["prediction"] and loaded.getRunId() == run
    assert loaded.getTransformPartitionBytes() == 1 << 20
    sample = df.limit(20)
    before = [r.prediction for r in model.transform(sample).collect()]
    after = [r.prediction for r in loaded.transform(sample).collect()]
    np.testing.assert_allclose(before, after, rtol=1e-6)
    with pytest.raises(ValueError, match="already exists"):
        model.save(path)

    # fit_on_parquet trains on the data prepared above, with no DataFrame.
    again = KerasEstimator(
        num_proc=2, store=store, model=_mlp(), optimizer=keras.optimizers.Adam(0.02),
        loss="mse", feature_cols=["features"], label_cols=["label"], batch_size=32, epochs=1,
        verbose=0,
    )  # fmt: skip
    idx = store.fs.ls(store.fs_path(store.prefix_path))
    dataset = next(p for p in idx if "intermediate_train_data." in p).rsplit(".", 1)[1]
    assert len(again.fit_on_parquet(dataset_idx=dataset).getHistory()["loss"]) == 1


def test_multiclass_vector_output_validation_column_and_weights(spark_local2, store):
    from pyspark.ml.linalg import Vectors

    rng = np.random.default_rng(3)
    centers = np.array([[3.0, 0.0], [-3.0, 0.0], [0.0, 3.0]])
    labels = rng.integers(0, 3, size=300)
    points = centers[labels] + rng.normal(scale=0.5, size=(300, 2))
    one_hot = np.eye(3)[labels]
    df = spark_local2.createDataFrame(
        [(Vectors.dense(p.tolist()), o.tolist(), 1.0 + (i % 2), i % 4 == 0)
         for i, (p, o) in enumerate(zip(points, one_hot, strict=False))],
        ["xy", "onehot", "weight", "is_val"],
    )  # fmt: skip
    model = _mlp(inputs=2, outputs=3, activation="softmax")
    estimator = KerasEstimator(
        num_proc=2, store=store, model=model, optimizer=keras.optimizers.Adam(0.05),
        loss="categorical_crossentropy", metrics=["accuracy"], feature_cols=["xy"],
        label_cols=["onehot"], validation="is_val", sample_weight_col="weight",
        batch_size=16, epochs=4, verbose=0,
    )  # fmt: skip
    fitted = estimator.fit(df)
    assert "val_loss" in fitted.getHistory()
    out = fitted.transform(df)
    assert dict(out.dtypes)["onehot__output"] == "array<float>"
    rows = out.select("onehot", "onehot__output").collect()
    agree = np.mean([np.argmax(r[0]) == np.argmax(r[1]) for r in rows])
    assert agree > 0.95


def test_best_checkpoint_custom_objects_and_resume(spark_local2, store):
    """The returned model is the best epoch's; a second fit with the same run_id continues
    at the next epoch, keeps the first attempt's best model when the new epochs are worse,
    and scales the learning rate once on the ranks."""
    df = _regression_df(spark_local2, rows=200)

    class MarkEpoch(keras.callbacks.Callback):
        """Stamps each epoch's weights with its number, reports a val_loss that is best at
        epoch index 1 and worse afterwards, and the learning rate the rank trained with."""

        def on_epoch_end(self, epoch, logs=None):
            self.model.set_weights(
                [np.full(w.shape, epoch + 1.0) for w in self.model.get_weights()]
            )
            logs["val_loss"] = [3.0, 1.0, 2.0, 5.0, 4.0, 6.0][epoch]
            logs["rank_lr"] = float(np.asarray(self.model.optimizer.learning_rate))

    from flyte_hvd.keras.callbacks import BestModelCheckpoint

    common = dict(
        num_proc=2, store=store, loss="mae", metrics=[exp_rmspe],
        custom_objects={"exp_rmspe": exp_rmspe, "scaled_tanh": scaled_tanh},
        feature_cols=["features"], label_cols=["label"], validation=0.25, batch_size=32,
        verbose=0, run_id="best-run", callbacks=[MarkEpoch()],
        checkpoint_callback=BestModelCheckpoint(monitor="val_loss"),
    )  # fmt: skip
    first = KerasEstimator(
        model=_mlp(activation=scaled_tanh),
        optimizer=keras.optimizers.SGD(0.01),
        epochs=4,
        **common,
    ).fit(df)
    for weights in first.getModel().get_weights():
        np.testing.assert_array_equal(weights, 2.0)  # epoch index 1 was the best
    assert "exp_rmspe" in first.getHistory()
    assert json.loads(store.read(store.get_state_path("best-run")))["best"] == 1.0

    resumed = KerasEstimator(
        model=_mlp(activation=scaled_tanh),
        optimizer=keras.optimizers.SGD(0.01),
        epochs=6,
        **common,
    ).fit(df)
    history = resumed.getHistory()
    assert len(history["loss"]) == 6  # 4 from the first fit, 2 more
    assert history["val_loss"] == [3.0, 1.0, 2.0, 5.0, 4.0, 6.0]
    assert history["rank_lr"] == pytest.approx([0.02] * 6)  # 0.01 x 2 ranks, also resumed
    state = json.loads(store.read(store.get_state_path("best-run")))
    assert state["epoch"] == 6 and state["best"] == 1.0
    # Epochs 5 and 6 were worse than epoch 2: the returned model and the run's checkpoint
    # are still epoch 2's.
    for weights in resumed.getModel().get_weights():
        np.testing.assert_array_equal(weights, 2.0)
    with tempfile.TemporaryDirectory() as folder:
        local = os.path.join(folder, "checkpoint.keras")
        store.download_file(store.get_checkpoint_path("best-run", ".keras"), local)
        saved = keras.models.load_model(local, custom_objects=common["custom_objects"])
        for weights in saved.get_weights():
            np.testing.assert_array_equal(weights, 2.0)
    assert float(np.asarray(resumed.getModel().optimizer.learning_rate)) == pytest.approx(0.01)


class MarkingLoader(ArrowDataLoader):
    """A user's loader: an ArrowDataLoader that leaves a file per rank and split it serves."""

    marks = ""

    def __init__(self, path, batch_size, **kwargs):
        super().__init__(path, batch_size, **kwargs)
        split = "val" if "val_data" in path else "train"
        open(os.path.join(self.marks, f"{split}-{kwargs['rank']}-{batch_size}"), "w").close()


def test_inside_a_pipeline_with_vector_assembler_and_a_custom_loader(spark_local2, store, tmp_path):
    from pyspark.ml import Pipeline
    from pyspark.ml.feature import VectorAssembler

    MarkingLoader.marks = str(tmp_path / "marks")
    os.mkdir(MarkingLoader.marks)

    rng = np.random.default_rng(5)
    rows = [(float(a), float(b), float(2 * a - b)) for a, b in rng.normal(size=(200, 2))]
    df = spark_local2.createDataFrame(rows, ["a", "b", "y"])
    pipeline = Pipeline(
        stages=[
            VectorAssembler(inputCols=["a", "b"], outputCol="features"),
            KerasEstimator(
                num_proc=2, store=store, model=_mlp(inputs=2),
                optimizer=keras.optimizers.Adam(0.02), loss="mse", feature_cols=["features"],
                label_cols=["y"], batch_size=16, epochs=2, verbose=0, validation=0.2,
                val_batch_size=8, data_loader=MarkingLoader,
            ),
        ]
    )  # fmt: skip
    out = pipeline.fit(df).transform(df)
    assert "y__output" in out.columns and out.count() == 200
    marks = sorted(os.listdir(MarkingLoader.marks))
    assert marks == ["train-0-16", "train-1-16", "val-0-8", "val-1-8"]
    # y = 2a - b is linear: the assembled features reach the model in the right order.
    truth, guess = np.array(out.select("y", "y__output").collect()).T
    assert np.corrcoef(truth, guess)[0, 1] > 0.9


def test_a_killed_rank_resumes_and_finishes(spark_cluster, tmp_path, caplog):
    """local-cluster with spark.task.maxFailures=2: rank 1 dies in epoch 3 of 4; Spark
    retries the stage (the driver says so in one line), which resumes after the last
    completed epoch. The fit streams its data (``materialize=False``): the retried stage
    computes its partitions again from the DataFrame's plan."""
    caplog.set_level(logging.WARNING, logger="flyte_hvd")
    store = Store.create(str(tmp_path / "store"))
    marker = str(tmp_path / "killed-once")

    class KillOnce(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            import flyte_hvd.core as hvd

            if epoch == 2 and hvd.rank() == 1 and not os.path.exists(marker):
                open(marker, "w").close()
                os.kill(os.getpid(), 9)

    df = _regression_df(spark_cluster, rows=200)
    fitted = KerasEstimator(
        num_proc=2, store=store, model=_mlp(), optimizer=keras.optimizers.Adam(0.02),
        loss="mse", feature_cols=["features"], label_cols=["label"], batch_size=32, epochs=4,
        verbose=0, callbacks=[KillOnce()], run_id="killed", materialize=False,
    ).fit(df)  # fmt: skip
    assert os.path.exists(marker)
    retries = [r.getMessage() for r in caplog.records if "Spark retries" in r.getMessage()]
    assert len(retries) == 1, retries
    assert retries[0].startswith("rank 1 failed (")
    assert retries[0].endswith("Spark retries the stage (attempt 2 of 2)")
    assert len(fitted.getHistory()["loss"]) == 4
    state = json.loads(store.read(store.get_state_path("killed")))
    assert state["epoch"] == 4


def test_fit_from_a_worker_thread(spark_local2, store):
    """pyspark's active session is per thread: a notebook's or a server's worker thread finds
    the session the builder made."""
    df = _regression_df(spark_local2, rows=64)
    results = []

    def fit():
        try:
            results.append(_estimator(store, run_id="from-a-thread").fit(df))
        except Exception as error:
            results.append(error)

    thread = threading.Thread(target=fit)
    thread.start()
    thread.join(240)
    assert len(results) == 1 and isinstance(results[0], KerasModel), results


def plain_mse(y_true, y_pred):
    """A loss that is a plain function, named in no `custom_objects`."""
    return keras.ops.mean(keras.ops.square(y_true - y_pred))


def test_two_fits_at_once_on_one_store_train_their_own_runs(spark_local2, store):
    """Two threads fit at the same moment with default run ids, different models and labels:
    each gets a run of its own and its own model and history. One loss is a plain function,
    which reaches the ranks (and the returned model) without `custom_objects`."""
    from pyspark.sql import functions as F

    df = _regression_df(spark_local2, rows=64).withColumn("negated", -F.col("label"))
    keras.utils.set_random_seed(0)
    narrow = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8), keras.layers.Dense(1)])
    estimators = {
        "wide": _estimator(store, loss=plain_mse, batch_size=16),
        "narrow": _estimator(store, model=narrow, label_cols=["negated"], batch_size=16),
    }
    start = threading.Barrier(2)
    results = {}

    def fit(name):
        start.wait()
        try:
            results[name] = estimators[name].fit(df)
        except Exception as error:
            results[name] = error

    threads = [threading.Thread(target=fit, args=(name,)) for name in estimators]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    wide, narrow_model = results["wide"], results["narrow"]
    assert isinstance(wide, KerasModel) and isinstance(narrow_model, KerasModel), results
    assert wide.getRunId() != narrow_model.getRunId()
    assert wide.getRunId().startswith("keras_") and narrow_model.getRunId().startswith("keras_")
    assert wide.getModel().layers[0].units == 16 and narrow_model.getModel().layers[0].units == 8
    assert wide.getModel().loss is plain_mse
    assert narrow_model.getLabelColumns() == ["negated"]
    for model in (wide, narrow_model):
        state = json.loads(store.read(store.get_state_path(model.getRunId())))
        assert state["epoch"] == 1 and state["history"] == model.getHistory()
        assert not store.exists(store.get_run_path(model.getRunId()) + "/lease.json")
    # Each model learned its own label: predictions correlate with it, with opposite signs.
    rows = df.select("features", "label").collect()
    x = np.array([r.features.toArray() for r in rows], dtype="float32")
    truth = np.array([r.label for r in rows])
    guess = wide.getModel().predict(x, verbose=0)[:, 0]
    negated = narrow_model.getModel().predict(x, verbose=0)[:, 0]
    assert np.corrcoef(truth, guess)[0, 1] > 0 > np.corrcoef(truth, negated)[0, 1]


# -- bad input: each fails before any rank starts --------------------------------------------


def _estimator(store, **overrides):
    params = dict(
        num_proc=2, store=store, model=_mlp(), optimizer=keras.optimizers.Adam(0.01),
        loss="mse", feature_cols=["features"], label_cols=["label"], epochs=1, verbose=0,
    )  # fmt: skip
    params.update(overrides)
    return KerasEstimator(**params)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"feature_cols": ["nope"]}, r"column\(s\) \['nope'\] are not in the DataFrame"),
        ({"label_cols": ["missing"]}, r"\['missing'\] are not in the DataFrame"),
        ({"feature_cols": ["features", "label"], "label_cols": ["is_val"]},
         r"the model has 1 input\(s\) but `feature_cols` names 2"),
        ({"optimizer": None, "loss": None}, "not compiled"),
        ({"backend": object()}, "`num_proc` and `backend` are exclusive"),
        ({"batch_size": 0}, "`batch_size` must be an int >= 1"),
        ({"epochs": 0}, "`epochs` must be an int >= 1"),
        ({"model": "not a model"}, "must be a Keras 3 model"),
        ({"data_loader": object.__new__(ArrowDataLoader)}, "must be a BaseDataLoader subclass"),
        ({"inmemory_cache_all": "yes"}, "`inmemory_cache_all` must be True"),
        ({"materialize": "no"}, "`materialize` must be True"),
        ({"num_proc": None, "backend": _OwnBackend(), "materialize": False},
         "`materialize=False` .* a SparkBackend"),
    ],
)  # fmt: skip
def test_bad_input_fails_before_ranks_start(spark_local2, store, overrides, match):
    df = _regression_df(spark_local2, rows=20)
    with pytest.raises(ValueError, match=match):
        _estimator(store, **overrides).fit(df)


def test_streamed_fit_trains_as_the_materialized_one_and_leaves_only_the_run(spark_local2, store):
    """``materialize=False``: each rank trains on its partition of the DataFrame, to the loss
    of the materialized fit within the noise of a different shard composition; the store then
    holds the run only (no prepared data), and the executors' scratch space no partition file.
    (On a Spark Connect session: the torch estimators' streamed test.)"""
    df = _regression_df(spark_local2, rows=400)

    def fit(materialize):
        return KerasEstimator(
            num_proc=2, store=store, model=_mlp(), optimizer=keras.optimizers.Adam(0.02),
            loss="mse", feature_cols=["features"], label_cols=["label"], validation="is_val",
            batch_size=16, epochs=4, verbose=0, random_seed=1, materialize=materialize,
        ).fit(df)  # fmt: skip

    streamed = fit(False)
    written = sorted(os.listdir(store.prefix_path))
    history = streamed.getHistory()
    assert len(history["loss"]) == len(history["val_loss"]) == 4
    assert history["loss"][-1] < 0.3 * history["loss"][0]
    assert written == ["runs"], f"a streamed fit wrote {written} into the store"
    reference = fit(True).getHistory()
    np.testing.assert_allclose(history["val_loss"][-1], reference["val_loss"][-1], rtol=0.5)
    predicted = streamed.transform(df).select("label", "label__output").toPandas()
    assert np.mean(np.abs(predicted["label"] - predicted["label__output"])) < 0.5
    assert partition_leftovers() == []


def test_unwritable_store_fails_before_ranks_start(spark_local2, store):
    df = _regression_df(spark_local2, rows=20)
    estimator = _estimator(store)
    shutil.rmtree(store.prefix_path)
    with open(store.prefix_path, "w") as f:  # a file where the store's directory was
        f.write("in the way")
    with pytest.raises(RuntimeError, match=str(store.prefix_path)):
        estimator.fit(df)


def test_save_and_load_through_s3(s3_server, monkeypatch):
    """save/load to an S3 URL (the endpoint and keys from AWS_* as on a cluster): the archive
    and pyspark's metadata, the same predictions and params after the round trip, and no
    silent overwrite."""
    from flyte_hvd.estimators.keras import model_to_bytes

    for name, value in (("AWS_ACCESS_KEY_ID", s3_server.key), ("AWS_DEFAULT_REGION", "us-east-1"),
                        ("AWS_SECRET_ACCESS_KEY", s3_server.secret),
                        ("AWS_ENDPOINT_URL", s3_server.endpoint_url)):  # fmt: skip
        monkeypatch.setenv(name, value)
    network = _mlp(activation=scaled_tanh)
    model = KerasModel(
        model_bytes=model_to_bytes(network), feature_columns=["features"],
        label_columns=["label"], run_id="s3-run", custom_objects={"scaled_tanh": scaled_tanh},
    ).setOutputCols(["p"])  # fmt: skip
    url = f"s3://{s3_server.bucket}/models/keras-1"
    model.save(url)
    listed = s3_server.client().list_objects_v2(Bucket=s3_server.bucket, Prefix="models/")
    assert [o["Key"] for o in listed["Contents"]] == [
        "models/keras-1/keras_model.zip",
        "models/keras-1/metadata/part-00000",
    ]
    loaded = KerasModel.load(url)
    assert loaded.getOutputCols() == ["p"] and loaded.getRunId() == "s3-run"
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3)
    expected = network.predict(x, verbose=0)
    np.testing.assert_allclose(loaded.getModel().predict(x, verbose=0), expected)
    with pytest.raises(ValueError, match="already exists"):
        model.save(url)


def test_fit_with_data_and_checkpoints_on_azure(spark_local2, azurite_server, no_leftover_ranks):
    """A store on abfs:// (Azurite): Spark here has no Azure connector, so prepare_data's tasks
    upload the Parquet files through adlfs; the ranks read their shards from there and rank 0
    writes the run there, and the model that comes back predicts."""
    key = f"fit-{uuid.uuid4().hex[:8]}"
    store = Store.create(f"abfs://{azurite_server.bucket}/{key}",
                         storage_options=azurite_server.storage_options())  # fmt: skip
    estimator = KerasEstimator(
        num_proc=2, store=store, model=_mlp(), optimizer=keras.optimizers.Adam(0.02), loss="mse",
        feature_cols=["features"], label_cols=["label"], validation="is_val", batch_size=16,
        epochs=3, verbose=0, run_id="on-azure",
    )  # fmt: skip
    model = estimator.fit(_regression_df(spark_local2, rows=200))
    history = model.getHistory()
    assert len(history["val_loss"]) == 3 and history["loss"][-1] < history["loss"][0]
    assert model.getModel().predict(np.ones((2, 3)), verbose=0).shape == (2, 1)
    keys = azurite_server.list_keys(key)
    run = f"{key}/runs/on-azure"
    assert {f"{run}/checkpoint.keras", f"{run}/state.json"} <= set(keys)
    assert json.loads(store.read(store.get_state_path("on-azure")))["epoch"] == 3
    parquet = [k for k in keys if k.endswith(".parquet")]
    # Both splits, each file named as the staged upload names it (not Spark's part-...-c000).
    assert {k.split("/")[1].rsplit(".", 1)[0] for k in parquet} == {
        "intermediate_train_data", "intermediate_val_data",
    }  # fmt: skip
    assert all(re.fullmatch(r"part-\d{5}-\d{4}\.parquet", k.rsplit("/", 1)[1]) for k in parquet)
    assert not [k for k in keys if k.endswith(".tmp") or "/." in k]  # no temporaries, probes


def _partition_ids(df) -> int:
    from pyspark.sql import functions as F

    return df.select(F.spark_partition_id().alias("p")).distinct().count()


def _transform_case(spark, rows: int, partitions: int):
    """A model of ``_mlp()``, a DataFrame of ``rows`` rows (``id`` and 3 features) in
    ``partitions`` partitions, and the model's prediction for each row in ``id`` order."""
    from pyspark.ml.functions import array_to_vector
    from pyspark.sql import functions as F

    from flyte_hvd.estimators.keras import model_to_bytes

    network = _mlp()
    model = KerasModel(
        model_bytes=model_to_bytes(network), feature_columns=["features"], label_columns=["label"]
    )
    ids = F.col("id").cast("double")
    df = spark.range(0, rows, numPartitions=partitions).select(
        "id", array_to_vector(F.array(F.sin(ids), F.cos(ids), ids / 100)).alias("features")
    )
    i = np.arange(rows, dtype=np.float64)
    expected = network.predict(np.stack([np.sin(i), np.cos(i), i / 100], 1), verbose=0)[:, 0]
    return model, df, expected


def test_transform_merges_small_partitions_and_each_row_keeps_its_prediction(spark):
    """On both session kinds: 30 small partitions become one per task slot (local[2]: 2), or
    as many as the size target asks; None keeps them; every row gets its own prediction."""
    from flyte_hvd.stage.dispatch import estimated_bytes

    rows = 600
    model, df, expected = _transform_case(spark, rows, 30)

    size = estimated_bytes(df)
    assert size is not None and 0 < size < 1 << 20
    for transformer, partitions in (
        (model, 2),  # the data is tiny: one partition per task slot
        (model.copy().setTransformPartitionBytes(None), 30),  # the DataFrame's own
        (model.copy().setTransformPartitionBytes(-(-size // 5)), 5),  # about size / 5 each
    ):
        out = transformer.transform(df)
        assert _partition_ids(out) == partitions
        got = dict(out.select("id", "label__output").collect())
        assert sorted(got) == list(range(rows))
        np.testing.assert_allclose([got[k] for k in range(rows)], expected, rtol=1e-5, atol=1e-6)


def test_transform_joins_sparks_arrow_batches_and_each_row_keeps_its_prediction(spark):
    """On both session kinds: with Spark's Arrow batches of 16 rows, a transform joining them
    into model calls of up to 50 rows (three batches) and one taking them as they come give
    every row its own prediction."""
    rows = 600
    model, df, expected = _transform_case(spark, rows, 2)
    assert model.getTransformBatchRows() == 40_000
    key = "spark.sql.execution.arrow.maxRecordsPerBatch"
    before = spark.conf.get(key)
    spark.conf.set(key, "16")
    try:
        for batch_rows in (50, None):
            out = model.copy().setTransformBatchRows(batch_rows).transform(df)
            got = dict(out.select("id", "label__output").collect())
            assert sorted(got) == list(range(rows))
            np.testing.assert_allclose(
                [got[k] for k in range(rows)], expected, rtol=1e-5, atol=1e-6
            )
    finally:
        spark.conf.set(key, before)


def test_transform_ships_the_model_once_per_session_and_param_values(spark):
    """On both session kinds: a model's second transform reuses the prediction UDF the first
    built (the model is not shipped again); a param set on it, or on a copy, builds a new
    one, each predicting with its own values, and the original keeps its own."""
    rows = 50
    model, df, expected = _transform_case(spark, rows, 2)
    shipped = []
    build = model._batch_predictor
    model._batch_predictor = lambda sc: shipped.append(1) or build(sc)

    def predictions(transformer, column="label__output"):
        got = dict(transformer.transform(df).select("id", column).collect())
        assert sorted(got) == list(range(rows))
        np.testing.assert_allclose([got[k] for k in range(rows)], expected, rtol=1e-5, atol=1e-6)

    predictions(model)
    predictions(model)
    assert len(shipped) == 1
    renamed = model.copy({model.output_cols: ["p"]})
    predictions(renamed, "p")
    assert len(shipped) == 2
    predictions(model)  # the original's UDF is still its own
    assert len(shipped) == 2
    model.setTransformBatchRows(7)
    predictions(model)
    assert len(shipped) == 3
    # Pickled or deep-copied, a model leaves its UDF (and the session it holds) behind.
    for again in (cloudpickle.loads(cloudpickle.dumps(model)), copy.deepcopy(model)):
        predictions(again)


def test_arrow_batches_are_joined_in_order_up_to_the_rows_asked():
    import pyarrow as pa

    from flyte_hvd.estimators.prediction import joined_batches

    single = [pa.array(range(n * 10, n * 10 + n)) for n in (3, 3, 3, 7, 1)]
    joined = [batch[0].to_pylist() for batch in joined_batches(iter(single), 6)]
    # 3 + 3, then 3 (a 7 would pass 6), the 7 alone (above 6 as it came), then the 1.
    assert joined == [[30, 31, 32, 30, 31, 32], [30, 31, 32], list(range(70, 77)), [10]]
    # Several columns come as a tuple: joined column by column.
    pairs = [(pa.array([n, n]), pa.array([-n, -n])) for n in range(3)]
    assert [[c.to_pylist() for c in b] for b in joined_batches(iter(pairs), 4)] == [
        [[0, 0, 1, 1], [0, 0, -1, -1]],
        [[2, 2], [-2, -2]],
    ]
    # One row per model call: each batch alone, as before joining.
    assert len(list(joined_batches(iter(single), 1))) == len(single)


@pytest.mark.parametrize(
    ("param", "setter", "bad_values", "constructor_value"),
    [
        ("transform_batch_rows", "setTransformBatchRows", (0, -1, 2.5, "40k", True), 0),
        (
            "transform_partition_bytes",
            "setTransformPartitionBytes",
            (0, -1, 2.5, "64MB", True),
            1.5,
        ),
    ],
)
def test_transform_sizes_must_be_positive_ints_or_none(
    spark_local2, param, setter, bad_values, constructor_value
):
    model = KerasModel(model_bytes=None, feature_columns=["features"], label_columns=["label"])
    for bad in bad_values:
        with pytest.raises(ValueError, match=rf"`{param}` must be an int >= 1"):
            getattr(model, setter)(bad)
    assert model.getOrDefault(param) is not None
    assert model.getOrDefault(getattr(model, setter)(None).getParam(param)) is None
    # Given to the constructor, it is checked when transform is called, before any Spark work.
    df = _regression_df(spark_local2, rows=20)
    unchecked = KerasModel(
        model_bytes=None,
        feature_columns=["features"],
        label_columns=["label"],
        **{param: constructor_value},
    )
    with pytest.raises(
        ValueError, match=rf"`{param}` must be an int >= 1.*found {constructor_value}"
    ):
        unchecked.transform(df)


def test_size_estimate_is_read_from_the_cost_plan():
    """Connect sessions read the optimizer's estimate from the plan's text (Spark's rounded
    units); a plan without statistics gives none."""
    from flyte_hvd.stage import dataframe_stage

    class Plan:
        def __init__(self, text):
            self.text = text

        def _explain_string(self, mode):
            assert mode == "cost"
            return self.text

    root = "Project [a#1], Statistics(sizeInBytes={}, rowCount=1.00E+6)\n+- Relation ..."
    for shown, expected in (
        ("209.8 MiB", int(209.8 * (1 << 20))),
        ("512.0 B", 512),
        ("1.5 KiB", 1536),
        ("8.0 EiB", 8 << 60),
    ):
        assert dataframe_stage.estimated_bytes(Plan(root.format(shown))) == expected
    assert dataframe_stage.estimated_bytes(Plan("== Physical Plan ==\nScan ...")) is None


def test_unknown_parameter_and_output_name_clash(spark_local2, store):
    with pytest.raises(ValueError, match="unknown parameter"):
        KerasEstimator(num_procs=2)
    df = _regression_df(spark_local2, rows=20)
    model = KerasModel(
        model_bytes=None, feature_columns=["features"], label_columns=["label"],
        output_cols=["label"],
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"already exist in the DataFrame"):
        model.transform(df)
    with pytest.raises(ValueError, match="one column per label"):
        model.setOutputCols(["a", "b"])


def test_save_runs_false_removes_the_run_folder_after_fit(spark_local2, tmp_path):
    store = Store.create(str(tmp_path / "no-runs"), save_runs=False)
    estimator = KerasEstimator(
        num_proc=1, store=store, model=_mlp(), optimizer=keras.optimizers.Adam(0.02), loss="mse",
        feature_cols=["features"], label_cols=["label"], batch_size=32, epochs=1, verbose=0,
        run_id="transient",
    )  # fmt: skip
    model = estimator.fit(_regression_df(spark_local2))
    assert model.getModel().predict(np.ones((2, 3)), verbose=0).shape == (2, 1)
    assert not store.exists(store.get_run_path("transient"))
    assert store.fs.ls(store.fs_path(store.prefix_path))  # prepared data stays for reuse


class Summary(keras.callbacks.Callback):
    """Model code that prints Keras' box-drawn summary on every rank."""

    def on_train_begin(self, logs=None):
        self.model.summary()


def test_default_verbose_shows_rank_0s_progress_bar_and_summaries(spark_local2, store, capfd):
    """The defaults users run: `verbose` left at 1 (Keras' progress bar draws `━`) and
    `model.summary()` (box characters) in the model code."""
    df = _regression_df(spark_local2, rows=200)
    KerasEstimator(
        num_proc=2, store=store, model=_mlp(), optimizer=keras.optimizers.Adam(0.02),
        loss="mse", feature_cols=["features"], label_cols=["label"], batch_size=16, epochs=2,
        callbacks=[Summary()],
    ).fit(df)  # fmt: skip
    lines = capfd.readouterr().out.splitlines()
    bars = [line for line in lines if "/step" in line and "━" in line]
    assert len(bars) == 2 and all(line.startswith("[0]<stdout>:") for line in bars), bars
    for rank in (0, 1):
        assert any(line.startswith(f"[{rank}]<stdout>:") and "Total params" in line
                   for line in lines)  # fmt: skip
