"""The Store: where prepared data, checkpoints, training state and logs live.

One class per kind of storage, all on fsspec, with Horovod's method names. Layout::

    <prefix>/intermediate_train_data.<idx>/   Parquet written by prepare_data
    <prefix>/intermediate_val_data.<idx>/
    <prefix>/intermediate_train_data.<idx>.lease.json   a write in progress
    <prefix>/runs/<run_id>/checkpoint.<ext>   best or last model (atomic replace; .keras, .pt...)
    <prefix>/runs/<run_id>/state.json         epoch reached, metrics history
    <prefix>/runs/<run_id>/logs/              TensorBoard event files

Every write that replaces a file is atomic, so a process that dies mid-write never destroys the
last good checkpoint: file systems write a temporary file beside the target and rename it;
object stores publish an object only when its single PUT (or multipart upload) completes.

Horovod's Store API (``horovod.spark.common.store``, 0.28) is here under its names, so code
written for Horovod runs with only the import changed: ``Store.create``,
``AbstractFilesystemStore``, ``FilesystemStore`` (any fsspec URL: ``gs://``, ``abfs://``,
``sftp://``...), ``LocalStore``, ``HDFSStore``, ``DBFSLocalStore`` and their methods
(``get_checkpoint_filename``, ``get_local_output_dir_fn``, ``sync_fn``, ``get_full_path``,
``get_localized_path``, ``copy``, ``matches``...). Where a meaning differs, the method says so.

Import every name from here (``from flyte_hvd.data.store import Store``); the modules are:

- ``base``: ``Store`` (its arguments, ``Store.create``, the write check, ``to_remote``), the
  backends ``create`` chooses from (``store_class_for``) and ``AbstractFilesystemStore``.
  ``Store`` is built on ``layout.StoreLayout`` (the paths, in the user's, fsspec's and Spark's
  forms), ``files.StoreFiles`` (the filesystem, reads and atomic writes, ``sync_fn``) and
  ``compat.HorovodStoreMethods`` (Horovod's methods that nothing here calls: ``copy``,
  ``get_checkpoints``, ``read_serialized_keras_model``...).
- backends, one module per family: ``local`` (``LocalStore``, ``DBFSLocalStore``),
  ``objects`` (``S3Store``, ``FilesystemStore`` for any fsspec protocol, the clouds' help
  texts), ``hdfs`` (``HDFSStore``).
- ``remote``: ``RemoteStore``, what the ranks get of a Store.
- shared by those: ``paths`` (the layout's names, path checks), ``errors`` (the errors and how
  failures are worded), ``bounded`` (every operation within the Store's ``timeout``:
  ``bounded``, ``TIMEOUT_ENV``), ``filesystems`` (fsspec's class for a URL: ``url_to_fs``).

Nothing here imports pyspark or a framework: ranks use it through ``to_remote``.
"""

from __future__ import annotations

# Names beyond __all__ that were always importable from here (`X as X`: re-exported).
from flyte_hvd.data.store.base import (
    AbstractFilesystemStore,
    Store,
    register_backends,
    store_class_for,
)
from flyte_hvd.data.store.bounded import DEFAULT_TIMEOUT_S as DEFAULT_TIMEOUT_S
from flyte_hvd.data.store.bounded import SECONDS_PER_MIB as SECONDS_PER_MIB
from flyte_hvd.data.store.bounded import TIMEOUT_ENV as TIMEOUT_ENV
from flyte_hvd.data.store.bounded import bounded as bounded
from flyte_hvd.data.store.bounded import store_timeout as store_timeout
from flyte_hvd.data.store.errors import StoreTimeoutError, StoreUnreachableError
from flyte_hvd.data.store.filesystems import url_to_fs as url_to_fs
from flyte_hvd.data.store.hdfs import HDFSStore
from flyte_hvd.data.store.local import DBFSLocalStore, LocalStore
from flyte_hvd.data.store.objects import FilesystemStore, S3Store
from flyte_hvd.data.store.paths import CHECKPOINT_STEM as CHECKPOINT_STEM
from flyte_hvd.data.store.paths import LOGS_DIRNAME as LOGS_DIRNAME
from flyte_hvd.data.store.paths import RUNS_DIRNAME as RUNS_DIRNAME
from flyte_hvd.data.store.paths import STATE_FILENAME as STATE_FILENAME
from flyte_hvd.data.store.paths import TEST_DATA_NAME as TEST_DATA_NAME
from flyte_hvd.data.store.paths import TRAIN_DATA_NAME as TRAIN_DATA_NAME
from flyte_hvd.data.store.paths import VAL_DATA_NAME as VAL_DATA_NAME
from flyte_hvd.data.store.remote import RemoteStore

__all__ = [
    "AbstractFilesystemStore",
    "DBFSLocalStore",
    "FilesystemStore",
    "HDFSStore",
    "LocalStore",
    "RemoteStore",
    "S3Store",
    "Store",
    "StoreTimeoutError",
    "StoreUnreachableError",
    "store_class_for",
]

# The order `Store.create` tries them in: DBFS paths are local paths too, and FilesystemStore
# takes any protocol fsspec knows.
register_backends(DBFSLocalStore, LocalStore, S3Store, HDFSStore, FilesystemStore)
