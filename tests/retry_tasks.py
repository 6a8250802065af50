"""flytekit tasks that tests/test_retries.py runs through flytekit's container entrypoint
(``pyflyte-execute``), as attempts of a Flyte execution's nodes."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
from flytekit import current_context, task
from flytekitplugins.spark import Spark

from flyte_hvd.flyte import HorovodSpark


@task(task_config=HorovodSpark(num_proc=2))
def collective(mode: str) -> int:
    """``raise``: a ValueError on every rank; ``kill``: rank 1 killed by SIGKILL; ``stall``:
    rank 1 stuck in its own code while rank 0 waits in an allreduce; else an allreduce."""
    import flyte_hvd.core as hvd

    started = os.environ.get("RETRY_TEST_STARTED")  # when the body started, for the test
    if started and hvd.rank() == 0:
        with open(started, "w") as f:
            f.write(str(time.time()))
    if mode == "raise":
        raise ValueError(f"rank {hvd.rank()}: the input has no column `price`")
    if mode == "kill" and hvd.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "stall" and hvd.rank() == 1:
        time.sleep(600)
    return int(hvd.allreduce(np.ones(1), op=hvd.Sum)[0])


def record_epochs(path: str, stop_at: int):
    """A Keras callback: rank 0 writes ``<attempt> <epoch>`` to ``path`` as each epoch begins;
    in attempt 0 it waits (to be killed) at the start of epoch ``stop_at`` (0-based), after
    the run recorded every epoch before it. Keras is imported here, not with the module: the
    ``collective`` task's driver and ranks then start without TensorFlow."""
    import keras

    class RecordEpochs(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            import flyte_hvd.core as hvd

            if hvd.rank() != 0:
                return
            attempt = int(os.environ.get("FLYTE_ATTEMPT_NUMBER", "0"))
            with open(path, "a") as f:
                f.write(f"{attempt} {epoch}\n")
            if attempt == 0 and epoch == stop_at:
                time.sleep(600)

    return RecordEpochs()


@task(task_config=Spark(spark_conf={"spark.ui.enabled": "false"}))
def fit(epochs: int, work_dir: str, log: str) -> str:
    """A KerasEstimator with MLflow's defaults (``mlflow=True``, nothing set), no run_id; the
    model's class, run id and epochs of history."""
    import keras
    from pyspark.ml.linalg import Vectors

    from flyte_hvd.data.store import Store
    from flyte_hvd.estimators.keras import KerasEstimator

    spark = current_context().spark_session
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 3))
    rows = [(Vectors.dense(a.tolist()), float(a.sum())) for a in x]
    df = spark.createDataFrame(rows, ["features", "label"])
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    fitted = KerasEstimator(
        num_proc=2, store=Store.create(work_dir), model=model, optimizer=keras.optimizers.SGD(0.01),
        loss="mse", feature_cols=["features"], label_cols=["label"], batch_size=16,
        epochs=epochs, verbose=0, callbacks=[record_epochs(log, stop_at=2)], mlflow=True,
    ).fit(df)  # fmt: skip
    history = fitted.getHistory()["loss"]
    return f"{type(fitted).__name__} {fitted.getRunId()} {len(history)}"
