"""Where training data lives and how a DataFrame becomes batches.

``Store`` and its backends (local, S3, HDFS, DBFS) hold everything a run writes;
``prepare_data`` turns a Spark DataFrame into Parquet in the Store with a metadata sidecar
(``dataset``); the loaders read that Parquet on each rank as shuffled, sharded batches.
Nothing here imports an estimator. Modules load on first use (they import pyarrow/fsspec).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flyte_hvd.core.lazy import lazy_attributes

# The real types of the lazy names below, for type checkers (names they re-export).
# ruff: noqa: F401
if TYPE_CHECKING:
    from flyte_hvd.data.dataset import (
        ColumnInfo,
        DatasetMetadata,
        get_dataset_metadata,
        read_metadata,
    )
    from flyte_hvd.data.loader import (
        ArrowDataLoader,
        AsyncArrowDataLoader,
        AsyncDataLoaderMixin,
        BaseDataLoader,
    )
    from flyte_hvd.data.prepare import prepare_data
    from flyte_hvd.data.store import (
        AbstractFilesystemStore,
        DBFSLocalStore,
        FilesystemStore,
        HDFSStore,
        LocalStore,
        RemoteStore,
        S3Store,
        Store,
        StoreTimeoutError,
        StoreUnreachableError,
    )

_LAZY = {
    "Store": "flyte_hvd.data.store",
    "LocalStore": "flyte_hvd.data.store",
    "S3Store": "flyte_hvd.data.store",
    "HDFSStore": "flyte_hvd.data.store",
    "DBFSLocalStore": "flyte_hvd.data.store",
    "RemoteStore": "flyte_hvd.data.store",
    "AbstractFilesystemStore": "flyte_hvd.data.store",
    "FilesystemStore": "flyte_hvd.data.store",
    "StoreTimeoutError": "flyte_hvd.data.store",
    "StoreUnreachableError": "flyte_hvd.data.store",
    "prepare_data": "flyte_hvd.data.prepare",
    "read_metadata": "flyte_hvd.data.dataset",
    "get_dataset_metadata": "flyte_hvd.data.dataset",
    "DatasetMetadata": "flyte_hvd.data.dataset",
    "ColumnInfo": "flyte_hvd.data.dataset",
    "BaseDataLoader": "flyte_hvd.data.loader",
    "ArrowDataLoader": "flyte_hvd.data.loader",
    "AsyncDataLoaderMixin": "flyte_hvd.data.loader",
    "AsyncArrowDataLoader": "flyte_hvd.data.loader",
}
__all__ = list(_LAZY)

__getattr__ = lazy_attributes(__name__, _LAZY)
