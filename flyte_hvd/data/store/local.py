"""Stores on a local or mounted filesystem: ``LocalStore`` (a local or shared folder, e.g.
NFS) and ``DBFSLocalStore`` (Databricks File System through its FUSE mount). Files are written
beside their target, flushed and renamed over it."""

from __future__ import annotations

import contextlib
import os
import posixpath
import shutil
from typing import Any, ClassVar
from urllib.parse import urlparse

import fsspec

from flyte_hvd.data.parquet import FileSystem
from flyte_hvd.data.store.base import Store
from flyte_hvd.data.store.paths import check_path, temp_name

__all__ = ["DBFSLocalStore", "LocalStore"]


class LocalStore(Store):
    """A local (or shared, e.g. NFS) directory; ``file://`` URLs are accepted.

    On a multi-host Spark cluster the directory must be mounted at the same path on every
    host, since executors write the prepared data and ranks read it.
    """

    schemes: ClassVar[tuple[str, ...]] = ("", "file")

    def normalize(self, path: str) -> str:
        path = str(path)
        if path.startswith("file://"):
            path = urlparse(path).path
        elif path.startswith("file:"):
            path = path[len("file:") :]
        return os.path.abspath(os.path.expanduser(path))

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def spark_url(self, path: str) -> str:
        return "file://" + self.normalize(path)

    def _full_url(self, path: str) -> str:
        return "file://" + self.normalize(path)

    def _make_fs(self) -> fsspec.AbstractFileSystem:
        return fsspec.filesystem("file")

    @property
    def arrow_filesystem(self) -> FileSystem:
        import pyarrow.fs

        return pyarrow.fs.LocalFileSystem()

    def write_bytes(self, path: str, data: bytes) -> None:
        target = self.normalize(path)
        tmp = _durable_temp(target, data)
        try:
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(Exception):
                os.remove(tmp)
            raise

    def create_exclusive(self, path: str, data: bytes) -> bool:
        # A complete temporary file, hard-linked to the target: link() refuses an existing
        # target, so exactly one writer wins, and readers never see a partial file.
        target = self.normalize(path)
        tmp = _durable_temp(target, data)
        try:
            os.link(tmp, target)
        except FileExistsError:
            return False
        finally:
            with contextlib.suppress(Exception):
                os.remove(tmp)
        return True

    def upload_file(self, local_path: str, remote_path: str) -> None:
        target = self.normalize(remote_path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = temp_name(target)
        try:
            shutil.copyfile(local_path, tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(Exception):
                os.remove(tmp)
            raise

    def _makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)


class DBFSLocalStore(LocalStore):
    """Databricks File System through its local FUSE mount (``/dbfs/...``); accepts
    ``dbfs:/...``, ``file:///dbfs/...`` and ``file:/dbfs/...`` and hands Spark ``dbfs:/`` URLs.

    Takes ``Store``'s arguments (Horovod's ``DBFSLocalStore(prefix_path, *args, **kwargs)``).
    Unlike Horovod's, ``get_checkpoint_filename`` is ``checkpoint`` (plus the framework's
    extension) as on every store, not ``checkpoint.tf``: Keras 3 saves one ``.keras`` file.

    Raises:
        ValueError: ``prefix_path`` is not a DBFS path.
    """

    schemes: ClassVar[tuple[str, ...]] = ("dbfs",)

    # ``*args``, ``**kwargs``: ``Store``'s arguments, passed on.
    def __init__(self, prefix_path: str, *args: Any, **kwargs: Any):
        path = check_path("prefix_path", prefix_path)
        if not self.matches_dbfs(path):
            raise ValueError(
                f"`prefix_path`={path!r} is not a DBFS path; `DBFSLocalStore` expects "
                f"`/dbfs/...`, `dbfs:/...`, `file:/dbfs/...` or `file:///dbfs/...`. Use "
                f"`Store.create` to get the store for another kind of path."
            )
        super().__init__(path, *args, **kwargs)

    @classmethod
    def matches(cls, path: str) -> bool:
        """Whether ``path`` is a DBFS path (see ``matches_dbfs``)."""
        return cls.matches_dbfs(check_path("path", path))

    @classmethod
    def matches_dbfs(cls, path: str) -> bool:
        """Whether ``path`` is ``/dbfs``, ``/dbfs/...``, ``dbfs:/...``, ``file:/dbfs/...`` or
        ``file:///dbfs/...`` (Horovod's name)."""
        return path == "/dbfs" or path.startswith(
            ("/dbfs/", "dbfs:", "file:///dbfs/", "file:/dbfs/")
        )

    @staticmethod
    def normalize_path(path: str) -> str:
        """A DBFS path in its FUSE form, ``/dbfs/...`` (Horovod's static method).

        Raises:
            ValueError: ``path`` is not a DBFS path.
        """
        if not DBFSLocalStore.matches_dbfs(check_path("path", path)):
            raise ValueError(
                f"`path`={path!r} is not a DBFS path; expected `/dbfs/...`, `dbfs:/...`, "
                f"`file:/dbfs/...` or `file:///dbfs/...`."
            )
        return _dbfs_fuse_path(path)

    def normalize(self, path: str) -> str:
        return _dbfs_fuse_path(str(path))

    def spark_url(self, path: str) -> str:
        return "dbfs:/" + self.normalize(path)[len("/dbfs/") :]


def _durable_temp(target: str, data: bytes) -> str:
    """``data`` in a temporary file beside ``target`` (its folder made), flushed to disk: it
    can then be renamed or linked to ``target`` whole."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = temp_name(target)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(Exception):
            os.remove(tmp)
        raise
    return tmp


def _dbfs_fuse_path(path: str) -> str:
    if path.startswith("dbfs:"):
        path = "/dbfs/" + path[len("dbfs:") :].lstrip("/")
    elif path.startswith("file://"):
        path = urlparse(path).path
    elif path.startswith("file:"):
        path = path[len("file:") :]
    return posixpath.normpath(path)
