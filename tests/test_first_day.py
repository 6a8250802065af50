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
