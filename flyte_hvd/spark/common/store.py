"""Horovod's ``horovod.spark.common.store``: the Store classes of ``flyte_hvd.data.store``."""

from flyte_hvd.data.store import (
    AbstractFilesystemStore,
    DBFSLocalStore,
    FilesystemStore,
    HDFSStore,
    LocalStore,
    S3Store,
    Store,
)

__all__ = [
    "AbstractFilesystemStore",
    "DBFSLocalStore",
    "FilesystemStore",
    "HDFSStore",
    "LocalStore",
    "S3Store",
    "Store",
]
