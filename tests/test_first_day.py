"""What a new user does on the first day, with the defaults: a store given as a path, one
column given as a string, a pandas DataFrame, a decimal label, S3 without credentials, an
in-memory store, a store that never answers, a loss that becomes NaN. Each gets the outcome
it should, or a clear error before any rank starts (most of them before Spark does)."""

from __future__ import annotations

import socket
import sys
import time

import pytest

torch = pytest.importorskip("torch")

import cloudpickle  # noqa: E402
import numpy as np  # noqa: E402

from flyte_hvd.data.store import (  # noqa: E402
    FilesystemStore,
    LocalStore,
    Store,
    StoreTimeoutError,
)
from flyte_hvd.estimators.torch import TorchEstimator  # noqa: E402

# Callbacks of this module travel to the ranks by value (tests/ is not a package the rank
# processes can import).
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _torch_estimator(**params):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    defaults = dict(
        num_proc=2, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
        loss=torch.nn.functional.mse_loss, label_cols=["label"], verbose=0,
    )  # fmt: skip
    return TorchEstimator(**{**defaults, **params})


# -- argument checks: no Spark, no ranks -----------------------------------------------------


def test_a_store_given_as_a_path_is_created_from_it(tmp_path):
    estimator = _torch_estimator(store=str(tmp_path / "store"))
    store = estimator.getStore()
    assert isinstance(store, LocalStore) and store.prefix_path == str(tmp_path / "store")
    assert (tmp_path / "store").is_dir()  # created and checked writable, as Store.create does
    estimator.setStore(tmp_path / "other")  # a PathLike, and through the setter
    assert estimator.getStore().prefix_path == str(tmp_path / "other")
    expected = r"`store` must be a Store, e\.g\. store=Store\.create\('/tmp/flyte-hvd'\), or a path"
    with pytest.raises(ValueError, match=expected + r".*; found int\."):
        _torch_estimator(store=42)


def test_one_column_given_as_a_string_is_one_column(tmp_path):
    estimator = _torch_estimator(store=str(tmp_path), feature_cols="features", label_cols="y")
    assert estimator.getFeatureCols() == ["features"]
    assert estimator.getLabelCols() == ["y"]
    estimator.setFeatureCols(("a", "b"))
    assert estimator.getFeatureCols() == ["a", "b"]


def test_fit_on_a_pandas_dataframe_says_how_to_make_a_spark_one(tmp_path):
    pd = pytest.importorskip("pandas")
    pdf = pd.DataFrame({"features": [1.0, 2.0], "label": [0.0, 1.0]})
    estimator = _torch_estimator(store=str(tmp_path), feature_cols=["features"])
    with pytest.raises(ValueError, match=r"the DataFrame given to TorchEstimator\.fit must be a "
                       r"Spark DataFrame; found a pandas DataFrame: convert it with "
                       r"`spark\.createDataFrame\(pdf\)`"):  # fmt: skip
        estimator.fit(pdf)


def test_one_argument_forward_with_several_feature_columns_advises_vector_assembler(tmp_path):
    estimator = _torch_estimator(store=str(tmp_path), feature_cols=["a", "b", "c"])
    with pytest.raises(ValueError) as caught:
        estimator.fit_on_parquet()
    message = str(caught.value)
    assert "forward() takes 1 input(s) (input) but `feature_cols` names 3 columns" in message
    assert "VectorAssembler(inputCols=['a', 'b', 'c'], outputCol='features')" in message
    assert "give forward() one argument per column" in message
    assert "input_shapes" not in message


def test_a_memory_store_is_refused_at_creation():
    with pytest.raises(ValueError, match=r"`memory://exp` is on fsspec's in-memory filesystem "
                       r"\(memory://\), whose files live inside this Python process only: the "
                       r"ranks and Spark's executors are other processes"):  # fmt: skip
        Store.create("memory://exp")
    # Built by hand, the same store is refused by a fit's check, before any data is written.
    with pytest.raises(ValueError, match="in-memory filesystem"):
        FilesystemStore("memory://exp").check_writable()


_AWS_VARIABLES = (
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE", "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
)  # fmt: skip


def test_s3_without_credentials_says_how_to_give_them(monkeypatch, tmp_path):
    for name in _AWS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role to ask for
    with socket.socket() as closed:  # a port nothing listens on: no request is ever sent
        closed.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{closed.getsockname()[1]}"
    with pytest.raises(RuntimeError) as caught:
        Store.create("s3://bucket/exp", storage_options={"endpoint_url": endpoint})
    message = str(caught.value)
    assert message.startswith("cannot write to the store at `s3://bucket/exp`: no AWS "
                              "credentials were found")  # fmt: skip
    for fix in ("'key' and 'secret'", "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
                "AWS_PROFILE", "storage_options={'anon': True}"):  # fmt: skip
        assert fix in message
    assert "correct and reachable" not in message


def test_store_create_against_an_endpoint_that_never_answers_ends_within_the_timeout(
    monkeypatch,
):
    pytest.importorskip("s3fs")
    monkeypatch.setenv("FLYTE_HVD_STORE_TIMEOUT_S", "1")
    with socket.socket() as silent:  # accepts connections (the backlog) and never replies
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        options = {
            "endpoint_url": f"http://127.0.0.1:{silent.getsockname()[1]}",
            "key": "user",
            "secret": "password",
        }
        started = time.monotonic()
        with pytest.raises(StoreTimeoutError) as caught:
            Store.create("s3://bucket/exp", storage_options=options)
        elapsed = time.monotonic() - started
    assert elapsed < 5, elapsed
    message = str(caught.value)
    assert message.startswith("writing .flyte-hvd-write-check-")
    assert "to s3://bucket/exp did not finish within 1s: the store does not answer" in message
    assert "raise the Store's `timeout` or FLYTE_HVD_STORE_TIMEOUT_S (now 1s" in message


def test_reading_the_prepared_metadata_on_the_driver_is_bounded_too(monkeypatch, tmp_path):
    import threading

    from flyte_hvd.data import dataset

    monkeypatch.setenv("FLYTE_HVD_STORE_TIMEOUT_S", "0.5")
    store = Store.create(str(tmp_path / "store"))
    never = threading.Event()
    monkeypatch.setattr(dataset, "read_metadata", lambda *args: never.wait(10))  # a hung store
    started = time.monotonic()
    expected = r"^reading intermediate_train_data\.ab12 from .*/store did not finish within 0\.5s"
    with pytest.raises(StoreTimeoutError, match=expected + ": the store does not answer"):
        dataset.get_dataset_metadata(store, "ab12")
    assert time.monotonic() - started < 3
    never.set()


def test_a_non_finite_epoch_loss_names_the_epoch_and_rank_unless_turned_off():
    from flyte_hvd.estimators.training import NonFiniteLossError, TrainingSpec, check_loss

    spec = TrainingSpec.__new__(TrainingSpec)  # only `terminate_on_nan` is read
    spec.terminate_on_nan = True
    check_loss(spec, {"loss": 0.5, "val_loss": 0.7, "mae": float("nan")}, 0, 0)
    with pytest.raises(NonFiniteLossError, match=r"the loss became nan at epoch 3 on rank 1 "
                       r"\(val_loss nan\).*terminate_on_nan=False to keep training"):  # fmt: skip
        check_loss(spec, {"loss": 0.5, "val_loss": float("nan")}, 2, 1)
    spec.terminate_on_nan = False
    check_loss(spec, {"loss": float("inf")}, 2, 1)
    assert _torch_estimator().getTerminateOnNan() is True


# -- before any rank starts, on Spark ----------------------------------------------------------


@pytest.mark.spark
def test_a_decimal_label_is_refused_with_cast_advice(spark_local2, tmp_path):
    from decimal import Decimal

    from pyspark.ml.linalg import Vectors, VectorUDT
    from pyspark.sql import types as T

    schema = T.StructType([T.StructField("features", VectorUDT()),
                           T.StructField("label", T.DecimalType(10, 2))])  # fmt: skip
    df = spark_local2.createDataFrame(
        [(Vectors.dense([float(i), 1.0, 2.0]), Decimal(f"{i}.25")) for i in range(8)], schema
    )
    # A store as a path and one feature column as a string, as a user would write them.
    estimator = _torch_estimator(store=str(tmp_path / "store"), feature_cols="features")
    with pytest.raises(ValueError) as caught:
        estimator.fit(df)
    message = str(caught.value)
    assert message == (
        "column `label` has type decimal(10,2), which cannot be fed to a model as it is: cast "
        "it to double first, e.g. df.withColumn('label', df['label'].cast('double'))."
    )


# -- on the ranks ------------------------------------------------------------------------------


@pytest.mark.spark
@pytest.mark.mpi
def test_a_keras_loss_that_becomes_nan_ends_the_fit_and_verbose_0_is_silent(
    spark_local2, tmp_path, capfd
):
    keras = pytest.importorskip("keras")
    from pyspark.ml.linalg import Vectors

    from flyte_hvd.estimators.keras import KerasEstimator

    class PoisonSecondEpoch(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                for weight in self.model.trainable_weights:
                    weight.assign(weight * float("nan"))

    df = spark_local2.createDataFrame(
        [(Vectors.dense([i / 10, 1.0, -1.0]), i / 5) for i in range(16)], ["features", "label"]
    )
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    estimator = KerasEstimator(
        num_proc=2, store=str(tmp_path / "store"), model=model, optimizer="sgd", loss="mse",
        feature_cols="features", label_cols="label", batch_size=4, epochs=3, verbose=0,
        callbacks=[PoisonSecondEpoch()],
    )  # fmt: skip
    with pytest.raises(Exception) as caught:
        estimator.fit(df)
    message = str(caught.value)
    assert "the loss became nan at epoch 2 on rank " in message, message
    assert "terminate_on_nan=False to keep training" in message
    out = capfd.readouterr()
    # verbose=0: rank 0's progress line of the clean first epoch is not printed.
    assert "flyte-hvd: epoch 1/3" not in out.out + out.err


# -- Spark ML composition, Lightning habits, custom Keras objects ----------------------------
# One set of fits, shared (fitted once, on first use): a Pipeline (VectorAssembler, then the
# estimator) per framework, and a CrossValidator over a TorchEstimator's Pipeline.

pl = pytest.importorskip("lightning.pytorch")
F = torch.nn.functional

_LAYERS_MODULE = """
import keras


@keras.saving.register_keras_serializable(package="FirstDay")
class Scale(keras.layers.Layer):
    def __init__(self, factor=0.5, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor

    def call(self, x):
        return x * self.factor

    def get_config(self):
        return {**super().get_config(), "factor": self.factor}
"""


class FirstDayRegressor(pl.LightningModule):
    """A Lightning tutorial's regressor: the label as the batch gives it, against a (B, 1)
    output."""

    def __init__(self, poison_epoch: int | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(3, 1)
        self.poison_epoch = poison_epoch

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        loss = F.mse_loss(self(batch["features"]), batch["label"])
        if self.current_epoch == self.poison_epoch:
            loss = loss * float("nan")
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2)


class TupleHabit(FirstDayRegressor):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)


def _shift_layer():
    """A layer defined where the user runs, never registered (as in a script's ``__main__``)."""
    keras = pytest.importorskip("keras")

    class Shift(keras.layers.Layer):
        def call(self, x):
            return x + 0.25

    return Shift


_FITS: dict = {}


@pytest.fixture
def first_day_fits(spark_local2, tmp_path_factory):
    """The fits the tests below inspect, made once per test session."""
    if _FITS:
        return _FITS
    keras = pytest.importorskip("keras")
    from pyspark.ml import Pipeline
    from pyspark.ml.evaluation import RegressionEvaluator
    from pyspark.ml.feature import VectorAssembler
    from pyspark.ml.tuning import CrossValidator, ParamGridBuilder

    from flyte_hvd.estimators.keras import KerasEstimator
    from flyte_hvd.estimators.lightning import LightningEstimator

    folder = tmp_path_factory.mktemp("first_day")
    # The user's own module of Keras layers, beside the script: importable here, not by the
    # ranks or Spark's Python workers (their import path does not name this folder).
    (folder / "first_day_layers.py").write_text(_LAYERS_MODULE)
    sys.path.insert(0, str(folder))
    import first_day_layers

    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 3))
    y = x @ np.array([2.0, -1.0, 0.5]) + 0.05 * rng.normal(size=128)
    rows = [(i, *map(float, x[i]), float(y[i])) for i in range(128)]
    df = spark_local2.createDataFrame(rows, ["id", "a", "b", "c", "label"])
    data = str(folder / "data.parquet")
    df.write.parquet(data)
    assembler = VectorAssembler(inputCols=["a", "b", "c"], outputCol="features")
    common = dict(num_proc=2, feature_cols=["features"], label_cols=["label"], batch_size=16,
                  verbose=0, random_seed=1)  # fmt: skip

    def store(name):
        return str(folder / f"store_{name}")

    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1)
    torch_estimator = TorchEstimator(
        store=store("torch"), model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        loss=F.mse_loss, epochs=8, **common,
    )  # fmt: skip
    lightning_estimator = LightningEstimator(
        store=store("lightning"), model=FirstDayRegressor(), epochs=8, **common
    )
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), first_day_layers.Scale(), _shift_layer()(),
                              keras.layers.Dense(1)])  # fmt: skip
    keras_estimator = KerasEstimator(
        store=store("keras"), model=model, optimizer=keras.optimizers.SGD(0.05), loss="mse",
        epochs=4, **common,
    )  # fmt: skip
    fits = {"df": df, "data": data, "folder": folder}
    for name, estimator in (("torch", torch_estimator), ("lightning", lightning_estimator),
                            ("keras", keras_estimator)):  # fmt: skip
        pipeline = Pipeline(stages=[assembler, estimator])
        fits[f"{name}_pipeline"], fits[name] = pipeline, pipeline.fit(df)
    # Spark's evaluators read `predictionCol`: the model's column is `<label>__output`.
    evaluator = RegressionEvaluator(labelCol="label", predictionCol="label__output")
    cv_estimator = torch_estimator.copy({torch_estimator.store: store("cv")})
    grid = ParamGridBuilder().addGrid(cv_estimator.epochs, [4]).build()
    validator = CrossValidator(
        estimator=Pipeline(stages=[assembler, cv_estimator]), estimatorParamMaps=grid,
        evaluator=evaluator, numFolds=2, seed=3,
    )  # fmt: skip
    fits["cv"], fits["evaluator"] = validator.fit(df), evaluator
    _FITS.update(fits)
    return _FITS


def _predictions(model, df) -> np.ndarray:
    rows = model.transform(df).orderBy("id").select("label", "label__output").collect()
    return np.array([(r[0], r[1]) for r in rows])


@pytest.mark.spark
@pytest.mark.mpi
def test_lightning_gets_a_scalar_label_shaped_as_its_output(first_day_fits):
    df = first_day_fits["df"]
    torch_truth, torch_guess = _predictions(first_day_fits["torch"], df).T
    truth, guess = _predictions(first_day_fits["lightning"], df).T
    torch_corr = np.corrcoef(torch_truth, torch_guess)[0, 1]
    corr = np.corrcoef(truth, guess)[0, 1]
    # `F.mse_loss(self(x), y)` with a (B,) label broadcast to (B, B) learned the mean (0.47).
    assert torch_corr > 0.95 and corr > 0.95 and abs(corr - torch_corr) < 0.03, (corr, torch_corr)


@pytest.mark.spark
@pytest.mark.mpi
def test_registered_and_unregistered_keras_layers_reach_the_ranks(first_day_fits):
    fitted = first_day_fits["keras"].stages[-1]
    model = fitted.getModel()
    names = [type(layer).__name__ for layer in model.layers]
    assert names == ["Scale", "Shift", "Dense"]
    assert fitted.getCustomObjects().keys() >= {"FirstDay>Scale", "Shift"}
    df = first_day_fits["df"]
    features = np.array(df.orderBy("id").select("a", "b", "c").collect(), dtype=np.float32)
    _, guess = _predictions(first_day_fits["keras"], df).T  # on Spark's Python workers
    np.testing.assert_allclose(guess, model.predict(features, verbose=0)[:, 0], rtol=1e-4,
                               atol=1e-5)  # fmt: skip
    assert fitted.getHistory()["loss"][-1] < fitted.getHistory()["loss"][0]


@pytest.mark.spark
@pytest.mark.mpi
def test_a_spark_evaluator_scores_the_model_output(first_day_fits):
    cv = first_day_fits["cv"]
    # RMSE over 2 folds, of a label whose standard deviation is about 2.3
    assert len(cv.avgMetrics) == 1 and 0 < cv.avgMetrics[0] < 0.5, cv.avgMetrics
    assert len(cv.bestModel.stages[-1].getHistory()["loss"]) == 4
    rmse = first_day_fits["evaluator"].evaluate(cv.transform(first_day_fits["df"]))
    assert 0 < rmse < 0.5


_LOAD_IN_A_NEW_PROCESS = """
import json, sys
from pyspark.ml import Pipeline, PipelineModel
from pyspark.ml.evaluation import RegressionEvaluator
from pyspark.ml.tuning import CrossValidatorModel
from pyspark.sql import SparkSession

spark = SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false").getOrCreate()
folder, data = sys.argv[1:]
df = spark.read.parquet(data)
out = {}
for name in ("torch", "lightning", "keras"):
    model = PipelineModel.load(f"{folder}/{name}_model")
    out[name] = [r[0] for r in model.transform(df).orderBy("id").select("label__output").collect()]
    stage = Pipeline.load(f"{folder}/{name}_pipeline").getStages()[-1]
    out[name + "_estimator"] = [type(stage).__name__, stage.getEpochs(), stage.uid]
cv = CrossValidatorModel.load(f"{folder}/cv")
out["cv"] = [r[0] for r in cv.transform(df).orderBy("id").select("label__output").collect()]
out["cv_metrics"] = cv.avgMetrics
out["cv_rmse"] = cv.getEvaluator().evaluate(cv.transform(df))
print("RESULT " + json.dumps(out))
"""


@pytest.mark.spark
@pytest.mark.mpi
def test_pipelines_and_cross_validator_models_save_and_load_in_a_new_process(
    first_day_fits, tmp_path
):
    import json
    import os
    import subprocess

    fits, df = first_day_fits, first_day_fits["df"]
    expected = {}
    for name in ("torch", "lightning", "keras"):
        fits[name].write().overwrite().save(str(tmp_path / f"{name}_model"))
        fits[f"{name}_pipeline"].save(str(tmp_path / f"{name}_pipeline"))
        expected[name] = _predictions(fits[name], df)[:, 1]
    fits["cv"].save(str(tmp_path / "cv"))
    # A new process, as a serving job: the user's layer module is importable there as in the
    # training script's folder; nothing else of this test is.
    env = {**os.environ, "PYTHONPATH": str(fits["folder"])}
    done = subprocess.run(
        [sys.executable, "-c", _LOAD_IN_A_NEW_PROCESS, str(tmp_path), fits["data"]],
        capture_output=True, text=True, timeout=400, env=env, cwd=str(tmp_path),
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    loaded = json.loads(lines[0][len("RESULT ") :])
    for name, estimator in (("torch", "TorchEstimator"), ("lightning", "LightningEstimator"),
                            ("keras", "KerasEstimator")):  # fmt: skip
        np.testing.assert_allclose(loaded[name], expected[name], rtol=1e-5, atol=1e-6)
        stage = fits[f"{name}_pipeline"].getStages()[-1]
        assert loaded[f"{name}_estimator"] == [estimator, stage.getEpochs(), stage.uid]
    np.testing.assert_allclose(loaded["cv"], _predictions(fits["cv"], df)[:, 1], rtol=1e-5)
    assert loaded["cv_metrics"] == pytest.approx(fits["cv"].avgMetrics)
    assert np.isfinite(loaded["cv_rmse"])


@pytest.mark.spark
def test_a_pipeline_that_cannot_be_saved_leaves_nothing_behind(spark_local2, tmp_path):
    import threading

    from pyspark.ml import Pipeline
    from pyspark.ml.feature import VectorAssembler

    lock = threading.Lock()

    def locked(batch):  # holds a lock: cannot be pickled
        with lock:
            return batch

    estimator = _torch_estimator(store=str(tmp_path / "store"), feature_cols="features",
                                 transformation_fn=locked)  # fmt: skip
    assembler = VectorAssembler(inputCols=["a", "b"], outputCol="features")
    path = tmp_path / "pipeline"
    with pytest.raises(ValueError) as caught:
        Pipeline(stages=[assembler, estimator]).save(str(path))
    message = str(caught.value)
    assert message.startswith(f"cannot save TorchEstimator `{estimator.uid}` to ")
    assert "a param value cannot be pickled (TypeError: cannot pickle '_thread.lock'" in message
    assert "Nothing was written; give that param a value that pickles" in message
    assert not path.exists()


def test_lightning_tuple_unpacking_of_a_batch_is_refused_before_any_rank_starts(tmp_path):
    from flyte_hvd.estimators.lightning import LightningEstimator

    estimator = LightningEstimator(num_proc=2, store=str(tmp_path), model=TupleHabit(),
                                   feature_cols="features", label_cols="label")  # fmt: skip
    with pytest.raises(ValueError) as caught:
        estimator.fit_on_parquet()
    line = TupleHabit.training_step.__code__.co_firstlineno + 1
    assert str(caught.value) == (
        f"TupleHabit.training_step reads its batch by position (`x, y = batch`, line {line}), "
        f"but a LightningEstimator batch is a dict of tensors keyed by column name: "
        f"['features', 'label']. Read the columns by name: "
        f"`x, y = batch['features'], batch['label']`."
    )


@pytest.mark.spark
@pytest.mark.mpi
def test_a_lightning_loss_that_becomes_nan_ends_the_fit(spark_local2, tmp_path):
    from pyspark.ml.linalg import Vectors

    from flyte_hvd.estimators.lightning import LightningEstimator

    df = spark_local2.createDataFrame(
        [(Vectors.dense([i / 10, 1.0, -1.0]), i / 5) for i in range(16)], ["features", "label"]
    )
    estimator = LightningEstimator(
        num_proc=2, store=str(tmp_path / "store"), model=FirstDayRegressor(poison_epoch=1),
        feature_cols="features", label_cols="label", batch_size=4, epochs=3, verbose=0,
    )  # fmt: skip
    assert estimator.getTerminateOnNan() is True
    with pytest.raises(Exception) as caught:
        estimator.fit(df)
    message = str(caught.value)
    assert "the loss became nan at epoch 2 on rank " in message, message
    assert "(training_step loss nan)" in message
    assert "terminate_on_nan=False to keep training" in message


_MAIN_SCRIPT = """
import sys

import keras
from pyspark.sql import SparkSession

from flyte_hvd.estimators.keras import KerasEstimator


class Doubler(keras.layers.Layer):  # the script's own layer: in __main__, never registered
    def call(self, x):
        return x * 2.0


spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
         .config("spark.sql.shuffle.partitions", "2").getOrCreate())
df = spark.createDataFrame([(float(i % 8), float(i % 8) * 3.0) for i in range(64)], ["x", "y"])
model = keras.Sequential([keras.Input((1,)), Doubler(), keras.layers.Dense(1)])
estimator = KerasEstimator(
    num_proc=2, model=model, optimizer=keras.optimizers.SGD(0.01), loss="mse",
    feature_cols=["x"], label_cols=["y"], batch_size=8, epochs=1, verbose=0,
    store=sys.argv[1],
)
fitted = estimator.fit(df)
print("LAYERS", [type(layer).__name__ for layer in fitted.getModel().layers])
print("ROWS", fitted.transform(df).where("y__output IS NOT NULL").count())
"""


@pytest.mark.spark
@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_a_layer_defined_in_a_scripts_main_reaches_the_ranks(tmp_path):
    """`python script.py` with an unregistered layer class in ``__main__``: the ranks and
    Spark's Python workers get the class (pickled by value), the fit and transform work."""
    import os
    import subprocess

    script = tmp_path / "script.py"
    script.write_text(_MAIN_SCRIPT)
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1"}
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "store")], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert "LAYERS ['Doubler', 'Dense']" in done.stdout, output[-6000:]
    assert "ROWS 64" in done.stdout, output[-6000:]
