"""``KerasEstimator`` and ``KerasModel``: fit a Keras 3 model on a Spark DataFrame across
ranks, predict with ``transform``.

Only rank 0 writes to the store: the checkpoint (best or last model), ``state.json`` (epochs
completed and history) and TensorBoard logs, each epoch and atomically. A ``fit`` with an
existing ``run_id`` -- or a Spark retry of a failed stage -- resumes after the last completed
epoch, with the learning rate scaled once (Horovod scaled a resumed rate again).
"""

from __future__ import annotations

import inspect
import math
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar, TypeAlias

import cloudpickle
import numpy as np

from flyte_hvd.launch.output import import_notices_dropped

try:
    with import_notices_dropped():  # TensorFlow's C++ notices, kept out as the ranks' are
        import keras
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "KerasEstimator needs TensorFlow and Keras 3: install the extra "
        "`pip install flyte-hvd[tf]` (or `[tf-cpu]`)."
    ) from error

from flyte_hvd.data.loader import TransformedLoader
from flyte_hvd.data.store import Store
from flyte_hvd.estimators import prediction, tracking, training
from flyte_hvd.estimators.backend import Backend
from flyte_hvd.estimators.base import (
    BatchPredictor,
    Broadcaster,
    HorovodEstimator,
    HorovodModel,
    Metadata,
)
from flyte_hvd.estimators.params import (
    ESTIMATOR_PARAMS,
    NAN_PARAM,
    check_learning_rate,
    passed_params,
    with_params,
)
from flyte_hvd.estimators.tracking import MlflowConfig
from flyte_hvd.estimators.training import TrainingSpec

if TYPE_CHECKING:
    import pyarrow as pa
    import tensorflow as tf

    from flyte_hvd.core.compression import Compressor
    from flyte_hvd.data.dataset import DatasetMetadata
    from flyte_hvd.data.loader import BaseDataLoader, Batch
    from flyte_hvd.data.store import RemoteStore

# What Keras' ``compile`` takes as one output's loss, and as the model's: one for every
# output, a list by output, or a dict by output name.
KerasLoss: TypeAlias = "str | Callable[..., Any] | keras.losses.Loss"
KerasLosses: TypeAlias = "KerasLoss | list[KerasLoss] | dict[str, KerasLoss]"
# A metric as ``compile`` takes it: its name, a function, or a ``keras.metrics.Metric``.
KerasMetric: TypeAlias = "str | Callable[..., Any] | keras.metrics.Metric"

LAST_MODEL_FILENAME = "last.keras"  # the latest epoch, for resuming
BEST_MODEL_FILENAME = "best.keras"  # where a checkpoint callback writes, on rank 0
_EXTENSION = ".keras"
_CUSTOM_OBJECTS_FILE = "custom_objects.pkl"  # in a saved KerasEstimator
# Keras' params: everyone's, and the loss check after each epoch.
KERAS_PARAMS = {**ESTIMATOR_PARAMS, **NAN_PARAM}

__all__ = ["KerasEstimator", "KerasModel", "KerasTrainingSpec", "TransformedLoader"]


@dataclass(kw_only=True)
class KerasTrainingSpec(TrainingSpec):
    """The common spec plus what a Keras rank needs."""

    custom_objects: dict[str, Any]
    learning_rate: float | None
    callbacks: list[keras.callbacks.Callback] = field(default_factory=list)
    checkpoint_callback: keras.callbacks.ModelCheckpoint | None = None
    compression: type[Compressor] | None = None
    # feature column -> the model input's shape per row, where it differs from the column's
    feature_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)


@with_params(KERAS_PARAMS)
class KerasEstimator(HorovodEstimator):
    """Train a Keras 3 model on a Spark DataFrame with Horovod's estimator API.

    ``fit(df)`` prepares the data into the store, checks the model against the columns
    before any rank starts, trains on ``num_proc`` ranks and returns a ``KerasModel``.
    The learning rate given is the single-rank rate: ranks scale it by ``size()``, and the
    returned model's optimizer holds the rate given.

    Example:
        >>> from flyte_hvd.estimators import KerasEstimator
        >>> est = KerasEstimator(num_proc=2, store=store, model=model, optimizer="adam",
        ...                      loss="mse", feature_cols=["features"], label_cols=["y"],
        ...                      batch_size=64, epochs=5, verbose=0)
        >>> predictions = est.fit(train_df).transform(test_df)  # doctest: +SKIP
    """

    _inert_params: ClassVar[dict[str, str]] = {
        "backward_passes_per_step": "each Keras step reduces its gradients",
    }

    def __init__(
        self,
        *,
        num_proc: int | None = None,
        backend: Backend | None = None,
        store: Store | None = None,
        model: keras.Model | None = None,
        optimizer: keras.optimizers.Optimizer | str | None = None,
        loss: KerasLosses | None = None,
        loss_weights: list[float] | dict[str, float] | None = None,
        metrics: list[KerasMetric] | None = None,
        custom_objects: dict[str, Any] | None = None,
        feature_cols: list[str] | None = None,
        label_cols: list[str] | None = None,
        validation: float | str | None = None,
        sample_weight_col: str | None = None,
        callbacks: list[keras.callbacks.Callback] | None = None,
        batch_size: int = 32,
        val_batch_size: int | None = None,
        epochs: int = 1,
        verbose: int = 1,
        shuffle: bool = True,
        shuffle_buffer_size: int | None = None,
        random_seed: int | None = None,
        train_steps_per_epoch: int | None = None,
        validation_steps_per_epoch: int | None = None,
        partitions_per_process: int = 10,
        materialize: bool = True,
        run_id: str | None = None,
        checkpoint_callback: keras.callbacks.ModelCheckpoint | None = None,
        gradient_compression: type[Compressor] | None = None,
        transformation_fn: Callable[[Batch], Batch] | None = None,
        inmemory_cache_all: bool | None = None,
        data_loader: type[BaseDataLoader] | None = None,
        use_gpu: bool = True,
        mlflow: bool | MlflowConfig | None = None,
        backward_passes_per_step: int = 1,
        compress_sparse_cols: bool = False,
        mp_start_method: str | None = None,
        tensorflow_dataset_prefetch_buffer_size: int = 100,
        label_shapes: list[Any] | None = None,
        reader_pool_type: str = "thread",
        train_reader_num_workers: int = 2,
        val_reader_num_workers: int = 2,
        transformation_edit_fields: list[Any] | None = None,
        transformation_removed_fields: list[str] | None = None,
        terminate_on_nan: bool = True,
    ) -> None:
        super().__init__(**passed_params(locals()))

    _framework = "keras"
    _preload = (
        "flyte_hvd.estimators.keras",
        "tensorflow",
        "keras",
        "flyte_hvd.keras",
        # What rank 0's first epoch-end log imports (TensorBoard's writers, boto3): ~1 s.
        "tensorboard.summary.v2",
    )
    _extension = _EXTENSION

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
        optimizer = self.getOptimizer() or model.optimizer
        if isinstance(optimizer, keras.optimizers.Optimizer):
            rate = _learning_rate(optimizer)
            if rate is not None:
                check_learning_rate(rate, f"`optimizer` ({type(optimizer).__name__})")
        _check_identifiers(self.getLoss(), self.getMetrics(), self._custom_objects())

    def _saved_files(self) -> dict[str, bytes]:
        # The model's own classes, saved apart: the model (pickled by Keras, as a .keras file)
        # loads only with them in scope.
        objects = self._custom_objects() if self.getModel() is not None else {}
        return {**super()._saved_files(), _CUSTOM_OBJECTS_FILE: cloudpickle.dumps(objects)}

    @classmethod
    def _from_saved(cls, files: dict[str, bytes]) -> HorovodEstimator:
        objects = cloudpickle.loads(files.get(_CUSTOM_OBJECTS_FILE, cloudpickle.dumps({})))
        with keras.saving.custom_object_scope(objects):
            return super()._from_saved(files)

    def _custom_objects(self) -> dict[str, Any]:
        """``custom_objects`` plus what Keras would find only in this process: the plain
        functions used as loss or metric (Keras saves a function by its name only), and the
        model's own classes (``_model_classes``: registered ones, and layers defined in
        ``__main__``). The ranks (and ``KerasModel``) load the model with these by name, as
        Keras users expect a compiled function loss or a registered layer to just work."""
        model = self.getModel()
        compile_config = getattr(getattr(model, "_compile_config", None), "config", None)
        found = _plain_functions(
            self.getLoss(), self.getMetrics(), getattr(model, "loss", None), compile_config
        )
        return {**_model_classes(model), **found, **(self.getCustomObjects() or {})}

    def _compiled_model(self) -> keras.Model:
        model = self.getModel()
        if self.getOptimizer() is not None or self.getLoss() is not None:
            with keras.saving.custom_object_scope(self._custom_objects()):
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

    def _check_data(self, features: list[str], metadata: Metadata) -> dict[str, Any]:
        columns = {c.name: c for c in metadata[0].columns}
        for tensor, name in zip(self.getModel().inputs, features, strict=True):
            want = tuple(tensor.shape[1:])
            column = columns.get(name)
            if column is None or None in want:
                continue
            have = math.prod(column.shape) if column.shape else 1
            if math.prod(want) != have:
                raise ValueError(
                    f"the model's input `{tensor.name}` takes {math.prod(want)} value(s) per "
                    f"row (shape {want}) but feature column `{name}` holds {have} "
                    f"(shape {column.shape or '()'}): give the model an input of that width, or "
                    f"select the feature columns it was built for."
                )
        losses = self.getLoss() or self.getModel().loss
        for i, (tensor, label) in enumerate(
            zip(self.getModel().outputs, self.getLabelCols(), strict=True)
        ):
            column = columns.get(label)
            dims = tuple(tensor.shape[1:])
            if column is None or None in dims:
                continue
            have = math.prod(column.shape) if column.shape else 1
            want = math.prod(dims)
            loss = _output_loss(losses, i, getattr(tensor, "name", ""), self.getModel())
            if want != have and not (have == 1 and _may_take_class_indices(loss)):
                raise ValueError(
                    f"the model's output {i} gives {want} value(s) per row (shape "
                    f"{dims}) but label column `{label}` holds {have} (shape "
                    f"{column.shape or '()'}), and the loss {_loss_name(loss)!r} compares them "
                    f"value by value: give the model an output of width {have}, or use a "
                    f"sparse loss (e.g. 'sparse_categorical_crossentropy') for class indices."
                )
        return {"custom_objects": self._custom_objects()}

    def _training_spec(
        self, remote_store: RemoteStore, features: list[str], metadata: Metadata, num_proc: int
    ) -> KerasTrainingSpec:
        model = self._compiled_model()
        if not model.optimizer.built:
            # Saved with its slots, the model loads on the ranks without Keras warning that it
            # skipped the optimizer's variables (which would read as a lost optimizer state).
            model.optimizer.build(model.trainable_variables)
        return KerasTrainingSpec(
            **self._spec_fields(remote_store, features, metadata),
            model_bytes=model_to_bytes(model),
            custom_objects=ByValue(self._custom_objects()),
            learning_rate=_learning_rate(model.optimizer),
            callbacks=list(self.getCallbacks() or []),
            checkpoint_callback=self.getCheckpointCallback(),
            compression=self.getGradientCompression(),
            feature_shapes=_feature_shapes(model, features, metadata[0]),
        )

    def _remote_trainer(self):
        return train_on_rank

    def _finished_model(self, run_id: str, features: list[str]) -> bytes:
        model = model_from_bytes(self._read_checkpoint(run_id), self._custom_objects())
        rate = _learning_rate(self._compiled_model().optimizer)
        if rate is not None:
            model.optimizer.learning_rate = rate  # the rate given, as a fit hands back
        return model_to_bytes(model)


class KerasModel(HorovodModel):
    """A trained Keras model as a Transformer. Each prediction column has its label's type
    (``prediction.output_schema``): class probabilities for a scalar label are a vector."""

    _archive_name = "keras_model.zip"
    _model_file = "model.keras"

    def getModel(self) -> keras.Model:
        """The compiled Keras model, usable outside Spark."""
        return super().getModel()

    def _load_model(self, data: bytes) -> keras.Model:
        return model_from_bytes(data, self.getCustomObjects())

    def _model_to_bytes(self, model: keras.Model) -> bytes:
        return model_to_bytes(model)

    def _output_widths(self) -> list[int]:
        return [
            math.prod(d for d in output.shape[1:] if d is not None)
            for output in self.getModel().outputs
        ]

    def _batch_predictor(self, sc: Broadcaster) -> BatchPredictor:
        model_bytes = sc.broadcast(self._trained_bytes())
        custom_objects = ByValue(self.getCustomObjects())

        def predict(columns: list[pa.Array]) -> list[pa.Array]:
            model = _worker_model(model_bytes.value, custom_objects)
            inputs = [
                prediction.column_array(column, tensor.shape[1:])
                for column, tensor in zip(columns, model.inputs, strict=True)
            ]
            outputs = model.predict_on_batch(inputs if len(inputs) > 1 else inputs[0])
            if not isinstance(outputs, list | tuple):
                outputs = [outputs]
            return prediction.prediction_columns(list(outputs), len(columns[0]))

        return predict


KerasEstimator._model_class = KerasModel

# -- on the ranks --------------------------------------------------------------------------


def train_on_rank(spec: KerasTrainingSpec) -> dict:
    """The training function every rank runs (see ``KerasEstimator``)."""
    import tensorflow as tf

    import flyte_hvd.keras as hvd

    with training.rank_run(spec, hvd, _EXTENSION, seed=keras.utils.set_random_seed) as run:
        if not spec.use_gpu:
            tf.config.set_visible_devices([], "GPU")
        else:
            _pin_gpu(tf, hvd.local_rank())
        # Rank 0 starts from the run's last model when resuming; the broadcast callback gives
        # its weights to the others.
        model = model_from_bytes(
            _read(run.resume_file) if run.resume_file else spec.model_bytes, spec.custom_objects
        )
        if spec.learning_rate is not None:
            model.optimizer.learning_rate = spec.learning_rate * run.size  # once, even on resume
        hvd.DistributedOptimizer(
            model.optimizer, compression=spec.compression or hvd.Compression.none
        )
        train, val = _datasets(spec, run.rank, run.size)
        callbacks = [
            hvd.callbacks.BroadcastGlobalVariablesCallback(0),
            hvd.callbacks.MetricAverageCallback(progress=False),  # the run's record reports
            LossCheck(spec, run.rank),  # before anything records the epoch
            *spec.callbacks,
        ]
        best_path = os.path.join(run.work, BEST_MODEL_FILENAME)
        checkpoint = spec.checkpoint_callback
        record = None
        if run.rank == 0:
            if checkpoint is not None:
                checkpoint.filepath = best_path
                if run.best_file is not None:  # keep the best of earlier attempts
                    os.replace(run.best_file, best_path)
                    checkpoint.best = run.best_value
                callbacks.append(checkpoint)
            record = training.RunRecord(
                spec.store, run.state, spec.epochs, _EXTENSION, spec.verbose
            )
            callbacks += [
                EpochTensorBoard(os.path.join(run.work, "logs")),
                RunRecorder(record, run.work, checkpoint),
            ]
        history = model.fit(
            train.dataset,
            validation_data=val.dataset if val else None,
            epochs=spec.epochs,
            initial_epoch=run.initial_epoch,
            steps_per_epoch=train.steps_per_epoch,
            validation_steps=val.steps_per_epoch if val else None,
            callbacks=callbacks,
            verbose=spec.verbose if run.rank == 0 else 0,
            shuffle=False,  # the loader shuffles
        )
        if run.rank == 0 and checkpoint is not None and os.path.exists(best_path):
            model = keras.models.load_model(best_path, custom_objects=spec.custom_objects)
        if spec.learning_rate is not None:
            model.optimizer.learning_rate = spec.learning_rate  # hand back the rate given
        run.log_model(
            record,
            lambda mlflow, registered: mlflow.keras.log_model(
                model,
                name="model",
                registered_model_name=registered,
                pip_requirements=tracking.pinned("keras", "tensorflow", "tensorflow-cpu", "numpy"),
            ),
        )
        return run.result(lambda: model_to_bytes(model), history.history)


# Names Keras' compile() accepts besides those keras.metrics.get resolves.
_COMPILE_METRIC_NAMES = {"accuracy", "acc", "crossentropy", "ce"}


def _check_identifiers(
    loss: KerasLosses | None,
    metrics: list[KerasMetric] | None,
    custom_objects: dict[str, Any] | None,
) -> None:
    """Loss and metric names must resolve on the driver, before any rank starts (a typo
    otherwise surfaces as a traceback from every rank after start-up)."""
    losses = loss.values() if isinstance(loss, dict) else loss if isinstance(loss, list) else [loss]
    with keras.saving.custom_object_scope(custom_objects or {}):
        for item in losses:
            if isinstance(item, str):
                try:
                    keras.losses.get(item)
                except ValueError:
                    raise ValueError(
                        f"`loss`={item!r} is not a Keras loss: use a name Keras knows (e.g. "
                        f"'mse', 'mae', 'binary_crossentropy'), a function, or name it in "
                        f"`custom_objects`."
                    ) from None
        for item in metrics or []:
            if isinstance(item, str) and item not in _COMPILE_METRIC_NAMES:
                try:
                    keras.metrics.get(item)
                except ValueError:
                    raise ValueError(
                        f"`metrics` has {item!r}, which is not a Keras metric: use a name Keras "
                        f"knows (e.g. 'mae', 'accuracy'), a function, or name it in "
                        f"`custom_objects`."
                    ) from None


def _plain_functions(*values: object) -> dict[str, Callable[..., Any]]:
    """The Python functions among ``values`` (nested in lists and dicts) that Keras cannot
    find by name on its own (neither Keras' nor registered), by name."""
    found: dict[str, Callable[..., Any]] = {}

    def walk(value: object) -> None:
        if isinstance(value, dict):
            value = list(value.values())
        if isinstance(value, list | tuple):
            for item in value:
                walk(item)
            return
        if not inspect.isfunction(value) or value.__module__.startswith("keras"):
            return
        if keras.saving.get_registered_object(keras.saving.get_registered_name(value)) is value:
            return
        other = found.setdefault(value.__name__, value)
        if other is not value:
            raise ValueError(
                f"two different functions named `{value.__name__}` are used as loss or metric; "
                f"Keras saves a function by its name: rename one, or map names to them in "
                f"`custom_objects`."
            )

    for value in values:
        walk(value)
    return found


def _model_classes(model: keras.Model) -> dict[str, type]:
    """The classes the model's saved config names that Keras finds in this process only, by
    the name Keras saves them under: registered ones (``register_keras_serializable``: found
    once their module is imported, which the ranks never did) and the model's unregistered
    layers (e.g. defined in ``__main__``)."""
    names: set[str] = set()

    def walk(value: object) -> None:
        if isinstance(value, dict):
            name, module = value.get("registered_name"), value.get("module") or ""
            if isinstance(name, str) and "class_name" in value and not _is_keras(module):
                names.add(name)
            value = list(value.values())
        if isinstance(value, list | tuple):
            for item in value:
                walk(item)

    walk(keras.saving.serialize_keras_object(model))
    layers = {
        keras.saving.get_registered_name(type(layer)): type(layer)
        for layer in model._flatten_layers()
    }
    found = {name: keras.saving.get_registered_object(name) or layers.get(name) for name in names}
    return {name: cls for name, cls in found.items() if cls is not None}


def _is_keras(module: str) -> bool:
    return module.partition(".")[0] in ("keras", "keras_hub", "keras_cv", "keras_nlp")


class ByValue(dict):
    """Custom objects on their way to other processes (the ranks, Spark's Python workers):
    pickled with the definitions of the classes and functions of the user's own modules (not
    installed, e.g. beside the script), which those processes cannot import; unpickled as a
    plain dict, with the registered ones registered again (``_registered``)."""

    def __reduce__(self) -> tuple[Any, ...]:
        modules = {getattr(value, "__module__", None) for value in self.values()}
        own = [sys.modules[m] for m in modules if m and m in sys.modules and _own_module(m)]
        registered = set(cloudpickle.list_registry_pickle_by_value())
        added = [m for m in own if m.__name__ not in registered]
        for module in added:
            cloudpickle.register_pickle_by_value(module)
        try:
            return _registered, (cloudpickle.dumps(dict(self)),)
        finally:
            for module in added:
                cloudpickle.unregister_pickle_by_value(module)


def _registered(data: bytes) -> dict[str, Any]:
    """``ByValue``'s objects, those named ``package>name`` registered under that name again (a
    class rebuilt from its definition is not the one its module registered), so that a model
    saved on the ranks names them as the driver does."""
    objects = cloudpickle.loads(data)
    for name, value in objects.items():
        package, _, short = name.rpartition(">")
        if package and keras.saving.get_registered_name(value) != name:
            keras.saving.register_keras_serializable(package, short)(value)
    return objects


def _own_module(name: str) -> bool:
    """Whether module ``name`` is the user's own: a file outside the interpreter's folders
    (not installed, not the standard library), and not flyte_hvd's or Keras'."""
    if name == "__main__" or _is_keras(name) or name.partition(".")[0] == "flyte_hvd":
        return False  # __main__ is pickled by value anyway
    path = getattr(sys.modules[name], "__file__", None)
    prefixes = (sys.prefix, sys.base_prefix, sys.exec_prefix)
    return isinstance(path, str) and not os.path.abspath(path).startswith(prefixes)


def _output_loss(
    losses: KerasLosses | None, index: int, name: str, model: keras.Model
) -> KerasLoss | None:
    """The loss of output ``index`` (named ``name``) of a one-loss, list or dict ``loss``."""
    if isinstance(losses, dict):
        names = list(getattr(model, "output_names", None) or [])
        key = names[index] if index < len(names) else name
        return losses.get(key, losses.get(name))
    if isinstance(losses, list | tuple):
        return losses[index] if index < len(losses) else None
    return losses


def _loss_name(loss: KerasLoss | None) -> str:
    if isinstance(loss, str):
        return loss
    return str(getattr(loss, "name", None) or getattr(loss, "__name__", type(loss).__name__))


def _may_take_class_indices(loss: KerasLoss | None) -> bool:
    """Whether ``loss`` may take a label of one value per row for a wider output: Keras'
    sparse losses (class indices), and any loss of the user's, whose rule we cannot know."""
    if loss is None:
        return True
    builtin = isinstance(loss, str) or getattr(
        loss if inspect.isfunction(loss) else type(loss), "__module__", ""
    ).startswith("keras")
    return not builtin or "sparse" in _loss_name(loss).lower()


def _pin_gpu(tf: ModuleType, local_rank: int) -> None:
    """One GPU per rank, as Horovod's scripts do: when a rank sees several (Spark assigned
    none, or more than one), it keeps the one at its local rank."""
    gpus = tf.config.list_physical_devices("GPU")
    if len(gpus) > 1:
        tf.config.set_visible_devices(gpus[local_rank % len(gpus)], "GPU")


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


class EpochTensorBoard(keras.callbacks.TensorBoard):
    """TensorBoard logs once per epoch, with no work after each batch. Keras runs the
    callbacks' batch-end hooks on a helper thread only when none of them needs the main
    one; the stock TensorBoard's hook (a no-op at epoch frequency) made every step wait for
    the previous step's logs."""

    async_safe = True

    def __init__(self, log_dir: str):
        super().__init__(log_dir, write_graph=False, profile_batch=0, update_freq="epoch")

    def on_train_batch_end(self, batch, logs=None):
        pass


class LossCheck(keras.callbacks.Callback):
    """Every rank, after each epoch: a NaN or infinite loss ends the fit
    (``training.check_loss``; ``terminate_on_nan``)."""

    def __init__(self, spec: KerasTrainingSpec, rank: int):
        super().__init__()
        self.spec, self.rank = spec, rank

    def on_epoch_end(self, epoch, logs=None):
        training.check_loss(self.spec, logs or {}, epoch, self.rank)


class RunRecorder(keras.callbacks.Callback):
    """Rank 0, after each epoch: save the last model and hand it (and the best one, with a
    checkpoint callback) to the run's ``training.RunRecord``."""

    def __init__(
        self,
        record: training.RunRecord,
        work: str,
        checkpoint: keras.callbacks.ModelCheckpoint | None = None,
    ):
        super().__init__()
        self.record, self.work, self.checkpoint = record, work, checkpoint

    def on_epoch_begin(self, epoch, logs=None):
        self.record.epoch_begin()

    def on_train_batch_begin(self, batch, logs=None):
        self.record.step_begin()

    def on_epoch_end(self, epoch, logs=None):
        last = os.path.join(self.work, LAST_MODEL_FILENAME)
        self.model.save(last)
        best = getattr(self.checkpoint, "best", None)
        self.record.epoch_end(
            epoch,
            logs or {},
            last,
            best_file=os.path.join(self.work, BEST_MODEL_FILENAME),
            logs_dir=os.path.join(self.work, "logs"),
            best_value=None if best is None else float(np.asarray(best)),
        )


@dataclass
class _Data:
    dataset: tf.data.Dataset
    steps_per_epoch: int


def _datasets(spec: KerasTrainingSpec, rank: int, size: int) -> tuple[_Data, _Data | None]:
    train, val = training.make_loaders(spec, rank, size)

    def as_data(loader: BaseDataLoader) -> _Data:
        # Spark's doubles arrive as float64; Keras computes in float32, and custom metrics
        # (which Keras does not cast for) would mix the two.
        dataset = loader.to_tf_dataset(
            spec.features,
            spec.labels,
            spec.sample_weight_col,
            float64_as="float32",
            shapes=spec.feature_shapes,
        )
        return _Data(dataset, len(loader))

    return as_data(train), (as_data(val) if val is not None else None)


def _feature_shapes(
    model: keras.Model, features: list[str], metadata: DatasetMetadata
) -> dict[str, tuple[int, ...]]:
    """The model inputs' shapes per row where a feature column's differs (a flat vector of 784
    for an input of 28 x 28 x 1): the ranks reshape those batches, as Horovod does."""
    shapes = {}
    for tensor, name in zip(model.inputs, features, strict=True):
        want = tuple(tensor.shape[1:])
        if None not in want and want != tuple(metadata.column(name).shape or (1,)):
            shapes[name] = tuple(int(d) for d in want)
    return shapes


# -- model bytes and prediction --------------------------------------------------------------


def model_to_bytes(model: keras.Model) -> bytes:
    """The model in Keras' native ``.keras`` format, as bytes."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "model.keras")
        model.save(path)
        with open(path, "rb") as f:
            return f.read()


def model_from_bytes(data: bytes, custom_objects: dict[str, Any] | None = None) -> keras.Model:
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "model.keras")
        with open(path, "wb") as f:
            f.write(data)
        return keras.models.load_model(path, custom_objects=custom_objects or {})


def _worker_model(data: bytes, custom_objects: dict[str, Any]) -> keras.Model:
    """One loaded model per Python worker and model: Spark reuses workers across tasks."""
    return prediction.worker_model(data, lambda d: model_from_bytes(d, custom_objects))


def _learning_rate(optimizer: keras.optimizers.Optimizer) -> float | None:
    """The optimizer's rate when it is a plain number (a schedule is left alone)."""
    rate = getattr(optimizer, "_learning_rate", None)
    try:
        if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule):
            return None
        return float(np.asarray(optimizer.learning_rate))
    except (TypeError, ValueError):
        return None
