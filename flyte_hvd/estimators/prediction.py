"""Prediction on Spark's Python workers: ``HorovodModel.transform`` hands the model Arrow
batches; these helpers load the model once per worker, turn Arrow columns into arrays and
model outputs back into Arrow columns."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa

M = TypeVar("M")  # the framework's model

_WORKER_MODELS: dict[int, Any] = {}  # model bytes' hash -> the model ``load`` made of them


def worker_model(data: bytes, load: Callable[[bytes], M]) -> M:
    """One loaded model per Python worker and model bytes: Spark reuses workers across tasks.

    PySpark's worker runs a full ``gc.collect()`` after every task; with TensorFlow or torch
    loaded that walks millions of objects (measured: 0.2 s a task, more than predicting 10 k
    rows). Once the framework and the model are loaded they live as long as the worker, so
    they are frozen out of the collector's reach."""
    key = hash(data)
    if key not in _WORKER_MODELS:
        gc.unfreeze()  # a replaced model can be collected
        _WORKER_MODELS.clear()
        _WORKER_MODELS[key] = load(data)
        gc.freeze()
    return _WORKER_MODELS[key]


def column_array(values: pa.Array, dims: tuple) -> np.ndarray:
    """An Arrow column (scalars, or lists of equal length) as an array of ``(rows, *dims)``
    (``dims`` with a None keeps the column's own width). Lists are read without a copy."""
    rows = len(values)
    if pa.types.is_list(values.type) or pa.types.is_large_list(values.type):
        if values.null_count:
            raise ValueError("a feature column holds nulls; fill or drop them before transform")
        flat = values.flatten().to_numpy(zero_copy_only=False)
        array = flat.reshape(rows, -1) if rows else flat.reshape(0, 0)
    else:
        array = values.to_numpy(zero_copy_only=False)
    dims = tuple(dims)
    if None not in dims:
        array = array.reshape((rows, *dims))
    return array


def prediction_columns(outputs: list[Any], rows: int) -> list[pa.Array]:
    """Model outputs as Arrow result columns: width 1 gives doubles, wider gives lists of
    float32 (``array<float>``)."""
    columns = []
    for out in outputs:
        flat = np.asarray(out).reshape(rows, -1)
        width = flat.shape[1]
        if width == 1:
            columns.append(pa.array(flat[:, 0].astype(np.float64)))
        else:
            offsets = pa.array(np.arange(0, rows * width + 1, width, dtype=np.int32))
            values = pa.array(np.ascontiguousarray(flat, dtype=np.float32).reshape(-1))
            columns.append(pa.ListArray.from_arrays(offsets, values))
    return columns
