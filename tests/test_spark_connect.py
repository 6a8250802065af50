"""Spark Connect: estimators, large results, cancellation and the launch helpers on a Connect
session (local[2] server, one per test session; see ``conftest.py``). The Run API's own tests
run on both session kinds in ``test_spark_run.py``."""

from __future__ import annotations

import io
import sys
import threading
import time

import cloudpickle
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flyte_hvd.data.store import Store
from flyte_hvd.spark import run
from flyte_hvd.stage import dataframe_stage
from flyte_hvd.stage.dispatch import active_session, is_connect_session, task_slots

pytestmark = [pytest.mark.spark, pytest.mark.mpi]
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _regression_parquet(path, rows=200, seed=0) -> str:
    """The same rows for both session kinds, as one Parquet file: Spark reads it into the same
    partitions on either, so prepare_data shards it alike."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 3))
    y = x @ np.array([1.0, -2.0, 0.5]) + 0.3
    table = pa.table(
        {
            "features": pa.array(x.tolist(), pa.list_(pa.float64())),
            "label": y,
            "is_val": np.arange(rows) % 5 == 0,
        }
    )
    pq.write_table(table, str(path))
    return str(path)


# -- the launch helpers ----------------------------------------------------------------------


def test_connect_session_is_the_active_one_and_counts_its_slots(spark_connect):
    assert is_connect_session(spark_connect)
    assert active_session() is spark_connect
    assert task_slots(spark_connect) == 2  # local[2]
    assert dataframe_stage.link_host(spark_connect) == "127.0.0.1"


def test_chunks_join_back_in_rank_order():
    task = dataframe_stage.stage_task(lambda _: iter([(1, b"ab" * dataframe_stage.CHUNK_BYTES)]))
    batches = list(task(iter([])))
    assert len(batches) == 2  # 2 MiB in 1 MiB rows
    rows = [row for b in reversed(batches) for row in b.to_pylist()]  # any order
    rows.append({"rank": 0, "chunk": 0, "data": b""})
    assert dataframe_stage.join_chunks(rows) == [(0, b""), (1, b"ab" * (1 << 20))]


def test_large_results_come_back_whole(spark_connect, no_leftover_ranks):
    size = 2 * dataframe_stage.CHUNK_BYTES + 5  # beyond one row and Connect's batch size

    def fn():
        import flyte_hvd.core as hvd

        hvd.init()
        return bytes([hvd.rank()]) * size

    first, second = run(fn, num_proc=2, verbose=0)
    assert first == b"\0" * size and second == b"\1" * size


def test_interrupting_the_session_stops_every_rank(spark_connect, no_leftover_ranks):
    """What a notebook's stop button does on Connect (`interruptAll`): the stage ends with an
    error and no rank process outlives it."""
    out = io.StringIO()
    errors: list[BaseException] = []

    def fn():
        import time

        import flyte_hvd.core as hvd

        hvd.init()
        print("running", flush=True)
        time.sleep(300)

    def launch():
        try:
            run(fn, num_proc=2, verbose=0, stdout=out, stderr=io.StringIO())
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=launch)
    thread.start()
    deadline = time.monotonic() + 240
    while out.getvalue().count("running") < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert out.getvalue().count("running") == 2
    spark_connect.interruptAll()
    thread.join(timeout=120)
    assert not thread.is_alive()
    assert errors and isinstance(errors[0], RuntimeError)


# -- estimators ------------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.timeout(1200)  # three 2-rank fits, on two sessions, on a loaded 2-core machine
def test_keras_fit_transform_resume_give_the_classic_weights(spark_local2, request, tmp_path):
    """The same seed and data give the same trained weights on Spark Connect as on a classic
    session; on Connect, transform predicts what the Keras model predicts, and a second fit
    with the same run_id resumes after the first one's last epoch."""
    keras = pytest.importorskip("keras")
    from flyte_hvd.estimators.keras import KerasEstimator, KerasModel

    data = _regression_parquet(tmp_path / "data.parquet")

    def estimator(store, epochs):
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((3,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]
        )
        return KerasEstimator(
            num_proc=2, store=store, model=model, optimizer=keras.optimizers.Adam(0.02),
            loss="mse", feature_cols=["features"], label_cols=["label"], validation="is_val",
            batch_size=16, epochs=epochs, verbose=0, random_seed=1, run_id="same",
        )  # fmt: skip

    classic = estimator(Store.create(str(tmp_path / "classic")), 2).fit(
        spark_local2.read.parquet(data)
    )
    spark = request.getfixturevalue("spark_connect")
    assert active_session() is spark
    df = spark.read.parquet(data)
    store = Store.create(str(tmp_path / "connect"))
    connect = estimator(store, 2).fit(df)
    for a, b in zip(
        classic.getModel().get_weights(), connect.getModel().get_weights(), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert connect.getHistory()["loss"] == pytest.approx(classic.getHistory()["loss"], rel=1e-5)

    rows = connect.transform(df.limit(10)).select("features", "label__output").collect()
    expected = classic.getModel().predict(np.array([r[0] for r in rows]), verbose=0)[:, 0]
    np.testing.assert_allclose([r[1] for r in rows], expected, rtol=1e-5, atol=1e-6)
    path = str(tmp_path / "saved")
    connect.save(path)
    loaded = KerasModel.load(path).transform(df.limit(10)).select("label__output").collect()
    np.testing.assert_allclose([r[0] for r in loaded], [r[1] for r in rows], rtol=1e-6)

    resumed = estimator(store, 3).fit(df)  # continues at epoch 3
    assert len(resumed.getHistory()["loss"]) == 3
    assert resumed.getHistory()["loss"][:2] == pytest.approx(connect.getHistory()["loss"])


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_torch_fit_and_transform(spark_connect, tmp_path, no_leftover_ranks):
    torch = pytest.importorskip("torch")
    from flyte_hvd.estimators.torch import TorchEstimator

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    df = spark_connect.read.parquet(_regression_parquet(tmp_path / "data.parquet", rows=400))
    fitted = TorchEstimator(
        num_proc=2, store=Store.create(str(tmp_path / "store")), model=model,
        optimizer=torch.optim.Adam(model.parameters(), 0.02), loss=torch.nn.functional.mse_loss,
        feature_cols=["features"], label_cols=["label"], validation=0.2, batch_size=16,
        epochs=4, verbose=0, random_seed=1,
    ).fit(df)  # fmt: skip
    history = fitted.getHistory()
    assert len(history["loss"]) == 4 and history["loss"][-1] < history["loss"][0] / 3
    rows = fitted.transform(df).select("label", "label__output").collect()
    truth, guess = np.array([(r[0], r[1]) for r in rows]).T
    assert len(rows) == 400 and np.corrcoef(truth, guess)[0, 1] > 0.95


# -- preflight arithmetic, through its seam: a session that only answers `conf.getAll` and the
# plan text of `range` (what the Connect preflight reads) ------------------------------------


class _Plan:
    def __init__(self, text):
        self.text = text

    def _explain_string(self, extended=False):
        return self.text


class _ConfOnly:
    def __init__(self, conf, splits):
        self.conf = type("Conf", (), {"getAll": dict(conf)})()
        self.plan = f"*(1) Range (0, 1073741824, step=1, splits={splits})" if splits else "?"

    def range(self, *args):
        return _Plan(self.plan)


CLUSTER = {"spark.master": "k8s://https://api:6443", "spark.executor.instances": "2"}


@pytest.mark.parametrize(
    ("conf", "splits", "slots"),
    [
        ({"spark.master": "local[4]"}, 4, 4),
        ({"spark.master": "local[4]", "spark.task.cpus": "2"}, 4, 2),
        ({**CLUSTER, "spark.executor.cores": "4"}, 8, 8),
        # GPUs cap the slots: 2 executors x 1 GPU, one per task
        (
            {
                **CLUSTER, "spark.executor.cores": "4", "spark.executor.resource.gpu.amount": "1",
                "spark.task.resource.gpu.amount": "1",
            },
            8, 2,
        ),
        # spark.default.parallelism overrides the planned splits: count executors x cores
        ({**CLUSTER, "spark.executor.cores": "3", "spark.default.parallelism": "100"}, 100, 6),
    ],
)  # fmt: skip
def test_connect_slot_count(conf, splits, slots):
    assert dataframe_stage.task_slots(_ConfOnly(conf, splits)) == slots


def test_connect_preflight_refusals():
    local = _ConfOnly({"spark.master": "local[2]"}, 2)
    conf = dataframe_stage.SessionConf(local)
    with pytest.raises(RuntimeError, match=r"`num_proc`=3 but the cluster has 2 free task slot"):
        dataframe_stage.wait_for_slots(local, conf, 3, time.monotonic() + 60, 60)
    dynamic = _ConfOnly({**CLUSTER, "spark.dynamicAllocation.enabled": "true"}, 2)
    with pytest.raises(RuntimeError, match=r"spark\.dynamicAllocation\.enabled=false"):
        dataframe_stage.wait_for_slots(
            dynamic, dataframe_stage.SessionConf(dynamic), 2, time.monotonic() + 60, 60
        )
    with pytest.raises(RuntimeError, match=r"names no splits.*pass `num_proc`"):
        dataframe_stage.default_parallelism(_ConfOnly({"spark.master": "local[2]"}, None))
