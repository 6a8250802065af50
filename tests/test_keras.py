"""flyte_hvd.keras: correctness on 2 real ranks, and its errors and serialization in-process."""

from __future__ import annotations

import os
import subprocess
import sys

import cloudpickle
import numpy as np
import pytest

from flyte_hvd.launch.job import FunctionJob
from flyte_hvd.launch.supervisor import launch_local

import keras_cases

cloudpickle.register_pickle_by_value(keras_cases)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "examples", "keras_horovod_script.py")

_results: list[dict] = []


def two_rank_results() -> list[dict[str, str | None]]:
    if not _results:
        _results.extend(launch_local(FunctionJob(keras_cases.run_cases), 2, start_timeout=120))
    return _results


@pytest.mark.mpi
@pytest.mark.parametrize("name", list(keras_cases.CASES))
def test_keras_on_two_ranks(name):
    failures = {r: res[name] for r, res in enumerate(two_rank_results()) if res[name]}
    assert not failures, "\n".join(f"rank {r}:\n{tb}" for r, tb in failures.items())


@pytest.fixture(scope="module")
def hvd():
    import flyte_hvd.keras as hvd

    hvd.init()
    return hvd


def test_wrapping_something_else_is_refused(hvd):
    with pytest.raises(ValueError, match="wraps a Keras 3 optimizer"):
        hvd.DistributedOptimizer("sgd")


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_backward_passes_must_be_positive_int(hvd, bad):
    import keras

    with pytest.raises(ValueError, match="backward_passes_per_step"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(), backward_passes_per_step=bad)


def test_bad_op_and_predivide(hvd):
    import keras

    with pytest.raises(ValueError, match=r"hvd\.Average or hvd\.Sum"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(), op=hvd.Max)
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(), gradient_predivide_factor=0)


def test_distributed_optimizer_needs_init(hvd):
    import keras

    hvd.shutdown()
    try:
        with pytest.raises(ValueError, match=r"hvd.init\(\)"):
            hvd.DistributedOptimizer(keras.optimizers.SGD())
    finally:
        hvd.init()


def exp_rmspe(y_true, y_pred):
    import keras

    pct = keras.ops.square((keras.ops.exp(y_true) - keras.ops.exp(y_pred)) / keras.ops.exp(y_true))
    return keras.ops.sqrt(keras.ops.mean(pct))


def scaled_sigmoid(x):
    import keras

    return keras.ops.sigmoid(x) * 2.0


def test_save_and_load_with_custom_objects(hvd, tmp_path):
    import keras

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, activation=scaled_sigmoid)])
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01))
    model.compile(optimizer=opt, loss="mae", metrics=[exp_rmspe])
    x = np.random.default_rng(0).random((32, 3)).astype("float32")
    model.fit(x, x[:, :1], epochs=2, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    custom = {"exp_rmspe": exp_rmspe, "scaled_sigmoid": scaled_sigmoid}

    plain = keras.models.load_model(path, custom_objects=custom)
    assert type(plain.optimizer) is keras.optimizers.Adam  # saved as its own class
    loaded = hvd.load_model(path, custom_objects=custom)
    assert isinstance(loaded.optimizer, keras.optimizers.Adam)
    assert int(loaded.optimizer.iterations) == int(model.optimizer.iterations) == 2
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    loaded.fit(x, x[:, :1], epochs=1, verbose=0)  # still trains after loading


def test_best_model_checkpoint_needs_a_path(hvd):
    import keras

    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    callback = hvd.callbacks.BestModelCheckpoint(monitor="loss")
    assert callback.save_best_only
    with pytest.raises(ValueError, match="no file path"):
        model.fit(np.ones((4, 1)), np.ones((4, 1)), verbose=0, callbacks=[callback])


def test_best_model_checkpoint_keeps_best_epoch(hvd, tmp_path):
    import keras

    class Worsening(keras.callbacks.Callback):
        """Reports a val_loss that is best at epoch 1 and worse after it."""

        def on_epoch_end(self, epoch, logs=None):
            logs["val_loss"] = [3.0, 1.0, 2.0, 5.0][epoch]

    saved_at = []

    class Spy(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            saved_at.append(os.path.getmtime(path) if os.path.exists(path) else None)

    path = str(tmp_path / "best.keras")
    callback = hvd.callbacks.BestModelCheckpoint(monitor="val_loss")
    callback.filepath = path
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    model.fit(np.ones((4, 1)), np.ones((4, 1)), epochs=4, verbose=0,
              callbacks=[Worsening(), callback, Spy()])  # fmt: skip
    assert saved_at[1] is not None and saved_at[1] == saved_at[2] == saved_at[3]
    assert callback.best == 1.0


@pytest.mark.mpi
def test_horovod_script_under_flyte_hvd_run(cli):
    result = cli("-np", "2", "python", SCRIPT, "--epochs", "4", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [float(line.rsplit(" ", 1)[1]) for line in result.stdout.splitlines()
              if line.startswith("[0]<stdout>:loss per epoch")]  # fmt: skip
    assert len(losses) == 1
    assert "[1]<stdout>:loss per epoch" not in result.stdout  # only rank 0 reports
    assert "loss fell" in result.stdout


@pytest.mark.mpi
@pytest.mark.spark
def test_horovod_script_under_spark_run(spark_local2):
    import runpy

    from flyte_hvd.spark import run

    main = runpy.run_path(SCRIPT)["main"]
    results = run(main, kwargs={"epochs": 3}, num_proc=2, verbose=0)
    assert results[0]["losses"][-1] < results[0]["losses"][0]
    assert results[0]["size"] == 2


def test_keras_import_needs_tensorflow_backend():
    code = "import flyte_hvd.keras"
    env = {**os.environ, "KERAS_BACKEND": "jax"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode != 0
    assert "TensorFlow backend" in result.stderr


class ScaledSGD(__import__("keras").optimizers.SGD):
    """An optimizer class Keras cannot find by name when loading."""


def test_load_model_with_custom_optimizers(hvd, tmp_path):
    import keras

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=ScaledSGD(0.1), loss="mse")
    model.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0)
    path = str(tmp_path / "custom.keras")
    model.save(path)
    with pytest.raises(TypeError, match="ScaledSGD"):
        keras.models.load_model(path)
    loaded = hvd.load_model(path, custom_optimizers=[ScaledSGD])
    assert isinstance(loaded.optimizer, ScaledSGD)
    assert int(loaded.optimizer.iterations) == 1
    loaded.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0)  # distributed and still trains
    assert hasattr(loaded.optimizer, "_hvd")
    with pytest.raises(ValueError, match="custom_optimizers"):
        hvd.load_model(path, custom_optimizers=["ScaledSGD"])


def test_horovod_arguments_are_accepted(hvd):
    import keras

    opt = hvd.DistributedOptimizer(
        keras.optimizers.SGD(), name="dist", device_dense="/cpu:0", sparse_as_dense=True,
        groups=2, process_set=None, scale_local_gradients=True,
    )  # fmt: skip
    assert isinstance(opt, keras.optimizers.SGD)
    with pytest.raises(ValueError, match="process_set"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(), process_set="odd ranks")
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        hvd.DistributedOptimizer(
            keras.optimizers.SGD(gradient_accumulation_steps=2), backward_passes_per_step=2
        )
    with pytest.raises(RuntimeError, match="eager"):
        hvd.broadcast_global_variables(0)
