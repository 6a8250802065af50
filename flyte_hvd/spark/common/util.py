"""Horovod's ``horovod.spark.common.util``: ``prepare_data`` and the helpers that workflows
training on Parquet they wrote themselves call."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from flyte_hvd.core.checks import to_list
from flyte_hvd.core.state import host_hash
from flyte_hvd.data.dataset import check_shape_compatibility
from flyte_hvd.data.prepare import (
    dataframe_metadata,
    forget_prepared,
    prepare_data,
    prepared_store,
)
from flyte_hvd.data.split import train_val_split
from flyte_hvd.data.store import Store

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, Row
    from pyspark.sql.types import StructType

__all__ = [
    "check_shape_compatibility",
    "clear_training_cache",
    "get_dataset_properties",
    "get_simple_meta_from_parquet",
    "get_spark_df_output_schema",
    "host_hash",
    "prepare_data",
    "to_list",
    "to_petastorm_fn",
]

# Horovod's names for what ``prepare_data`` uses: the split it makes, ``(train_df, val_df,
# ratio)``, and the metadata it records of a DataFrame's columns (which a model takes as its
# ``metadata``, and ``check_shape_compatibility`` reads).
_train_val_split = train_val_split
_get_metadata = dataframe_metadata


def to_petastorm_fn(schema_cols: Sequence[str], metadata: object = None) -> Callable[[Row], Row]:
    """A function for ``df.rdd.map`` that turns the Spark ML vectors in ``schema_cols`` of a
    row into lists of floats, as Horovod's does for training on Parquet written outside
    ``prepare_data`` (``fit_on_parquet``): Parquet has no vector type. ``metadata`` (Horovod's
    per-column dicts, or None) may only ask for that format: Horovod's packed sparse one is
    not read here, where ``prepare_data(compress_sparse=True)`` stores sparse vectors."""
    from flyte_hvd.spark.common.constants import ARRAY, NOCHANGE

    columns = [schema_cols] if isinstance(schema_cols, str) else [str(c) for c in schema_cols]
    if isinstance(metadata, dict):
        packed = sorted(
            c
            for c in columns
            if isinstance(metadata.get(c), dict)
            and metadata[c].get("intermediate_format", ARRAY) not in (ARRAY, NOCHANGE)
        )
        if packed:
            raise ValueError(
                f"`to_petastorm_fn`: column(s) {packed} ask for the intermediate format "
                f"{[metadata[c]['intermediate_format'] for c in packed]}; flyte_hvd reads "
                f"vectors written as arrays ('{ARRAY}') only. Leave `metadata` out, or let "
                f"`prepare_data(..., compress_sparse=True)` store sparse vectors."
            )

    def to_arrays(row: Row) -> Row:
        from pyspark.ml.linalg import Vector
        from pyspark.sql import Row

        converted = {c: row[c].toArray().tolist() for c in columns if isinstance(row[c], Vector)}
        if not converted:
            return row
        values = row.asDict()
        values.update(converted)
        return Row(**values)

    return to_arrays


def _has_vector_column(df: DataFrame) -> bool:
    """Whether any column of ``df`` holds Spark ML vectors (``to_petastorm_fn`` then has
    something to convert), as Horovod's helper of that name."""
    from pyspark.ml.linalg import VectorUDT

    return any(isinstance(field.dataType, VectorUDT) for field in df.schema.fields)


def get_spark_df_output_schema(
    schema: StructType,
    label_columns: Sequence[str],
    output_columns: Sequence[str],
    metadata: object = None,
) -> StructType:
    """``schema`` with the prediction columns a model's ``transform`` appends, one per label,
    each typed as its label (see ``flyte_hvd.estimators.prediction.output_schema``)."""
    from flyte_hvd.estimators.prediction import output_schema

    return output_schema(schema, label_columns, output_columns, metadata)


def get_simple_meta_from_parquet(
    store: Store,
    label_columns: list[str],
    feature_columns: list[str],
    sample_weight_col: str | None = None,
    dataset_idx: str | int | None = None,
) -> tuple[int, int, dict, float]:
    """``(train_rows, val_rows, metadata, avg_row_size)`` of the Parquet in the store's train
    and validation paths, as Horovod returns them; ``metadata`` maps each column to its
    Spark type name and shape."""
    from flyte_hvd.data.prepare import get_dataset_metadata

    train, val = get_dataset_metadata(store, dataset_idx)
    wanted = [*feature_columns, *label_columns, *([sample_weight_col] if sample_weight_col else [])]
    columns = {info.name: info for info in train.columns}
    missing = [c for c in wanted if c not in columns]
    if missing:
        raise ValueError(
            f"column(s) {missing} are not in the Parquet at "
            f"{store.get_train_data_path(dataset_idx)}; it has {sorted(columns)}."
        )
    metadata = {
        c: {"kind": columns[c].kind, "dtype": columns[c].dtype, "shape": columns[c].shape}
        for c in wanted
    }
    return train.rows, val.rows if val is not None else 0, metadata, train.avg_row_size


def get_dataset_properties(
    dataset_idx: str, store: Store | None = None
) -> tuple[int, int, dict, float]:
    """``(train_rows, val_rows, metadata, avg_row_size)`` of a prepared dataset, for the
    columns it was prepared with; ``store`` defaults to the one ``prepare_data`` wrote
    ``dataset_idx`` to in this process."""
    from flyte_hvd.data.prepare import get_dataset_metadata

    store = store if store is not None else prepared_store(dataset_idx)
    train, _ = get_dataset_metadata(store, dataset_idx)
    return get_simple_meta_from_parquet(
        store,
        list(train.label_columns),
        list(train.feature_columns),
        train.sample_weight_col,
        dataset_idx,
    )


def clear_training_cache() -> None:
    """Forget the datasets this process prepared (``get_dataset_properties`` then needs a
    ``store``). The Parquet stays in the store: preparing the same DataFrame again reuses it."""
    forget_prepared()
