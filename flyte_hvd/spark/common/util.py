"""Horovod's ``horovod.spark.common.util``: ``prepare_data`` and the helpers that workflows
training on Parquet they wrote themselves call."""

from __future__ import annotations

from flyte_hvd.core.checks import to_list
from flyte_hvd.data.prepare import forget_prepared, prepare_data, prepared_store, train_val_split
from flyte_hvd.data.store import Store

__all__ = [
    "clear_training_cache",
    "get_dataset_properties",
    "get_simple_meta_from_parquet",
    "prepare_data",
    "to_list",
]

# Horovod's name for the split ``prepare_data`` makes: ``(train_df, val_df, ratio)``.
_train_val_split = train_val_split


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
