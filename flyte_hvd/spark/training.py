"""What every estimator's training function shares on the ranks, whatever the framework: the
spec's common fields, the data loaders, and the run's record in the store (read to resume,
written by rank 0 after each epoch). Imports no deep-learning framework and no pyspark.

A run in the store::

    runs/<run_id>/checkpoint<ext>   the best model (with a checkpoint callback) or the last
    runs/<run_id>/last<ext>         the last completed epoch, for resuming
    runs/<run_id>/state.json        epochs completed, metric history, epoch seconds
    runs/<run_id>/logs/             TensorBoard (or other) logs

Every file is replaced atomically, and ``state.json`` last, so it never names an epoch whose
model is not saved.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from flyte_hvd.spark.store import DEFAULT_CHECKPOINT_FILENAME


@dataclass(kw_only=True)
class TrainingSpec:
    """Everything a rank needs to train, as plain values (no driver objects); each framework
    adds its own fields in a subclass."""

    store: Any  # RemoteStore
    model_bytes: bytes
    features: list[str]
    labels: list[str]
    sample_weight_col: str | None
    metadata: Any  # (train DatasetMetadata, validation DatasetMetadata or None)
    batch_size: int
    val_batch_size: int
    epochs: int
    verbose: int
    shuffle: bool
    shuffle_buffer_size: int | None
    random_seed: int | None
    train_steps_per_epoch: int | None
    validation_steps_per_epoch: int | None
    transformation_fn: Any = None
    inmemory_cache_all: bool = False
    data_loader: Any = None
    use_gpu: bool = True


# -- the run in the store ----------------------------------------------------------------------


def run_file(store: Any, name: str) -> str:
    """``runs/<run_id>/<name>`` of the store's run."""
    return store.run_path.rstrip("/") + "/" + name


def checkpoint_path(store: Any, extension: str) -> str:
    """Where the run's model goes: the store's ``checkpoint_filename`` when one was chosen,
    else ``checkpoint<extension>`` (``.keras``, ``.pt``, ``.ckpt``)."""
    name = getattr(getattr(store, "store", store), "checkpoint_filename", None)
    if name and name != DEFAULT_CHECKPOINT_FILENAME:
        return store.checkpoint_path
    return run_file(store, f"checkpoint{extension}")


def read_run_state(store: Any) -> dict | None:
    """The run's ``state.json``, or None for a new run."""
    if not store.exists(store.state_path):
        return None
    return json.loads(store.read(store.state_path))


def merge_history(state: dict | None, new: dict[str, list[float]]) -> dict[str, list[float]]:
    """The history of earlier attempts of the run followed by this attempt's epochs."""
    past = (state or {}).get("history", {})
    keys = list(past) + [k for k in new if k not in past]
    return {k: list(past.get(k, [])) + [float(v) for v in new.get(k, [])] for k in keys}


class RunRecord:
    """Rank 0's record of the run: after each epoch it publishes the checkpoint (the best
    model when there is one, else the last), the last model, the logs and then
    ``state.json``, and prints one summary line."""

    def __init__(self, store: Any, state: dict | None, epochs: int, extension: str,
                 verbose: int = 1):  # fmt: skip
        self.store, self.epochs, self.verbose = store, epochs, verbose
        self.checkpoint_path = checkpoint_path(store, extension)
        self.last_path = run_file(store, f"last{extension}")
        self.history = {k: list(v) for k, v in (state or {}).get("history", {}).items()}
        self.epoch_seconds = list((state or {}).get("epoch_seconds", []))
        self.first_step_at: float | None = None
        self.started = time.monotonic()

    def epoch_begin(self) -> None:
        self.started = time.monotonic()

    def step_begin(self) -> None:
        if self.first_step_at is None:
            self.first_step_at = time.time()

    def epoch_end(self, epoch: int, logs: dict[str, float], last_file: str,
                  best_file: str | None = None, logs_dir: str | None = None) -> None:  # fmt: skip
        for key, value in logs.items():
            self.history.setdefault(key, []).append(float(value))
        store = self.store
        best = best_file if best_file and os.path.exists(best_file) else last_file
        store.upload_file(best, self.checkpoint_path)
        store.upload_file(last_file, self.last_path)
        if logs_dir and os.path.isdir(logs_dir):
            store.upload_dir(logs_dir, store.logs_path)
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
        if self.verbose:
            metrics = "  ".join(f"{k}={float(v):.4g}" for k, v in sorted(logs.items()))
            print(f"epoch {epoch + 1}/{self.epochs}  {metrics}  ({seconds:.1f}s)", flush=True)


# -- data --------------------------------------------------------------------------------------


def make_loaders(spec: TrainingSpec, rank: int, size: int) -> tuple[Any, Any | None]:
    """This rank's train loader and validation loader (None without validation data), with
    ``transformation_fn`` applied to each batch."""
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
        return loader

    train = make(spec.store.train_data_path, train_meta, spec.batch_size, spec.shuffle,
                 spec.train_steps_per_epoch)  # fmt: skip
    val = None
    if val_meta is not None:
        val = make(spec.store.val_data_path, val_meta, spec.val_batch_size, False,
                   spec.validation_steps_per_epoch)  # fmt: skip
    return train, val


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


# -- prediction on Spark's Python workers ------------------------------------------------------

_WORKER_MODELS: dict[int, Any] = {}


def worker_model(data: bytes, load: Callable[[bytes], Any]) -> Any:
    """One loaded model per Python worker and model bytes: Spark reuses workers across tasks."""
    key = hash(data)
    if key not in _WORKER_MODELS:
        _WORKER_MODELS.clear()
        _WORKER_MODELS[key] = load(data)
    return _WORKER_MODELS[key]


def column_array(series: Any, dims: tuple) -> np.ndarray:
    """A pandas column (scalars or arrays) as an array of ``(rows, *dims)`` (``dims`` with a
    None keeps the column's own shape)."""
    first = series.iloc[0] if len(series) else None
    if isinstance(first, list | tuple | np.ndarray):
        values = np.stack([np.asarray(v) for v in series])
    else:
        values = series.to_numpy()
    dims = tuple(dims)
    if None not in dims:
        values = values.reshape((len(series), *dims))
    return values


def prediction_columns(outputs: list[Any], rows: int) -> list[Any]:
    """Model outputs as result columns: width 1 gives doubles, wider gives float32 arrays."""
    predictions = []
    for out in outputs:
        flat = np.asarray(out).reshape(rows, -1)
        if flat.shape[1] == 1:
            predictions.append(flat[:, 0].astype(np.float64))
        else:
            predictions.append(list(flat.astype(np.float32)))
    return predictions
