"""The on-disk format of a prepared dataset, which ranks read without Spark.

A split is a directory of Parquet files plus a JSON sidecar (``_flyte_hvd_metadata.json``,
written last: it marks the split complete) recording, per column, what it was in Spark, its
dtype and per-row shape. The same column records sit in the Parquet schema too, so shapes
survive when only the Parquet files are read (Horovod issue #1762). ``read_metadata`` recovers
them from either, or infers them from a Parquet dataset written by something else (including
Spark's own layout of ``pyspark.ml.linalg`` vectors).

Vectors and arrays are stored as fixed-length list columns; an all-sparse vector column may be
stored as (indices, values). ``decode_column`` turns any of these into a numpy array of shape
``(rows, *shape)``, without a Python loop over rows.

Imports numpy, pyarrow and fsspec only: no pyspark, no TensorFlow.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from flyte_hvd.core.types import JSONObject
from flyte_hvd.data.parquet import (
    METADATA_FILENAME,
    FileSystem,
    as_arrow_filesystem,
    open_parquet_dataset,
)
from flyte_hvd.data.store import RemoteStore, Store, bounded

if TYPE_CHECKING:
    import pyarrow.dataset as ds

FORMAT = "flyte_hvd.dataset/1"
FIELD_METADATA_KEY = "flyte_hvd"  # per column, in the Spark and Arrow schemas
SCHEMA_METADATA_KEY = b"flyte_hvd.columns"
SPARK_ROW_METADATA_KEY = b"org.apache.spark.sql.parquet.row.metadata"

KINDS = ("scalar", "array", "dense_vector", "sparse_vector", "vector")
# plain: a scalar column. list: fixed-length list. sparse: struct<indices, values>.
# vector_struct: Spark's own vector layout struct<type, size, indices, values>.
ENCODINGS = ("plain", "list", "sparse", "vector_struct")
VECTOR_KINDS = ("dense_vector", "sparse_vector", "vector")
VECTOR_FIELDS = ("type", "size", "indices", "values")


@dataclass(frozen=True)
class ColumnInfo:
    """One stored column: what it was in Spark, and how to turn it into numpy."""

    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...] = ()
    encoding: str = "plain"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(
                f"column `{self.name}`: `kind` must be one of {KINDS}; found {self.kind!r}."
            )
        if self.encoding not in ENCODINGS:
            raise ValueError(
                f"column `{self.name}`: `encoding` must be one of {ENCODINGS}; "
                f"found {self.encoding!r}."
            )
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        np.dtype(self.dtype)  # raises on a bad dtype name

    @property
    def size(self) -> int:
        """Values per row."""
        return math.prod(self.shape)

    def to_dict(self) -> JSONObject:
        return {
            "name": self.name,
            "kind": self.kind,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "encoding": self.encoding,
        }

    @classmethod
    def from_dict(cls, d: JSONObject) -> ColumnInfo:
        return cls(
            d["name"], d["kind"], d["dtype"], tuple(d.get("shape", ())), d.get("encoding", "plain")
        )


@dataclass(frozen=True)
class DatasetMetadata:
    """One split of a prepared dataset (or any Parquet dataset): columns, rows and bytes."""

    columns: tuple[ColumnInfo, ...]
    rows: int
    bytes: int
    files: int
    row_groups: int
    dataset_idx: str | None = None
    split: str | None = None
    key: str | None = None
    label_columns: tuple[str, ...] = ()
    feature_columns: tuple[str, ...] = ()
    sample_weight_col: str | None = None

    @property
    def column_names(self) -> list[str]:
        return [c.name for c in self.columns]

    def column(self, name: str) -> ColumnInfo:
        for c in self.columns:
            if c.name == name:
                return c
        raise ValueError(
            f"column `{name}` is not in the dataset; its columns are {self.column_names}."
        )

    @property
    def avg_row_size(self) -> float:
        return self.bytes / self.rows if self.rows else 0.0

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT,
                "dataset_idx": self.dataset_idx,
                "split": self.split,
                "key": self.key,
                "rows": self.rows,
                "bytes": self.bytes,
                "files": self.files,
                "row_groups": self.row_groups,
                "label_columns": list(self.label_columns),
                "feature_columns": list(self.feature_columns),
                "sample_weight_col": self.sample_weight_col,
                "columns": [c.to_dict() for c in self.columns],
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> DatasetMetadata:
        d = json.loads(text)
        if d.get("format") != FORMAT:
            raise ValueError(
                f"dataset metadata has format {d.get('format')!r}; this version "
                f"of flyte-hvd reads {FORMAT!r}. Prepare the data again."
            )
        return cls(
            columns=tuple(ColumnInfo.from_dict(c) for c in d["columns"]),
            rows=d["rows"],
            bytes=d["bytes"],
            files=d["files"],
            row_groups=d["row_groups"],
            dataset_idx=d.get("dataset_idx"),
            split=d.get("split"),
            key=d.get("key"),
            label_columns=tuple(d.get("label_columns", ())),
            feature_columns=tuple(d.get("feature_columns", ())),
            sample_weight_col=d.get("sample_weight_col"),
        )


# What ``check_shape_compatibility`` reads column sizes from: a split's metadata (or the
# (train, validation) pair), or a mapping of column to ColumnInfo or to a dict with a
# ``shape`` (``get_simple_meta_from_parquet``'s; a per-row shape or a count of values).
ShapeSource: TypeAlias = (
    "DatasetMetadata | Sequence[DatasetMetadata | None] | dict[str, ColumnInfo | JSONObject]"
)


def values_per_row(metadata: ShapeSource, column: str) -> int:
    """How many values one row of ``column`` holds (1 for a scalar)."""
    if isinstance(metadata, list | tuple):
        metadata = metadata[0]
    if isinstance(metadata, DatasetMetadata):
        return metadata.column(column).size
    if not isinstance(metadata, dict):
        raise ValueError(
            f"`metadata` must be a dataset's metadata (DatasetMetadata) or a dict of column "
            f"to its metadata; found {type(metadata).__name__}."
        )
    if column not in metadata:
        raise ValueError(f"column `{column}` is not in the metadata; it has {sorted(metadata)}.")
    info = metadata[column]
    if isinstance(info, ColumnInfo):
        return info.size
    shape = info.get("shape", ())
    return int(shape) if isinstance(shape, int) else math.prod(shape)  # type: ignore[arg-type]


def check_shape_compatibility(
    metadata: ShapeSource,
    feature_columns: Sequence[str],
    label_columns: Sequence[str],
    input_shapes: Sequence[Sequence[int]] | None = None,
    output_shapes: Sequence[Sequence[int]] | None = None,
    label_shapes: Sequence[Sequence[int]] | None = None,
) -> None:
    """Each given shape fits its column: one shape per column, and its dimensions (a batch
    dimension -1 left out) multiply to the values one row of the column holds.
    ``input_shapes`` pair with ``feature_columns``, ``output_shapes`` and ``label_shapes``
    with ``label_columns``.

    Raises:
        ValueError: naming the column, the shape and the size that fits.
    """
    for arg, shapes, columns in (
        ("input_shapes", input_shapes, feature_columns),
        ("output_shapes", output_shapes, label_columns),
        ("label_shapes", label_shapes, label_columns),
    ):
        if shapes is None:
            continue
        if len(shapes) != len(columns):
            raise ValueError(
                f"`{arg}` must give one shape per column ({len(columns)}: {list(columns)}); "
                f"found {len(shapes)}: {list(shapes)}."
            )
        for i, (shape, column) in enumerate(zip(shapes, columns, strict=True)):
            have = values_per_row(metadata, column)
            dims = list(shape)[1:] if list(shape)[:1] == [-1] else list(shape)
            if any(d < 1 for d in dims) or math.prod(dims) != have:
                raise ValueError(
                    f"`{arg}`[{i}]={list(shape)} does not fit column `{column}`, which holds "
                    f"{have} value(s) per row: its dimensions (after a batch dimension -1) "
                    f"must multiply to {have}."
                )


def get_dataset_metadata(
    store: Store | RemoteStore, dataset_idx: str | int | None
) -> tuple[DatasetMetadata, DatasetMetadata | None]:
    """The train and (if prepared) validation metadata of ``dataset_idx``."""
    st = store.store if isinstance(store, RemoteStore) else store
    # Within the store's timeout (``bounded``): a store that stops answering fails the fit.
    train_path = st.get_train_data_path(dataset_idx)
    train = bounded(st, ("reading", "from"), train_path, 0, read_metadata, st, train_path)
    val_path = st.get_val_data_path(dataset_idx)
    has_val = bounded(st, ("looking for", "in"), val_path, 0, st.exists, val_path)
    val = None
    if has_val:
        val = bounded(st, ("reading", "from"), val_path, 0, read_metadata, st, val_path)
    return train, val


# -- writing: Arrow batches from Spark in the stored layout ---------------------------------


def arrow_storage_schema(infos: list[ColumnInfo]) -> pa.Schema:
    fields = []
    for i in infos:
        t = pa.from_numpy_dtype(np.dtype(i.dtype))
        if i.encoding == "list":
            t = pa.list_(t)
        elif i.encoding == "sparse":
            t = pa.struct([("indices", pa.list_(pa.int32())), ("values", pa.list_(t))])
        meta = {FIELD_METADATA_KEY: json.dumps(i.to_dict())}
        fields.append(pa.field(i.name, t, nullable=False, metadata=meta))
    cols = json.dumps([i.to_dict() for i in infos])
    return pa.schema(fields, metadata={SCHEMA_METADATA_KEY: cols})


def encode_batch(batch: pa.RecordBatch, infos: Sequence[ColumnInfo]) -> pa.RecordBatch:
    """Spark's Arrow columns (vectors as Spark's struct) in the stored layout of ``infos``."""
    arrays = []
    for i in infos:
        arr = batch.column(i.name)
        # (A vector column may arrive as an array already: ``prepare.stream_data``'s.)
        if i.kind in VECTOR_KINDS and i.encoding == "list" and pa.types.is_struct(arr.type):
            dense = vector_struct_to_dense(arr, i.size)
            offsets = pa.array(np.arange(0, dense.size + 1, i.size, dtype=np.int32))
            arr = pa.ListArray.from_arrays(offsets, pa.array(dense.reshape(-1)))
        elif i.encoding == "sparse":
            arr = pa.StructArray.from_arrays(
                [arr.field("indices"), arr.field("values")], names=["indices", "values"]
            )
        arrays.append(arr)
    schema = arrow_storage_schema(list(infos))
    arrays = [
        a if a.type == f.type else a.cast(f.type) for a, f in zip(arrays, schema, strict=True)
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def partition_splits(
    table: pa.Table, infos: Sequence[ColumnInfo], with_validation: bool, folder: str | None = None
) -> tuple[pa.Table, pa.Table | None]:
    """A rank's partition of a streamed DataFrame (``prepare.stream_data``) in the stored
    layout of ``infos``, as a loader reads Parquet: its training rows, and its validation
    rows (None without a validation split). With ``folder``, each split is written there
    batch by batch as an Arrow file and comes back memory-mapped, so that the rank's memory
    holds one batch of it at a time (the page cache the rest, the disk what does not fit)."""
    from flyte_hvd.data.split import SPLIT_COL

    schema = arrow_storage_schema(list(infos))

    def rows(validation: bool | None) -> Iterator[pa.RecordBatch]:
        for batch in table.to_batches():
            if validation is not None:
                is_val = batch.column(SPLIT_COL)
                batch = batch.filter(is_val if validation else pc.invert(is_val))
            yield encode_batch(batch, infos)

    def stored(validation: bool | None) -> pa.Table:
        if folder is None:
            return pa.Table.from_batches(list(rows(validation)), schema)
        path = os.path.join(folder, f"{'validation' if validation else 'training'}.arrow")
        with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
            for batch in rows(validation):
                writer.write_batch(batch)
        return pa.ipc.open_file(pa.memory_map(path)).read_all()

    if not with_validation:
        return stored(None), None
    return stored(False), stored(True)


# -- reading metadata ------------------------------------------------------------------------


def read_metadata(store: Store | RemoteStore, path: str) -> DatasetMetadata:
    """The metadata of the Parquet dataset at ``path``: from ``prepare_data``'s sidecar if
    there is one, else from the Parquet schema (flyte-hvd's column records, or Spark's), else
    inferred from the Arrow types and the first rows.

    Raises:
        ValueError: ``path`` holds no Parquet files.
    """
    return read_metadata_fs(store.arrow_filesystem, store.fs_path(path))


def read_metadata_fs(filesystem: FileSystem, path: str) -> DatasetMetadata:
    """``read_metadata`` on a pyarrow or fsspec filesystem and a path inside it."""
    fs = as_arrow_filesystem(filesystem)
    sidecar = f"{path.rstrip('/')}/{METADATA_FILENAME}"
    try:
        with fs.open_input_stream(sidecar) as f:
            return DatasetMetadata.from_json(f.read().decode("utf-8"))
    except (FileNotFoundError, NotADirectoryError):  # no sidecar, or `path` is one file
        pass
    except OSError as error:  # some pyarrow filesystems raise OSError for a missing file
        if "not found" not in str(error).lower() and "no such file" not in str(error).lower():
            raise
    return scan_parquet(fs, path, None)


def scan_parquet(
    fs: FileSystem, path: str, infos: tuple[ColumnInfo, ...] | None
) -> DatasetMetadata:
    dataset = open_parquet_dataset(fs, path)
    fragments = list(dataset.get_fragments())
    rows = row_groups = 0
    for frag in fragments:
        rows += frag.metadata.num_rows
        row_groups += frag.metadata.num_row_groups
    nbytes = sum(i.size or 0 for i in fs.get_file_info([f.path for f in fragments]))
    if infos is None:
        infos = _infos_from_schema(dataset.schema, fragments)
    return DatasetMetadata(
        columns=infos, rows=rows, bytes=nbytes, files=len(fragments), row_groups=row_groups
    )


def _infos_from_schema(
    schema: pa.Schema, fragments: list[ds.ParquetFileFragment]
) -> tuple[ColumnInfo, ...]:
    recorded: dict[str, JSONObject] = {}
    spark_json = (schema.metadata or {}).get(SPARK_ROW_METADATA_KEY)
    if spark_json:
        for f in json.loads(spark_json).get("fields", []):
            if FIELD_METADATA_KEY in (f.get("metadata") or {}):
                recorded[f["name"]] = f["metadata"][FIELD_METADATA_KEY]
    for f in schema:
        if f.metadata and FIELD_METADATA_KEY.encode() in f.metadata:
            recorded[f.name] = json.loads(f.metadata[FIELD_METADATA_KEY.encode()])
    infos, unknown = {}, []
    for f in schema:
        if f.name in recorded:
            infos[f.name] = ColumnInfo.from_dict(recorded[f.name])
            continue
        guess = _guess(f)
        if guess is not None:
            infos[f.name] = guess
            if guess.kind != "scalar" and not guess.shape:
                unknown.append(f.name)
    if unknown:  # list lengths and vector sizes come from the first row that has one
        first = fragments[0].to_table(columns=unknown)
        for frag in fragments[1:]:
            if first.num_rows:
                break
            first = frag.to_table(columns=unknown)
        for name in unknown:
            info = infos[name]
            length = _first_length(first.column(name).combine_chunks(), info.encoding)
            if length is None:
                del infos[name]
            else:
                infos[name] = ColumnInfo(name, info.kind, info.dtype, (length,), info.encoding)
    return tuple(infos[f.name] for f in schema if f.name in infos)


def _numpy_dtype(t: pa.DataType) -> str | None:
    if pa.types.is_boolean(t) or pa.types.is_integer(t) or pa.types.is_floating(t):
        return np.dtype(t.to_pandas_dtype()).name
    return None


def _guess(f: pa.Field) -> ColumnInfo | None:
    t = f.type
    if (dtype := _numpy_dtype(t)) is not None:
        return ColumnInfo(f.name, "scalar", dtype)
    if pa.types.is_fixed_size_list(t) and (dtype := _numpy_dtype(t.value_type)):
        return ColumnInfo(f.name, "array", dtype, (t.list_size,), "list")
    if (pa.types.is_list(t) or pa.types.is_large_list(t)) and (dtype := _numpy_dtype(t.value_type)):
        return ColumnInfo(f.name, "array", dtype, (), "list")
    if pa.types.is_struct(t) and sorted(t.field(i).name for i in range(t.num_fields)) == sorted(
        VECTOR_FIELDS
    ):
        return ColumnInfo(f.name, "vector", "float64", (), "vector_struct")
    return None


def _first_length(arr: pa.Array, encoding: str) -> int | None:
    arr = arr.drop_null()
    if len(arr) == 0:
        return None
    if encoding == "vector_struct":
        typ = arr.field("type")[0].as_py()
        return arr.field("size")[0].as_py() if typ == 0 else len(arr.field("values")[0])
    return len(arr[0])


# -- decoding: a stored column to numpy ------------------------------------------------------


def _list_parts(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(row lengths, flat values) of a list array, honouring slices."""
    offsets = arr.offsets.to_numpy()
    values = arr.values.slice(offsets[0], offsets[-1] - offsets[0])
    return np.diff(offsets), values.to_numpy(zero_copy_only=False)


def _scatter(
    n: int, size: int, lengths: np.ndarray, values: np.ndarray, positions: np.ndarray, dtype: str
) -> np.ndarray:
    out = np.zeros((n, size), dtype=dtype)
    rows = np.repeat(np.arange(n), lengths)
    if len(positions) and (positions.min() < 0 or positions.max() >= size):
        raise ValueError(f"a sparse vector has an index outside [0, {size}).")
    out[rows, positions] = values
    return out


def vector_struct_to_dense(arr: pa.Array, size: int) -> np.ndarray:
    """Spark's vector struct (type 0 sparse / 1 dense, size, indices, values) as a dense
    ``(rows, size)`` float64 array, without a Python loop."""
    if arr.null_count:
        raise ValueError("a vector column has null rows; drop or fill them first.")
    n = len(arr)
    typ = arr.field("type").to_numpy(zero_copy_only=False)
    lengths, values = _list_parts(arr.field("values"))
    dense = typ == 1
    if dense.all():
        if not (lengths == size).all():
            raise ValueError(
                f"dense vectors of lengths {sorted(set(lengths.tolist()))} where "
                f"{size} was recorded; every row must have the same size."
            )
        return values.astype(np.float64, copy=False).reshape(n, size)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    positions = np.arange(len(values)) - starts
    sparse_elems = np.repeat(~dense, lengths)
    indices = pc.list_flatten(arr.field("indices").filter(pa.array(~dense)))
    positions[sparse_elems] = indices.to_numpy(zero_copy_only=False)
    return _scatter(n, size, lengths, values, positions, "float64")


def sparse_to_dense(arr: pa.Array, size: int, dtype: str) -> np.ndarray:
    """The ``sparse`` encoding (struct of indices and values) as ``(rows, size)``."""
    lengths, values = _list_parts(arr.field("values"))
    _, indices = _list_parts(arr.field("indices"))
    return _scatter(len(arr), size, lengths, values, indices.astype(np.int64), dtype)


def decode_column(column: pa.Array | pa.ChunkedArray, info: ColumnInfo) -> np.ndarray:
    """A stored column as a numpy array of shape ``(rows, *info.shape)``."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    n = len(column)
    if info.encoding == "plain":
        return column.to_numpy(zero_copy_only=False)
    if info.encoding == "vector_struct":
        return vector_struct_to_dense(column, info.size).reshape(n, *info.shape)
    if info.encoding == "sparse":
        return sparse_to_dense(column, info.size, info.dtype).reshape(n, *info.shape)
    if pa.types.is_fixed_size_list(column.type):
        values = column.flatten().to_numpy(zero_copy_only=False)
    else:
        if column.null_count:
            raise ValueError(f"column `{info.name}` has null rows; drop or fill them first.")
        lengths, values = _list_parts(column)
        if n and not (lengths == info.size).all():
            raise ValueError(
                f"column `{info.name}` has rows of lengths {sorted(set(lengths.tolist()))[:5]} "
                f"where {info.size} was recorded; every row must have the same length."
            )
    return values.reshape(n, *info.shape)
