"""``prepare_data``: a Spark DataFrame to Parquet in the Store, for the ranks to read.

One Spark aggregation checks the selected columns in the JVM (rows, nulls, NaN labels, vector
and array lengths, sparse or dense), so bad data fails before anything is written; then each
split is written as about ``num_processes * partitions_per_process`` files of equal row counts,
by Spark itself when the cluster can reach the store's URL, otherwise by each task uploading
its files through the store's fsspec filesystem. The format is in ``flyte_hvd.data.dataset``.

pyspark is imported only inside the functions that run Spark jobs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

import pyarrow as pa

from flyte_hvd.core.log import get_logger, verbosity_level
from flyte_hvd.core.types import JSONObject
from flyte_hvd.data.dataset import (
    FIELD_METADATA_KEY,
    FORMAT,
    METADATA_FILENAME,
    VECTOR_KINDS,
    ColumnInfo,
    DatasetMetadata,
    arrow_storage_schema,
    encode_batch,
    get_dataset_metadata,
    read_metadata,
    scan_parquet,
)
from flyte_hvd.data.parquet import as_arrow_filesystem
from flyte_hvd.data.store import Store, bounded
from flyte_hvd.launch.environment import local_storage_env

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession
    from pyspark.sql.connect.session import SparkSession as ConnectSparkSession
    from pyspark.sql.types import DataType

# A classic SparkSession or a Spark Connect one: the two share no base class.
AnySparkSession: TypeAlias = "SparkSession | ConnectSparkSession"
# What one aggregation found: "rows", "val_rows" and per column ("cols") counts and lengths
# (see ``_collect_stats``); ints, or None where a column has no rows.
Stats: TypeAlias = dict[str, Any]

logger = get_logger(__name__)
T = TypeVar("T")  # what a Spark action returns

__all__ = [
    "ColumnInfo",
    "DatasetMetadata",
    "dataframe_metadata",
    "get_dataset_metadata",
    "prepare_data",
    "read_metadata",
    "train_val_split",
]

SPLIT_SEED = 20230612  # random validation split: the same rows on every prepare
_SPLIT_COL = "__flyte_hvd_is_val"
# Data per write task, as Spark's own split size (spark.sql.files.maxPartitionBytes): a small
# split is written by few tasks, each writing several files, since every task and every
# committed file costs tens of milliseconds whatever its size (measured: 200k rows in 20 files
# by 2 tasks take three quarters of the time 20 tasks take).
WRITE_TASK_BYTES = 128 << 20
# How long an interrupted write may take to end its Spark jobs (and Spark its cleanup) before
# the interrupt goes on regardless.
CANCEL_WAIT_S = 60.0

# -- prepare_data ----------------------------------------------------------------------------


@contextlib.contextmanager
def prepare_data(
    num_processes: int,
    store: Store,
    df: DataFrame,
    label_columns: Sequence[str],
    feature_columns: Sequence[str] | None = None,
    validation: float | str | None = None,
    sample_weight_col: str | None = None,
    compress_sparse: bool = False,
    partitions_per_process: int = 10,
    verbose: int = 0,
    allow_non_finite_features: bool = False,
    on_checked: Callable[[], object] | None = None,
) -> Iterator[str]:
    """Write ``df``'s selected columns to Parquet in ``store``; yields the dataset index.

    ``with prepare_data(2, store, df, ["y"]) as idx:`` then
    ``get_dataset_metadata(store, idx)`` and loaders over ``store.get_train_data_path(idx)``.
    The data stays in the store after the block, and preparing the same DataFrame (same plan,
    schema, columns and options) again reuses it.

    Args:
        num_processes: ranks that will read the data; each split gets at least this many
            Parquet files so that every rank has a shard.
        label_columns: the label columns to keep.
        feature_columns: the feature columns to keep (default: every column that is not a
            label, the sample weight or the validation column).
        validation: a float in (0, 1) for a seeded random split, or the name of a column
            whose true/non-zero rows go to validation (the column is not stored).
        sample_weight_col: a numeric column of per-row weights.
        compress_sparse: store vector columns whose rows are all sparse as (indices, values).
        partitions_per_process: Parquet files per process and split.
        verbose: 1 logs what was written or reused at INFO (0: at DEBUG).
        allow_non_finite_features: keep NaN and infinity in feature columns (refused by
            default: they make the loss NaN without a word).
        on_checked: called once the data passed its checks, just before Spark writes it
            (not when a prepared dataset is reused); the estimators start rank processes
            then, so that their imports run during the write.

    Raises:
        ValueError: bad arguments or data: a missing column, an unsupported type, no rows,
            an empty split, a null, or NaN or infinity in any column (a NaN makes the loss
            NaN and ruins every weight after one step, so it is refused here).
        RuntimeError: the data could not be written (nothing half-written is kept).

    Example:
        >>> from flyte_hvd.data import Store, get_dataset_metadata, prepare_data
        >>> store = Store.create(work_dir)  # a path, or s3://bucket/exp, hdfs://..., dbfs:/...
        >>> with prepare_data(2, store, df, label_columns=["y"], validation=0.2) as idx:
        ...     train_meta, val_meta = get_dataset_metadata(store, idx)  # doctest: +SKIP
        >>> train_meta.rows + val_meta.rows == df.count()  # doctest: +SKIP
        True
    """
    yield _prepare(
        num_processes,
        store,
        df,
        label_columns,
        feature_columns,
        validation,
        sample_weight_col,
        compress_sparse,
        partitions_per_process,
        verbose,
        allow_non_finite_features,
        on_checked,
    )


def _prepare(
    num_processes,
    store,
    df,
    label_columns,
    feature_columns,
    validation,
    sample_weight_col,
    compress_sparse,
    partitions_per_process,
    verbose,
    allow_non_finite_features=False,
    on_checked=None,
) -> str:
    _check_count("num_processes", num_processes)
    _check_count("partitions_per_process", partitions_per_process)
    if not isinstance(store, Store):
        raise ValueError(
            f"`store` must be a flyte_hvd Store (Store.create(prefix_path)); "
            f"found {type(store).__name__}."
        )
    check_spark_dataframe(df, "`df`")
    labels = _names("label_columns", label_columns)
    if not labels:
        raise ValueError("`label_columns` is empty; name at least one label column.")
    val_col = validation if isinstance(validation, str) else None
    _check_validation(validation)
    weight = [sample_weight_col] if sample_weight_col is not None else []
    if sample_weight_col is not None and not isinstance(sample_weight_col, str):
        raise ValueError(f"`sample_weight_col` must be a column name; found {sample_weight_col!r}.")
    available = list(df.columns)
    for arg, names in (
        ("label_columns", labels),
        ("sample_weight_col", weight),
        ("validation", [val_col] if val_col else []),
    ):
        _check_exist(arg, names, available)
    if feature_columns is None:
        skip = {*labels, *weight, val_col}
        features = [c for c in available if c not in skip]
        if not features:
            raise ValueError(
                f"no feature columns: the DataFrame has only {available}; pass "
                f"`feature_columns` or add features."
            )
    else:
        features = _names("feature_columns", feature_columns)
        _check_exist("feature_columns", features, available)
    selected = list(dict.fromkeys([*features, *labels, *weight]))
    types = {f.name: f.dataType for f in df.schema.fields}
    kinds = {c: _spark_kind(c, types[c]) for c in selected}
    for c in weight:
        if kinds[c][0] != "scalar":
            raise ValueError(
                f"`sample_weight_col` `{c}` must be a numeric scalar column; it "
                f"has type {types[c].simpleString()}."
            )
    if val_col is not None:
        try:
            val_kind = _spark_kind(val_col, types[val_col])[0]
        except ValueError:
            val_kind = None
        if val_kind != "scalar":
            raise ValueError(
                f"`validation` column `{val_col}` must be boolean or numeric; it "
                f"has type {types[val_col].simpleString()}."
            )

    options = {
        "features": features,
        "labels": labels,
        "weight": sample_weight_col,
        "validation": validation,
        "compress_sparse": bool(compress_sparse),
        "num_processes": num_processes,
        "partitions_per_process": partitions_per_process,
    }
    if allow_non_finite_features:
        options["allow_non_finite_features"] = True
    key = _dataset_key(df, options)
    idx = key[:16]
    paths = {"train": store.get_train_data_path(idx)}
    if validation is not None:
        paths["val"] = store.get_val_data_path(idx)
    level = verbosity_level(verbose)
    if _complete(store, paths, key):
        logger.log(level, f"reusing prepared dataset {idx} at {paths['train']}")
        _prepared_stores[idx] = store
        return idx

    from pyspark.sql import functions as F

    cols = [F.col(_q(c)) for c in selected]
    if validation is not None:
        cols.append(validation_flag(validation).alias(_SPLIT_COL))
    sel = df.select(*cols)
    checked = set(labels) | set(weight) | (set() if allow_non_finite_features else set(features))
    stats, infos = _cancellable(
        sel.sparkSession,
        lambda: _inspect(
            sel, kinds, checked, validation is not None, set(features), compress_sparse
        ),
    )
    _check_split_rows(stats, validation, num_processes)
    if on_checked is not None:
        on_checked()

    for path in paths.values():  # a split left half-written by a crash
        bounded(store, ("deleting", "from"), path, 0, store.delete, path)
    try:
        written = {}
        for split, path in paths.items():
            part = sel
            if validation is not None:
                is_val = F.col(_SPLIT_COL)
                part = sel.filter(is_val if split == "val" else ~is_val).drop(_SPLIT_COL)
            rows = _split_rows(stats, split, validation)
            files = num_processes * partitions_per_process
            tasks = _write_tasks(rows, infos, num_processes, files)
            part = part.repartition(tasks)
            logger.log(level, f"writing the {split} split to {path} ({tasks} tasks)")
            _write_split(part, store, path, infos, rows_per_file=max(1, -(-rows // files)))
            meta = bounded(
                store,
                ("reading", "from"),
                path,
                0,
                scan_parquet,
                as_arrow_filesystem(store.arrow_filesystem),
                store.fs_path(path),
                tuple(infos),
            )
            if meta.rows < num_processes:
                raise ValueError(
                    f"the {split} split has {meta.rows} rows, fewer than `num_processes`="
                    f"{num_processes}; every process needs rows. Use more data, fewer "
                    f"processes, or a different `validation`."
                )
            written[split] = DatasetMetadata(
                columns=tuple(infos),
                rows=meta.rows,
                bytes=meta.bytes,
                files=meta.files,
                row_groups=meta.row_groups,
                dataset_idx=idx,
                split=split,
                key=key,
                label_columns=tuple(labels),
                feature_columns=tuple(features),
                sample_weight_col=sample_weight_col,
            )
        for split, path in paths.items():  # the sidecars mark the splits complete
            sidecar = store.join(path, METADATA_FILENAME)
            bounded(
                store,
                ("writing", "to"),
                sidecar,
                0,
                store.write_text,
                sidecar,
                written[split].to_json(),
            )
    except BaseException:
        for path in paths.values():
            with contextlib.suppress(Exception):
                store.delete(path)
        raise
    for split, meta in written.items():
        logger.log(level, f"{split}: {meta.rows} rows, {meta.files} files, {meta.bytes} bytes")
    _prepared_stores[idx] = store
    return idx


def dataframe_metadata(
    df: DataFrame, columns: Sequence[str] | None = None, compress_sparse: bool = False
) -> DatasetMetadata:
    """What ``prepare_data`` records of ``df``'s columns (all of them by default), without
    writing anything: each column's kind, numpy dtype and per-row shape, and the row count,
    from one Spark aggregation. The estimators' models take it as their ``metadata``, and
    ``check_shape_compatibility`` checks model shapes against it.

    Raises:
        ValueError: a missing column, or one a model cannot take: an unsupported type, nulls,
            NaN or infinity, arrays or vectors of different lengths in different rows.
    """
    from pyspark.sql import functions as F

    names = list(df.columns) if columns is None else _names("columns", columns)
    _check_exist("columns", names, list(df.columns))
    types = {f.name: f.dataType for f in df.schema.fields}
    kinds = {c: _spark_kind(c, types[c]) for c in names}
    sel = df.select(*[F.col(_q(c)) for c in names])
    stats, infos = _inspect(sel, kinds, set(names), False, set(), compress_sparse)
    return DatasetMetadata(columns=tuple(infos), rows=stats["rows"], bytes=0, files=0, row_groups=0)


def _inspect(
    sel: DataFrame,
    kinds: dict[str, tuple[str, str]],
    nan_checked: set[str],
    has_split: bool,
    features: set[str],
    compress_sparse: bool,
) -> tuple[Stats, list[ColumnInfo]]:
    """The statistics of ``sel``'s columns (``_collect_stats``) and the column records they
    give."""
    stats = _collect_stats(sel, kinds, nan_checked, has_split, features)
    return stats, _column_infos(list(kinds), kinds, stats, compress_sparse)


# The store each dataset this process prepared went to, by index: Horovod's helpers for
# direct-Parquet training (``get_dataset_properties(idx)``) take only the index.
_prepared_stores: dict[str, Store] = {}


def prepared_store(dataset_idx: str) -> Store:
    """The store ``prepare_data`` wrote ``dataset_idx`` to in this process."""
    try:
        return _prepared_stores[dataset_idx]
    except KeyError:
        known = sorted(_prepared_stores) or "none"
        raise ValueError(
            f"dataset {dataset_idx!r} was not prepared by this process (prepared: {known}); "
            f"pass its `store`, or prepare it first with prepare_data."
        ) from None


def forget_prepared() -> None:
    """Forget which datasets this process prepared; their data stays in the store."""
    _prepared_stores.clear()


def validation_flag(validation: float | str) -> Column:
    """True for the rows of the validation split: a seeded random fraction for a float, the
    true or non-zero rows of the named column (null: training) for a string."""
    from pyspark.sql import functions as F

    _check_validation(validation)
    if isinstance(validation, str):
        return F.coalesce(F.col(_q(validation)).cast("boolean"), F.lit(False))
    return F.rand(SPLIT_SEED) < float(validation)


def train_val_split(
    df: DataFrame, validation: float | str | None
) -> tuple[DataFrame, DataFrame | None, float]:
    """``(train_df, val_df, validation_ratio)``: ``df`` split the way ``prepare_data`` splits
    it (a validation column is dropped from both); ``val_df`` is None without ``validation``.
    The ratio is ``validation`` itself for a fraction, the share of validation rows (one
    count) for a column."""
    from pyspark.sql import functions as F

    if validation is None:
        return df, None, 0.0
    if isinstance(validation, str) and validation not in df.columns:
        raise ValueError(
            f"`validation` column `{validation}` is not in the DataFrame; it has {df.columns}."
        )
    flagged = df.withColumn(_SPLIT_COL, validation_flag(validation))
    if isinstance(validation, str):
        flagged = flagged.drop(validation)
    is_val = F.col(_SPLIT_COL)
    train = flagged.filter(~is_val).drop(_SPLIT_COL)
    val = flagged.filter(is_val).drop(_SPLIT_COL)
    if not isinstance(validation, str):
        return train, val, float(validation)
    counts = flagged.agg(F.count(F.lit(1)), F.sum(is_val.cast("int"))).collect()[0]
    return train, val, (counts[1] or 0) / counts[0] if counts[0] else 0.0


def _check_count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be an int >= 1; found {value!r}.")


def _names(arg: str, value: str | Iterable[str]) -> list[str]:
    if isinstance(value, str):
        return [value]
    try:
        names = list(value)
    except TypeError:
        names = None
    if names is None or not all(isinstance(n, str) for n in names):
        raise ValueError(f"`{arg}` must be a column name or a list of them; found {value!r}.")
    return names


def _check_exist(arg: str, names: list[str], available: list[str]) -> None:
    missing = [n for n in names if n not in available]
    if missing:
        raise ValueError(
            f"`{arg}` names {', '.join(f'`{m}`' for m in missing)}, which the DataFrame does "
            f"not have; available columns: {', '.join(f'`{a}`' for a in available)}. Fix the "
            f"name or add the column."
        )


def check_spark_dataframe(df: object, what: str) -> None:
    """``df`` is a Spark DataFrame (classic or Connect), or a ValueError saying what it is
    and how to make one from it."""
    if hasattr(df, "schema") and hasattr(df, "mapInArrow"):
        return
    kind = type(df)
    module = kind.__module__.split(".")[0]
    if kind.__module__.startswith("pyspark.pandas"):
        found, fix = "a pandas-on-Spark DataFrame", "convert it with `psdf.to_spark()`"
    elif module == "pandas":
        found, fix = "a pandas DataFrame", "convert it with `spark.createDataFrame(pdf)`"
    elif module in ("polars", "pyarrow"):
        found = f"a {module} {kind.__name__}"
        fix = "convert it with `spark.createDataFrame(table.to_pandas())`"
    else:
        found = f"{kind.__module__}.{kind.__name__}"
        fix = "read or create one with the SparkSession (`spark.read...`, `spark.createDataFrame`)"
    raise ValueError(f"{what} must be a Spark DataFrame; found {found}: {fix}.")


def _check_validation(validation: object) -> None:
    if validation is None or isinstance(validation, str):
        return
    if isinstance(validation, bool) or not isinstance(validation, float | int):
        raise ValueError(
            f"`validation` must be a float in (0, 1), a column name or None; found {validation!r}."
        )
    if not 0 < validation < 1:
        raise ValueError(
            f"`validation` must be a fraction strictly between 0 and 1 (e.g. "
            f"0.2); found {validation!r}."
        )


def _spark_kind(name: str, dtype: DataType) -> tuple[str, str]:
    """(kind, numpy dtype) of a Spark column type, or a ValueError naming it."""
    from pyspark.sql import types as T

    scalars: dict[type, str] = {
        T.BooleanType: "bool",
        T.ByteType: "int8",
        T.ShortType: "int16",
        T.IntegerType: "int32",
        T.LongType: "int64",
        T.FloatType: "float32",
        T.DoubleType: "float64",
    }
    kind = type(dtype)
    if kind in scalars:
        return "scalar", scalars[kind]
    if isinstance(dtype, T.ArrayType) and type(dtype.elementType) in scalars:
        return "array", scalars[type(dtype.elementType)]
    if isinstance(dtype, T.UserDefinedType) and type(dtype).__name__ == "VectorUDT":
        return "vector", "float64"
    if isinstance(dtype, T.DecimalType):
        raise ValueError(
            f"column `{name}` has type {dtype.simpleString()}, which cannot be fed to a model "
            f"as it is: cast it to double first, e.g. "
            f"df.withColumn({name!r}, df[{name!r}].cast('double'))."
        )
    raise ValueError(
        f"column `{name}` has type {dtype.simpleString()}, which cannot be fed to a model; "
        f"supported: boolean and numeric scalars, arrays of them, and pyspark.ml.linalg "
        f"vectors. Convert it first (e.g. StringIndexer, VectorAssembler, a cast) or leave it "
        f"out of the columns."
    )


def _q(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def _dataset_key(df: DataFrame, options: JSONObject) -> str:
    try:
        files = sorted(df.inputFiles())
    except Exception:
        files = []
    blob = json.dumps(
        {
            "format": FORMAT,
            "plan": df.semanticHash(),
            "schema": df.schema.json(),
            "input_files": files,
            **options,
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def _complete(store: Store, paths: dict[str, str], key: str) -> bool:
    for path in paths.values():
        sidecar = store.join(path, METADATA_FILENAME)
        try:
            text = bounded(store, ("reading", "from"), sidecar, 0, store.read_text, sidecar)
            if DatasetMetadata.from_json(text).key != key:
                return False
        except (FileNotFoundError, ValueError, KeyError):
            return False
    return True


# -- statistics: one aggregation over the selected columns, in Spark ------------------------


def _non_finite(x: Column) -> Column:
    """Whether a number is NaN or infinite, as a Spark expression."""
    from pyspark.sql import functions as F

    return F.isnan(x) | (F.abs(x) == float("inf"))


def _column_stats(c: str, kind: str, dtype: str, check_nan: bool) -> dict[str, Column]:
    """Spark aggregate expressions of one column's statistics (see ``_collect_stats``)."""
    from pyspark.sql import functions as F

    col = F.col(_q(c))

    def count(condition: Column) -> Column:
        return F.sum(F.when(condition, 1).otherwise(0))

    exprs: dict[str, Column] = {"nulls": count(col.isNull())}
    values = col
    if kind == "vector":
        from pyspark.ml.functions import array_to_vector, vector_to_array

        values = vector_to_array(col, "float64")
        # SQL cannot read a vector's type field. A dense vector equals the dense vector made
        # from its own values (NaN equals NaN in Spark's comparisons); a sparse one does not.
        # Half the cost of testing its text form, which formats every value (measured).
        sparse = col != array_to_vector(values)
        exprs["sparse"] = count(col.isNotNull() & sparse)
        exprs["dense"] = count(col.isNotNull() & ~sparse)
    if kind != "scalar":
        length = F.when(col.isNotNull(), F.size(values))
        exprs["min_len"], exprs["max_len"] = F.min(length), F.max(length)
    if check_nan and dtype.startswith("float"):
        if kind == "scalar":
            exprs["nans"] = count(_non_finite(col))
        else:
            # Rows holding a NaN or an infinity, by the row's greatest and least value (NaN
            # sorts above every number): compiled code, where a per-value lambda is
            # interpreted (measured: 0.4 s of a cold 200 k-row pass). The values themselves
            # are counted only when there are some (`_count_non_finite`).
            top, bottom = F.array_max(values), F.array_min(values)
            exprs["nan_rows"] = count(
                F.isnan(top) | (top == float("inf")) | (bottom == float("-inf"))
            )
    return exprs


def _count_non_finite(sel: DataFrame, c: str, kind: str) -> int:
    """The NaN or infinite values of an array or vector column, for the error message."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F

    col = F.col(_q(c))
    values = vector_to_array(col, "float64") if kind == "vector" else col
    bad = F.aggregate(values, F.lit(0), lambda n, x: n + F.when(_non_finite(x), 1).otherwise(0))
    return int(sel.agg(F.sum(bad)).collect()[0][0] or 0)


def _collect_stats(
    sel: DataFrame,
    kinds: dict[str, tuple[str, str]],
    nan_checked: set[str],
    has_split: bool,
    features: set[str] = frozenset(),  # type: ignore[assignment]
) -> Stats:
    """Rows, validation rows and, per column, nulls, NaN or infinite values, the least and
    greatest array or vector length and the sparse and dense vector counts, in one Spark
    aggregation (in the JVM: no rows cross to Python; a second one counts the NaN values of a
    column that has some, for the message); a ValueError for data a model cannot take."""
    from pyspark.sql import functions as F

    named = [F.count(F.lit(1)).alias("rows")]
    if has_split:
        named.append(F.sum(F.col(_SPLIT_COL).cast("int")).alias("val_rows"))
    per_column: dict[str, dict[str, str]] = {}
    for i, (c, (kind, dtype)) in enumerate(kinds.items()):
        exprs = _column_stats(c, kind, dtype, c in nan_checked)
        per_column[c] = {stat: f"s{i}_{stat}" for stat in exprs}
        named.extend(expr.alias(per_column[c][stat]) for stat, expr in exprs.items())
    row = sel.agg(*named).collect()[0].asDict()
    total: Stats = {"rows": row["rows"], "val_rows": row.get("val_rows") or 0, "cols": {}}
    for c, aliases in per_column.items():
        st = {"nulls": 0, "nans": 0, "min_len": None, "max_len": None, "sparse": 0, "dense": 0}
        st.update({stat: row[alias] for stat, alias in aliases.items()})
        for stat in ("nulls", "nans", "sparse", "dense"):
            st[stat] = int(st[stat] or 0)  # a sum over no rows is null
        total["cols"][c] = st
    if total["rows"] == 0:
        raise ValueError(
            "the DataFrame has no rows; there is nothing to train on. Check the "
            "filters that produced it."
        )
    for c, st in total["cols"].items():
        if st["nulls"]:
            raise ValueError(
                f"column `{c}` has {st['nulls']} null values; the model needs a "
                f"value in every row. Drop or fill them first (df.na.drop / "
                f"df.na.fill)."
            )
        if st.pop("nan_rows", None):
            st["nans"] = _count_non_finite(sel, c, kinds[c][0])
        if st["nans"]:
            allow = (
                "; or pass `allow_non_finite_features=True` to prepare_data if the model "
                "handles them"
                if c in features
                else ""
            )
            raise ValueError(
                f"column `{c}` has {st['nans']} NaN or infinite values; they make the loss "
                f"NaN. Drop or fix those rows first (e.g. df.na.drop(subset=['{c}']) for NaN)"
                f"{allow}."
            )
        if st["min_len"] is not None and st["min_len"] != st["max_len"]:
            raise ValueError(
                f"column `{c}` has rows of different lengths ({st['min_len']} to "
                f"{st['max_len']}); every row must have the same length. Pad or "
                f"truncate it first."
            )
        if st["min_len"] == 0:
            raise ValueError(
                f"column `{c}` holds empty arrays or vectors; a model input needs "
                f"at least one value per row."
            )
    return total


def _column_infos(
    selected: list[str],
    kinds: dict[str, tuple[str, str]],
    stats: Stats,
    compress_sparse: bool,
) -> list[ColumnInfo]:
    infos = []
    for c in selected:
        kind, dtype = kinds[c]
        st = stats["cols"][c]
        shape: tuple[int, ...] = () if kind == "scalar" else (st["max_len"],)
        encoding = "plain" if kind == "scalar" else "list"
        if kind == "vector":
            if st["dense"] == 0:
                kind = "sparse_vector"
                encoding = "sparse" if compress_sparse else "list"
            elif st["sparse"] == 0:
                kind = "dense_vector"
        infos.append(ColumnInfo(c, kind, dtype, shape, encoding))
    return infos


def _check_split_rows(stats: Stats, validation: float | str | None, num_processes: int) -> None:
    if validation is None:
        return
    val_rows, rows = stats["val_rows"], stats["rows"]
    for split, n in (("validation", val_rows), ("training", rows - val_rows)):
        if n < num_processes:
            raise ValueError(
                f"`validation`={validation!r} puts {n} of {rows} rows into the {split} split, "
                f"fewer than `num_processes`={num_processes}; every process needs rows. "
                f"Change `validation` or use more data."
            )


# -- writing ---------------------------------------------------------------------------------


def _split_rows(stats: Stats, split: str, validation: float | str | None) -> int:
    if validation is None:
        return int(stats["rows"])
    val_rows = int(stats["val_rows"])
    return val_rows if split == "val" else int(stats["rows"]) - val_rows


def _write_tasks(rows: int, infos: list[ColumnInfo], num_processes: int, files: int) -> int:
    """Spark tasks for writing ``rows``: one per ``WRITE_TASK_BYTES`` of decoded data, at
    least one per rank and at most one per file."""
    import math

    import numpy as np

    row_bytes = sum(math.prod(i.shape) * np.dtype(i.dtype).itemsize for i in infos)
    return max(num_processes, min(files, -(-rows * row_bytes // WRITE_TASK_BYTES)))


def _write_split(
    part: DataFrame, store: Store, path: str, infos: list[ColumnInfo], rows_per_file: int
) -> None:
    """Spark writes straight to the store's URL when its cluster can reach it; otherwise each
    task writes its partition to local files and uploads them through the store's fsspec.
    Either way a file holds at most ``rows_per_file`` rows."""
    spark = part.sparkSession
    url = store.spark_url(path)
    if _spark_can_write(spark, url):
        from pyspark.sql import functions as F

        if any(i.encoding == "sparse" for i in infos):
            part = part.mapInArrow(_EncodeTask(infos), _spark_storage_ddl(infos))
            cols = [F.col(_q(i.name)) for i in infos]
        else:
            from pyspark.ml.functions import vector_to_array

            cols = [
                vector_to_array(F.col(_q(i.name)), "float64")
                if i.kind in VECTOR_KINDS
                else F.col(_q(i.name))
                for i in infos
            ]
        part = part.select(
            *[
                col.alias(i.name, metadata={FIELD_METADATA_KEY: i.to_dict()})
                for col, i in zip(cols, infos, strict=True)
            ]
        )
        writer = part.write.mode("overwrite").option("compression", "snappy")
        for leaf, floating in _leaf_paths(infos).items():
            if floating:
                writer = writer.option(f"parquet.enable.dictionary#{leaf}", "false")
        writer = writer.option("maxRecordsPerFile", rows_per_file)
        _cancellable(spark, lambda: writer.parquet(url))
        return
    task = _StagedWriteTask(store, path, infos, local_storage_env(_master(spark)), rows_per_file)
    written = _cancellable(spark, part.mapInArrow(task, "file string, rows long").collect)
    expected = {r["file"] for r in written}
    found = bounded(store, ("listing", "in"), path, 0, store.fs.find, store.fs_path(path))
    for stray in set(found) - expected:  # from retried tasks
        if stray.endswith(".parquet"):
            bounded(store, ("deleting", "from"), stray, 0, store.fs.rm, stray)


def _cancellable(spark: AnySparkSession, action: Callable[[], T]) -> T:
    """``action()``, Spark jobs (the checks, a write), in a thread of its own whose jobs carry
    a tag of their own. When the waiting thread is interrupted (Ctrl-C), the jobs with that
    tag are cancelled, those the action starts meanwhile too, until the action has ended (up
    to ``CANCEL_WAIT_S``); then the interrupt goes on. An interrupted call would otherwise go
    on in the JVM (a job it had not started yet is not cancelled, and Spark's cleanup of a
    cancelled write comes after): the next prepare would write beside it, and the two remove
    each other's ``_temporary`` folder."""
    tag = f"flyte-hvd-prepare-{uuid.uuid4().hex[:12]}"
    outcome: dict[str, Any] = {}
    done = threading.Event()

    def call() -> None:
        spark.addTag(tag)
        try:
            outcome["value"] = action()
        except BaseException as error:
            outcome["error"] = error
        finally:
            spark.removeTag(tag)
            done.set()

    threading.Thread(target=call, name="flyte-hvd-prepare", daemon=True).start()
    try:
        done.wait()
    except BaseException:
        deadline = time.monotonic() + CANCEL_WAIT_S
        while not done.is_set() and time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                spark.interruptTag(tag)
            done.wait(0.2)
        if not done.is_set():
            logger.warning(
                "the interrupted Spark jobs of prepare_data did not end within %gs; they (tag "
                "%s) may still be running",
                CANCEL_WAIT_S,
                tag,
            )
        raise
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]  # type: ignore[no-any-return]  # the action's own result


def _leaf_paths(infos: list[ColumnInfo]) -> dict[str, bool]:
    """Each stored Parquet leaf column's path, and whether it holds floating-point values.

    Those are written without dictionary encoding: measured values rarely repeat, so the
    writers build each column chunk's dictionary only to give it up (a third of a 200 k-row
    write's time). Integer and boolean columns (class labels, ids) keep it."""
    import numpy as np

    leaves = {}
    for i in infos:
        floating = np.dtype(i.dtype).kind in "fc"
        if i.encoding == "sparse":
            leaves[f"{i.name}.indices.list.element"] = False
            leaves[f"{i.name}.values.list.element"] = floating
        else:
            leaves[i.name if i.encoding == "plain" else f"{i.name}.list.element"] = floating
    return leaves


def _master(spark: AnySparkSession) -> str:
    """The master URL of a classic or a Spark Connect session (``spark.conf`` works on both;
    ``sparkContext`` does not exist on Connect)."""
    return str(spark.conf.get("spark.master", "") or "")


def _spark_can_write(spark: AnySparkSession, url: str) -> bool:
    """Whether the cluster has a Hadoop FileSystem for ``url``: its scheme names a class,
    and that class answers for ``url`` (a scheme can be mapped to a class whose own client
    is missing, e.g. S3A without its AWS SDK, or a view with no mount for this bucket)."""
    scheme = url.split(":", 1)[0] if ":" in url else "file"
    try:
        jvm: Any = spark._jvm  # py4j's JVM view: untyped (pyspark declares it Optional)
        conf = spark._jsc.hadoopConfiguration()
        jvm.org.apache.hadoop.fs.FileSystem.getFileSystemClass(scheme, conf)
        path = jvm.org.apache.hadoop.fs.Path(url)
        path.getFileSystem(conf).exists(path)
        return True
    except AttributeError:  # Spark Connect: no JVM to ask
        return scheme in ("file", "hdfs", "dbfs")
    except Exception:
        return False


def _spark_storage_ddl(infos: list[ColumnInfo]) -> str:
    spark_types = {
        "bool": "boolean",
        "int8": "tinyint",
        "int16": "smallint",
        "int32": "int",
        "int64": "bigint",
        "float32": "float",
        "float64": "double",
    }
    parts = []
    for i in infos:
        t = spark_types[i.dtype]
        if i.encoding == "list":
            t = f"array<{t}>"
        elif i.encoding == "sparse":
            t = f"struct<indices: array<int>, values: array<{t}>>"
        parts.append(f"{_q(i.name)} {t}")
    return ", ".join(parts)


class _EncodeTask:
    def __init__(self, infos: list[ColumnInfo]):
        self.infos = infos

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            yield encode_batch(batch, self.infos)


class _StagedWriteTask:
    """Writes one Spark partition to local Parquet files of at most ``rows_per_file`` rows and
    uploads each (one atomic PUT) as ``part-<partition>-<n>.parquet``: a retried task
    overwrites its own files (the repartition gives it the same rows again)."""

    def __init__(
        self,
        store: Store,
        path: str,
        infos: list[ColumnInfo],
        env: dict[str, str],
        rows_per_file: int,
    ):
        self.store = store
        self.path = path
        self.infos = infos
        self.env = env  # the driver's storage settings, for a local master's workers
        self.rows_per_file = rows_per_file

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        assert ctx is not None  # always set inside a Spark task
        pid = ctx.partitionId()
        files: list[str] = []
        counts: list[int] = []
        pending: list[pa.RecordBatch] = []
        rows = 0
        with tempfile.TemporaryDirectory(prefix="flyte-hvd-stage-") as tmp:
            for batch in batches:
                while batch.num_rows:
                    take = min(batch.num_rows, self.rows_per_file - rows)
                    pending.append(batch.slice(0, take))
                    batch, rows = batch.slice(take), rows + take
                    if rows == self.rows_per_file:
                        files.append(self._upload(tmp, pid, len(files), pending))
                        counts.append(rows)
                        pending, rows = [], 0
            if rows:
                files.append(self._upload(tmp, pid, len(files), pending))
                counts.append(rows)
        if files:
            yield pa.RecordBatch.from_pydict({"file": files, "rows": counts})

    def _upload(self, tmp: str, pid: int, n: int, batches: list[pa.RecordBatch]) -> str:
        import pyarrow.parquet as pq

        local = os.path.join(tmp, "part.parquet")
        dictionary = [leaf for leaf, floating in _leaf_paths(self.infos).items() if not floating]
        with pq.ParquetWriter(
            local, arrow_storage_schema(self.infos), compression="snappy", use_dictionary=dictionary
        ) as w:
            for batch in batches:
                w.write_batch(encode_batch(batch, self.infos))
        remote = self.store.join(self.path, f"part-{pid:05d}-{n:04d}.parquet")
        os.environ.update(self.env)
        size = os.path.getsize(local)  # within the store's timeout, as the ranks' uploads
        bounded(
            self.store, ("uploading", "to"), remote, size, self.store.upload_file, local, remote
        )
        return self.store.fs_path(remote)
