"""``KerasEstimator`` and ``KerasModel``: fit a Keras 3 model on a Spark DataFrame across
ranks, predict with ``transform``.

Only rank 0 writes to the store: the checkpoint (best or last model), ``state.json`` (epochs
completed and history) and TensorBoard logs, each epoch and atomically. A ``fit`` with an
existing ``run_id`` -- or a Spark retry of a failed stage -- resumes after the last completed
epoch, with the learning rate scaled once (Horovod scaled a resumed rate again).
"""

from __future__ import annotations

import io
import json
import math
import os
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import keras
import numpy as np

from flyte_hvd.spark.estimator import HorovodEstimator, HorovodModel

LAST_MODEL_FILENAME = "last.keras"  # the latest epoch, for resuming
BEST_MODEL_FILENAME = "best.keras"  # where a checkpoint callback writes, on rank 0


@dataclass
class KerasTrainingSpec:
    """Everything a rank needs to train: plain values, no driver objects."""

    store: Any  # RemoteStore
    model_bytes: bytes
    custom_objects: dict[str, Any]
    learning_rate: float | None
    features: list[str]
    labels: list[str]
    sample_weight_col: str | None
    metadata: Any
    batch_size: int
    val_batch_size: int
    epochs: int
    verbose: int
    shuffle: bool
    shuffle_buffer_size: int | None
    random_seed: int | None
    train_steps_per_epoch: int | None
    validation_steps_per_epoch: int | None
    callbacks: list[Any] = field(default_factory=list)
    checkpoint_callback: Any = None
    compression: Any = None
    transformation_fn: Any = None
    inmemory_cache_all: bool = False
    data_loader: Any = None
    use_gpu: bool = True


class KerasEstimator(HorovodEstimator):
    """Train a Keras 3 model on a Spark DataFrame with Horovod's estimator API.

    ``fit(df)`` prepares the data into the store, checks the model against the columns
    before any rank starts, trains on ``num_proc`` ranks and returns a ``KerasModel``.
    The learning rate given is the single-rank rate: ranks scale it by ``size()``, and the
    returned model's optimizer holds the rate given.
    """

    _framework = "keras"

    def _check_model(self, features: list[str], labels: list[str]) -> None:
        model = self.getModel()
        if not isinstance(model, keras.Model):
            raise ValueError(
                f"`model` must be a Keras 3 model (keras.Model); found {type(model).__name__}."
            )
        if len(model.inputs) != len(features):
            raise ValueError(
                f"the model has {len(model.inputs)} input(s) but `feature_cols` names "
                f"{len(features)} column(s) {features}: feature columns map to the model's "
                f"inputs in order. Assemble scalar columns into one vector column "
                f"(pyspark.ml.feature.VectorAssembler) or give the model one input per column."
            )
        if len(model.outputs) != len(labels):
            raise ValueError(
                f"the model has {len(model.outputs)} output(s) but `label_cols` names "
                f"{len(labels)} column(s) {labels}: label columns map to outputs in order."
            )
        compiled = getattr(model, "optimizer", None) is not None and getattr(model, "loss", None)
        if not compiled and (self.getOptimizer() is None or self.getLoss() is None):
            raise ValueError(
                "the model is not compiled and `optimizer`/`loss` are not both given: pass "
                "optimizer=keras.optimizers.Adam(...) and loss='mse' (or compile the model)."
            )

    def _compiled_model(self) -> Any:
        model = self.getModel()
        if self.getOptimizer() is not None or self.getLoss() is not None:
            with keras.saving.custom_object_scope(self.getCustomObjects() or {}):
                clone = keras.models.clone_model(model)
            clone.set_weights(model.get_weights())
            clone.compile(
                optimizer=self.getOptimizer() or model.optimizer,
                loss=self.getLoss() or model.loss,
                loss_weights=self.getLossWeights(),
                metrics=list(self.getMetrics() or []),
            )
            return clone
        return model

    def _training_spec(self, remote_store: Any, features: list[str], metadata: Any,
                       num_proc: int) -> KerasTrainingSpec:  # fmt: skip
        model = self._compiled_model()
        return KerasTrainingSpec(
            store=remote_store,
            model_bytes=model_to_bytes(model),
            custom_objects=dict(self.getCustomObjects() or {}),
            learning_rate=_learning_rate(model.optimizer),
            features=features,
            labels=list(self.getLabelCols()),
            sample_weight_col=self.getSampleWeightCol(),
            metadata=metadata,
            batch_size=self.getBatchSize(),
            val_batch_size=self.getValBatchSize() or self.getBatchSize(),
            epochs=self.getEpochs(),
            verbose=self.getVerbose(),
            shuffle=self.getShuffle(),
            shuffle_buffer_size=self.getShuffleBufferSize(),
            random_seed=self.getRandomSeed(),
            train_steps_per_epoch=self.getTrainStepsPerEpoch(),
            validation_steps_per_epoch=self.getValidationStepsPerEpoch(),
            callbacks=list(self.getCallbacks() or []),
            checkpoint_callback=self.getCheckpointCallback(),
            compression=self.getGradientCompression(),
            transformation_fn=self.getTransformationFn(),
            inmemory_cache_all=self.getInmemoryCacheAll(),
            data_loader=self.getDataLoader(),
            use_gpu=self.getUseGpu(),
        )

    def _remote_trainer(self):
        return train_on_rank

    def _create_model(self, result: dict, run_id: str, features: list[str],
                      metadata: Any) -> KerasModel:  # fmt: skip
        return KerasModel(
            model_bytes=result["model"],
            history=result["history"],
            run_id=run_id,
            feature_columns=features,
            label_columns=list(self.getLabelCols()),
            custom_objects=dict(self.getCustomObjects() or {}),
            metadata=metadata,
        )


class KerasModel(HorovodModel):
    """A trained Keras model as a Transformer. Scalar outputs become ``double`` columns;
    vector outputs (e.g. class probabilities) become ``array<float>`` columns."""

    def __init__(self, model_bytes: bytes | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self._model_bytes = model_bytes
        self._model: Any = None

    def getModel(self) -> Any:
        """The compiled Keras model, usable outside Spark."""
        if self._model is None:
            self._model = model_from_bytes(self._model_bytes, self.getCustomObjects())
        return self._model

    def _output_types(self) -> list[Any]:
        from pyspark.sql.types import ArrayType, DoubleType, FloatType

        types = []
        for output in self.getModel().outputs:
            width = math.prod(d for d in output.shape[1:] if d is not None)
            types.append(DoubleType() if width == 1 else ArrayType(FloatType()))
        return types

    def _batch_predictor(self, sc: Any):
        model_bytes = sc.broadcast(self._model_bytes)
        custom_objects = self.getCustomObjects()

        def predict(columns: list[Any]) -> list[Any]:
            model = _worker_model(model_bytes.value, custom_objects)
            inputs = [
                _column_array(column, tensor.shape)
                for column, tensor in zip(columns, model.inputs, strict=True)
            ]
            outputs = model.predict_on_batch(inputs if len(inputs) > 1 else inputs[0])
            if not isinstance(outputs, list | tuple):
                outputs = [outputs]
            rows = len(columns[0])
            predictions = []
            for out in outputs:
                flat = np.asarray(out).reshape(rows, -1)
                if flat.shape[1] == 1:
                    predictions.append(flat[:, 0].astype(np.float64))
                else:
                    predictions.append(list(flat.astype(np.float32)))
            return predictions

        return predict

    # -- persistence --------------------------------------------------------------------------

    def write(self):
        return _KerasModelWriter(self)

    @classmethod
    def read(cls):
        return _KerasModelReader()


# -- on the ranks --------------------------------------------------------------------------


def train_on_rank(spec: KerasTrainingSpec) -> dict:
    """The training function every rank runs (see ``KerasEstimator``)."""
    import tensorflow as tf

    import flyte_hvd.keras as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if not spec.use_gpu:
        tf.config.set_visible_devices([], "GPU")
    if spec.random_seed is not None:
        keras.utils.set_random_seed(spec.random_seed + rank)
    store = spec.store
    state = hvd.broadcast_object(_read_state(store) if rank == 0 else None, root_rank=0)
    with tempfile.TemporaryDirectory(prefix="flyte-hvd-train-") as work:
        model = _initial_model(spec, store, state, work, rank)
        if spec.learning_rate is not None:
            model.optimizer.learning_rate = spec.learning_rate * size  # scaled once, even on resume
        hvd.DistributedOptimizer(
            model.optimizer, compression=spec.compression or hvd.Compression.none
        )
        train, val = _datasets(spec, rank, size)
        initial_epoch = state["epoch"] if state else 0
        callbacks = [
            hvd.callbacks.BroadcastGlobalVariablesCallback(0),
            hvd.callbacks.MetricAverageCallback(),
            *spec.callbacks,
        ]
        if rank == 0:
            if spec.checkpoint_callback is not None:
                spec.checkpoint_callback.filepath = os.path.join(work, BEST_MODEL_FILENAME)
                callbacks.append(spec.checkpoint_callback)
            logs = os.path.join(work, "logs")
            callbacks += [
                keras.callbacks.TensorBoard(logs, write_graph=False, profile_batch=0),
                RunRecorder(store, work, state, spec.epochs),
            ]
        history = model.fit(
            train.dataset,
            validation_data=val.dataset if val else None,
            epochs=spec.epochs,
            initial_epoch=initial_epoch,
            steps_per_epoch=train.steps_per_epoch,
            validation_steps=val.steps_per_epoch if val else None,
            callbacks=callbacks,
            verbose=spec.verbose if rank == 0 else 0,
            shuffle=False,  # the loader shuffles
        )
        if rank != 0:
            return {"rank": rank}
        past = (state or {}).get("history", {})
        merged = {k: list(past.get(k, [])) + [float(v) for v in vs]
                  for k, vs in history.history.items()}  # fmt: skip
        best_path = os.path.join(work, BEST_MODEL_FILENAME)
        if spec.checkpoint_callback is not None and os.path.exists(best_path):
            model = keras.models.load_model(best_path, custom_objects=spec.custom_objects)
        if spec.learning_rate is not None:
            model.optimizer.learning_rate = spec.learning_rate  # hand back the rate given
        return {"model": model_to_bytes(model), "history": merged}


def _read_state(store: Any) -> dict | None:
    if not store.exists(store.state_path):
        return None
    return json.loads(store.read(store.state_path))


def _initial_model(spec: KerasTrainingSpec, store: Any, state: dict | None, work: str,
                   rank: int) -> Any:  # fmt: skip
    """The model to start from: the run's last saved model when resuming (rank 0 loads it;
    the broadcast callback gives it to the others), else the model the driver sent."""
    if state and rank == 0:
        local = os.path.join(work, "resume.keras")
        store.download_file(_last_model_path(store), local)
        return keras.models.load_model(local, custom_objects=spec.custom_objects)
    return model_from_bytes(spec.model_bytes, spec.custom_objects)


def _last_model_path(store: Any) -> str:
    return store.run_path.rstrip("/") + "/" + LAST_MODEL_FILENAME


class RunRecorder(keras.callbacks.Callback):
    """Rank 0, after each epoch: publish the checkpoint (the best model with a checkpoint
    callback, else the last), the last model, the logs and then ``state.json``, each
    atomically, so ``state.json`` never names an epoch whose model is not saved. Also prints
    one summary line per epoch."""

    def __init__(self, store: Any, work: str, state: dict | None, epochs: int):
        super().__init__()
        self.store, self.work, self.epochs = store, work, epochs
        self.history = {k: list(v) for k, v in (state or {}).get("history", {}).items()}
        self.epoch_seconds = list((state or {}).get("epoch_seconds", []))
        self.first_step_at: float | None = None
        self.started = time.monotonic()

    def on_epoch_begin(self, epoch, logs=None):
        self.started = time.monotonic()

    def on_train_batch_begin(self, batch, logs=None):
        if self.first_step_at is None:
            self.first_step_at = time.time()

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}
        for key, value in logs.items():
            self.history.setdefault(key, []).append(float(value))
        store = self.store
        last = os.path.join(self.work, LAST_MODEL_FILENAME)
        self.model.save(last)
        best = os.path.join(self.work, BEST_MODEL_FILENAME)
        store.upload_file(best if os.path.exists(best) else last, store.checkpoint_path)
        store.upload_file(last, _last_model_path(store))
        if os.path.isdir(os.path.join(self.work, "logs")):
            store.upload_dir(os.path.join(self.work, "logs"), store.logs_path)
        seconds = time.monotonic() - self.started
        self.epoch_seconds.append(seconds)
        state = {
            "epoch": epoch + 1,
            "epochs": self.epochs,
            "history": self.history,
            "epoch_seconds": self.epoch_seconds,
            "first_step_at": self.first_step_at,  # wall clock of this attempt's first step
        }
        store.write_text(store.state_path, json.dumps(state))
        metrics = "  ".join(f"{k}={float(v):.4g}" for k, v in sorted(logs.items()))
        print(f"epoch {epoch + 1}/{self.epochs}  {metrics}  ({seconds:.1f}s)", flush=True)


@dataclass
class _Data:
    dataset: Any
    steps_per_epoch: int


def _datasets(spec: KerasTrainingSpec, rank: int, size: int) -> tuple[_Data, _Data | None]:
    from flyte_hvd.spark.loader import ArrowDataLoader

    loader_cls = spec.data_loader or ArrowDataLoader
    train_meta, val_meta = spec.metadata
    columns = [*spec.features, *spec.labels]
    if spec.sample_weight_col:
        columns.append(spec.sample_weight_col)

    def make(path: str, metadata: Any, batch_size: int, shuffle: bool, steps: int | None):
        loader = loader_cls(
            path,
            batch_size,
            rank=rank,
            size=size,
            store=spec.store,
            columns=columns,
            metadata=metadata,
            shuffle=shuffle,
            shuffle_buffer_size=spec.shuffle_buffer_size or 10_000,
            seed=spec.random_seed or 0,
            inmemory_cache_all=spec.inmemory_cache_all,
            steps_per_epoch=steps,
        )
        if spec.transformation_fn is not None:
            loader = TransformedLoader(loader, spec.transformation_fn)
        dataset = loader.to_tf_dataset(spec.features, spec.labels, spec.sample_weight_col)
        return _Data(_as_float32(dataset), len(loader))

    train = make(spec.store.train_data_path, train_meta, spec.batch_size, spec.shuffle,
                 spec.train_steps_per_epoch)  # fmt: skip
    val = None
    if val_meta is not None:
        val = make(spec.store.val_data_path, val_meta, spec.val_batch_size, False,
                   spec.validation_steps_per_epoch)  # fmt: skip
    return train, val


def _as_float32(dataset: Any) -> Any:
    """Spark's doubles arrive as float64; Keras computes in float32, and custom metrics (which
    Keras does not cast for) would mix the two."""
    import tensorflow as tf

    def cast(*parts):
        out = tf.nest.map_structure(
            lambda t: tf.cast(t, tf.float32) if t.dtype == tf.float64 else t, parts
        )
        return out if len(out) > 1 else out[0]

    return dataset.map(cast, num_parallel_calls=tf.data.AUTOTUNE)


def TransformedLoader(loader: Any, fn: Any) -> Any:
    """``loader`` with ``fn(batch) -> batch`` applied to every batch (Horovod's
    ``transformation_fn``); ``fn`` must keep each column's dtype and shape."""
    from flyte_hvd.spark.loader import BaseDataLoader

    class Transformed(BaseDataLoader):
        def __len__(self) -> int:
            return len(loader)

        @property
        def output_specs(self):
            return loader.output_specs

        def _iterate(self, epoch: int):
            for batch in loader.iter_epoch(epoch):
                yield fn(batch)

    return Transformed()


# -- model bytes and prediction --------------------------------------------------------------


def model_to_bytes(model: Any) -> bytes:
    """The model in Keras' native ``.keras`` format, as bytes."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "model.keras")
        model.save(path)
        with open(path, "rb") as f:
            return f.read()


def model_from_bytes(data: bytes, custom_objects: dict[str, Any] | None = None) -> Any:
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "model.keras")
        with open(path, "wb") as f:
            f.write(data)
        return keras.models.load_model(path, custom_objects=custom_objects or {})


_WORKER_MODELS: dict[int, Any] = {}


def _worker_model(data: bytes, custom_objects: dict[str, Any]) -> Any:
    """One loaded model per Python worker and model: Spark reuses workers across tasks."""
    key = hash(data)
    if key not in _WORKER_MODELS:
        _WORKER_MODELS.clear()
        _WORKER_MODELS[key] = model_from_bytes(data, custom_objects)
    return _WORKER_MODELS[key]


def _column_array(series: Any, input_shape: tuple) -> np.ndarray:
    """A pandas column (scalars or arrays) as the model input's array."""
    first = series.iloc[0] if len(series) else None
    if isinstance(first, list | tuple | np.ndarray):
        values = np.stack([np.asarray(v) for v in series])
    else:
        values = series.to_numpy()
    dims = tuple(d for d in input_shape[1:])
    if None not in dims:
        values = values.reshape((len(series), *dims))
    return values


def _learning_rate(optimizer: Any) -> float | None:
    """The optimizer's rate when it is a plain number (a schedule is left alone)."""
    rate = getattr(optimizer, "_learning_rate", None)
    try:
        if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule):
            return None
        return float(np.asarray(optimizer.learning_rate))
    except (TypeError, ValueError):
        return None


# -- save / load -------------------------------------------------------------------------------


_PARAMS_FILE = "params.pkl"
_MODEL_FILE = "model.keras"


class _KerasModelWriter:
    def __init__(self, instance: KerasModel):
        self.instance = instance
        self._overwrite = False

    def overwrite(self) -> _KerasModelWriter:
        self._overwrite = True
        return self

    def save(self, path: str) -> None:
        import fsspec

        fs, root = fsspec.core.url_to_fs(path)
        if fs.exists(root) and not self._overwrite:
            raise ValueError(
                f"{path!r} already exists; use model.write().overwrite().save(path) to replace it."
            )
        params = {p.name: v for p, v in self.instance._paramMap.items()}
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as archive:
            archive.writestr(_PARAMS_FILE, cloudpickle.dumps(params))
            archive.writestr(_MODEL_FILE, self.instance._model_bytes)
        fs.makedirs(root, exist_ok=True)
        with fs.open(f"{root.rstrip('/')}/keras_model.zip", "wb") as f:
            f.write(buffer.getvalue())


class _KerasModelReader:
    def load(self, path: str) -> KerasModel:
        import fsspec

        fs, root = fsspec.core.url_to_fs(path)
        target = f"{root.rstrip('/')}/keras_model.zip"
        if not fs.exists(target):
            raise ValueError(f"{path!r} holds no saved KerasModel (expected {target}).")
        with fs.open(target, "rb") as f, zipfile.ZipFile(io.BytesIO(f.read())) as archive:
            params = cloudpickle.loads(archive.read(_PARAMS_FILE))
            model_bytes = archive.read(_MODEL_FILE)
        return KerasModel(model_bytes=model_bytes, **params)
