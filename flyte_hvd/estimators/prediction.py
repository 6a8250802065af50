"""Prediction on Spark's Python workers: ``HorovodModel.transform`` hands the model Arrow
batches; these helpers load the model once per worker, turn Arrow columns into arrays and
model outputs back into Arrow columns."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import pyarrow as pa

if TYPE_CHECKING:
    from pyspark.sql.types import DataType, StructType

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


def joined_batches(
    batches: Iterator[pa.Array | tuple[pa.Array, ...]], max_rows: int
) -> Iterator[list[pa.Array]]:
    """Spark's Arrow batches (one array, or a tuple of arrays: one per column) joined in order
    into batches of at most ``max_rows`` rows, each as a list of columns; a batch above
    ``max_rows`` goes alone, as it came."""
    pending: list[tuple[pa.Array, ...]] = []
    rows = 0
    for batch in batches:
        columns = batch if isinstance(batch, tuple) else (batch,)
        if pending and rows + len(columns[0]) > max_rows:
            yield _joined(pending)
            pending, rows = [], 0
        pending.append(columns)
        rows += len(columns[0])
    if pending:
        yield _joined(pending)


def _joined(pending: list[tuple[pa.Array, ...]]) -> list[pa.Array]:
    if len(pending) == 1:
        return list(pending[0])
    return [pa.concat_arrays([batch[i] for batch in pending]) for i in range(len(pending[0]))]


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


def output_schema(
    schema: StructType,
    label_columns: Sequence[str],
    output_columns: Sequence[str],
    metadata: object = None,
    output_widths: Sequence[int] | None = None,
) -> StructType:
    """``schema`` with one prediction column per label appended: the type of what
    ``transform`` adds. A prediction has its label's type: a vector for a vector label, an
    ``array<float>`` for an array label, ``float`` or ``double`` as a floating label is;
    other scalar labels (integers, booleans) get ``double`` predictions, never rounded. Where
    the model gives more than one value per row for a scalar label (class scores), the
    prediction is a vector, as Spark ML's classifiers give ``probability``. The label's type
    comes from ``schema`` or, when the DataFrame has no label column (new data), from
    ``metadata`` (what ``prepare_data`` recorded); each output column is as nullable as its
    label."""
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import types as T

    if len(output_columns) != len(label_columns):
        raise ValueError(
            f"`output_cols` must list one column per label ({len(label_columns)}: "
            f"{list(label_columns)}); found {list(output_columns)}."
        )
    fields = {f.name: f for f in schema.fields}
    recorded = _recorded_columns(metadata)
    added = []
    for i, (label, output) in enumerate(zip(label_columns, output_columns, strict=True)):
        width = output_widths[i] if output_widths is not None else None
        field = fields.get(label)
        kind, dtype = _label_kind(field.dataType if field else None, recorded.get(label))
        wide = width is None or width > 1  # one value per row is a scalar, whatever the label
        if wide and (kind == "vector" or (kind == "scalar" and width is not None)):
            out: T.DataType = VectorUDT()
        elif wide and (kind == "array" or (kind is None and width is not None)):
            out = T.ArrayType(T.FloatType())
        else:
            out = T.FloatType() if dtype == "float32" else T.DoubleType()
        added.append(T.StructField(output, out, field.nullable if field else True))
    return T.StructType([*schema.fields, *added])


def _recorded_columns(metadata: object) -> dict[str, Any]:
    """Column name -> ColumnInfo of a model's metadata (a split's, or the pair)."""
    if isinstance(metadata, list | tuple):
        metadata = metadata[0] if metadata else None
    columns = getattr(metadata, "columns", None)
    if columns is not None:
        return {c.name: c for c in columns}
    return dict(metadata) if isinstance(metadata, dict) else {}


def _label_kind(spark_type: DataType | None, info: Any) -> tuple[str | None, str | None]:
    """("scalar" | "array" | "vector" | None, numpy dtype or None) of a label."""
    from pyspark.sql import types as T

    if spark_type is not None:
        if isinstance(spark_type, T.ArrayType):
            return "array", None
        if type(spark_type).__name__ == "VectorUDT":
            return "vector", None
        floats: dict[type, str] = {T.FloatType: "float32", T.DoubleType: "float64"}
        return "scalar", floats.get(type(spark_type))
    kind = getattr(info, "kind", None)
    if kind is None:
        return None, None
    return ("vector" if kind.endswith("vector") else kind), getattr(info, "dtype", None)
