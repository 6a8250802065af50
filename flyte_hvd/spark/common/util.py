"""Horovod's ``horovod.spark.common.util``: ``prepare_data`` and the helpers that workflows
training on Parquet they wrote themselves call."""

from __future__ import annotations

from collections.abc import Sequence
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
]

# Horovod's names for what ``prepare_data`` uses: the split it makes, ``(train_df, val_df,
# ratio)``, and the metadata it records of a DataFrame's columns (which a model takes as its
# ``metadata``, and ``check_shape_compatibility`` reads).
_train_val_split = train_val_split
_get_metadata = dataframe_metadata


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
