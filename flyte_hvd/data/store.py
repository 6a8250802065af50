"""The Store: where prepared data, checkpoints, training state and logs live.

One class per kind of storage, all on fsspec, with Horovod's method names. Layout::

    <prefix>/intermediate_train_data.<idx>/   Parquet written by prepare_data
    <prefix>/intermediate_val_data.<idx>/
    <prefix>/runs/<run_id>/checkpoint.<ext>   best or last model (atomic replace; .keras, .pt...)
    <prefix>/runs/<run_id>/state.json         epoch reached, metrics history
    <prefix>/runs/<run_id>/logs/              TensorBoard event files

Every write that replaces a file is atomic, so a process that dies mid-write never destroys the
last good checkpoint: file systems write a temporary file beside the target and rename it;
object stores publish an object only when its single PUT (or multipart upload) completes.

This module imports neither pyspark nor TensorFlow: ranks use it through ``to_remote``.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar
from urllib.parse import urlparse

import fsspec

from flyte_hvd.data.parquet import open_parquet_dataset

CHECKPOINT_STEM = "checkpoint"  # + the framework's extension, unless a file name is chosen
STATE_FILENAME = "state.json"
LOGS_DIRNAME = "logs"
TRAIN_DATA_NAME = "intermediate_train_data"
VAL_DATA_NAME = "intermediate_val_data"
TEST_DATA_NAME = "intermediate_test_data"
RUNS_DIRNAME = "runs"
_TMP_SUFFIX = ".tmp"


class Store:
    """Paths and atomic file operations for one prefix; use ``Store.create(prefix_path)``.

    Args:
        prefix_path: root of everything the Store writes (a local path or a URL).
        train_path, val_path, test_path: override where prepared data goes (a dataset's
            index is appended as ``.<idx>``).
        runs_path: override ``<prefix>/runs``.
        save_runs: whether a run's folder (checkpoints, state, logs) is kept after a
            successful fit; False removes it once the trained model is back on the driver.
        storage_options: passed to the fsspec filesystem (for S3: ``key``, ``secret``,
            ``endpoint_url``, ``client_kwargs``...). They travel with ``to_remote`` to the
            ranks; prefer environment variables or instance roles for secrets.
        checkpoint_filename: name of the model file in a run (default: ``checkpoint`` plus
            the framework's extension: ``.keras``, ``.pt``, ``.ckpt``).
    """

    schemes: ClassVar[tuple[str, ...]] = ()
    # True: publish a file by writing a temporary beside it and renaming it over the target.
    # False: the store publishes an object only once its upload completes (object stores).
    publish_by_rename: ClassVar[bool] = True

    def __init__(
        self,
        prefix_path: str,
        train_path: str | None = None,
        val_path: str | None = None,
        test_path: str | None = None,
        runs_path: str | None = None,
        save_runs: bool = True,
        storage_options: dict[str, Any] | None = None,
        checkpoint_filename: str | None = None,
    ):
        self.prefix_path = self.normalize(_check_path("prefix_path", prefix_path))
        self._train_path = self._own_path("train_path", train_path, TRAIN_DATA_NAME)
        self._val_path = self._own_path("val_path", val_path, VAL_DATA_NAME)
        self._test_path = self._own_path("test_path", test_path, TEST_DATA_NAME)
        self._runs_path = self._own_path("runs_path", runs_path, RUNS_DIRNAME)
        if storage_options is not None and not isinstance(storage_options, dict):
            raise ValueError(
                f"`storage_options` must be a dict; found {type(storage_options).__name__}."
            )
        self.storage_options = dict(storage_options or {})
        self._save_runs = bool(save_runs)
        name = checkpoint_filename
        if name is not None and (
            not isinstance(name, str) or "/" in name or name.startswith(".") or name in ("", "..")
        ):
            raise ValueError(
                f"`checkpoint_filename` must be a plain file name such as 'model.keras'; "
                f"found {checkpoint_filename!r}."
            )
        self.checkpoint_filename = name
        self._fs: fsspec.AbstractFileSystem | None = None

    # -- construction ------------------------------------------------------------------------

    @staticmethod
    def create(
        prefix_path: str,
        train_path: str | None = None,
        val_path: str | None = None,
        test_path: str | None = None,
        runs_path: str | None = None,
        save_runs: bool = True,
        storage_options: dict[str, Any] | None = None,
        checkpoint_filename: str | None = None,
    ) -> Store:
        """The Store for ``prefix_path``'s scheme, checked writable now rather than mid-run.

        Raises:
            ValueError: an unsupported scheme or a malformed argument.
            RuntimeError: the prefix cannot be created or written (the message names the
                path and the cause: permission, missing bucket, bad credentials...).
        """
        cls = store_class_for(prefix_path)
        store = cls(
            prefix_path,
            train_path,
            val_path,
            test_path,
            runs_path,
            save_runs,
            storage_options,
            checkpoint_filename,
        )
        store.check_writable()
        return store

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_fs"] = None  # no live connections travel to the ranks
        return state

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.prefix_path!r})"

    # -- paths (Horovod's names) -------------------------------------------------------------

    def get_train_data_path(self, idx: str | int | None = None) -> str:
        return self._train_path if idx is None else f"{self._train_path}.{idx}"

    def get_val_data_path(self, idx: str | int | None = None) -> str:
        return self._val_path if idx is None else f"{self._val_path}.{idx}"

    def get_test_data_path(self, idx: str | int | None = None) -> str:
        return self._test_path if idx is None else f"{self._test_path}.{idx}"

    def get_runs_path(self) -> str:
        return self._runs_path

    def get_run_path(self, run_id: str) -> str:
        return self.join(self._runs_path, _check_run_id(run_id))

    def get_checkpoint_path(self, run_id: str, extension: str = "") -> str:
        """The run's model file: ``checkpoint_filename`` when one was chosen, else
        ``checkpoint<extension>`` (the framework's: ``.keras``, ``.pt``, ``.ckpt``)."""
        if self.checkpoint_filename is not None:
            return self.join(self.get_run_path(run_id), self.checkpoint_filename)
        if not extension.startswith(".") or "/" in extension:
            raise ValueError(
                f"`extension` must be the model format's file extension such as '.keras' or "
                f"'.pt' (this Store has no `checkpoint_filename`); found {extension!r}."
            )
        return self.join(self.get_run_path(run_id), CHECKPOINT_STEM + extension)

    def get_state_path(self, run_id: str) -> str:
        return self.join(self.get_run_path(run_id), STATE_FILENAME)

    def get_logs_path(self, run_id: str) -> str:
        return self.join(self.get_run_path(run_id), LOGS_DIRNAME)

    def get_checkpoints(self, run_id: str, suffix: str | None = None) -> list[str]:
        """Finished checkpoint files of a run (default: those with the chosen checkpoint file's
        suffix, else ``checkpoint.*``), sorted; in-flight temporaries are never listed."""
        if suffix is None and self.checkpoint_filename is not None:
            suffix = posixpath.splitext(self.checkpoint_filename)[1]
        run_path = self.get_run_path(run_id)
        if not self.exists(run_path):
            return []
        names = [posixpath.basename(p.rstrip("/")) for p in self.fs.ls(self.fs_path(run_path))]
        return sorted(
            self.join(run_path, n)
            for n in names
            if (n.endswith(suffix) if suffix is not None else n.startswith(CHECKPOINT_STEM + "."))
            and not n.startswith(".")
            and not n.endswith(_TMP_SUFFIX)
        )

    @property
    def saving_runs(self) -> bool:
        return self._save_runs

    def join(self, *parts: str) -> str:
        return posixpath.join(*parts)

    def _own_path(self, name: str, path: str | None, default_name: str) -> str:
        if path is None:
            return self.join(self.prefix_path, default_name)
        return self.normalize(_check_path(name, path))

    def normalize(self, path: str) -> str:
        """The user-facing form of ``path`` (what ``get_*`` return)."""
        return str(path).rstrip("/") or "/"

    def fs_path(self, path: str) -> str:
        """``path`` as ``self.fs`` (and ``arrow_filesystem``) want it: no scheme."""
        return self.normalize(path)

    def spark_url(self, path: str) -> str:
        """``path`` as a URL a Spark job writes to (when the cluster has the connector)."""
        return path

    # -- filesystems -------------------------------------------------------------------------

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        """The fsspec filesystem, created on first use (also on each rank)."""
        if self._fs is None:
            self._fs = self._make_fs()
        return self._fs

    @property
    def arrow_filesystem(self) -> Any:
        """A filesystem ``pyarrow.dataset`` reads from (paths from ``fs_path``)."""
        return self.fs

    def _make_fs(self) -> fsspec.AbstractFileSystem:
        raise NotImplementedError

    # -- reading and writing -----------------------------------------------------------------

    def exists(self, path: str) -> bool:
        return self.fs.exists(self.fs_path(path))

    def read(self, path: str) -> bytes:
        return self.fs.cat_file(self.fs_path(path))

    def read_text(self, path: str) -> str:
        return self.read(path).decode("utf-8")

    def write_text(self, path: str, text: str) -> None:
        """Atomically replace ``path`` with ``text`` (UTF-8)."""
        self.write_bytes(path, text.encode("utf-8"))

    def write_bytes(self, path: str, data: bytes) -> None:
        """Atomically replace ``path`` with ``data``: readers see the old or the new file,
        never a partial one, even if this process dies mid-write."""
        with tempfile.TemporaryDirectory(prefix="flyte-hvd-") as tmp:
            local = os.path.join(tmp, "data")
            with open(local, "wb") as f:
                f.write(data)
            self.upload_file(local, path)

    def upload_file(self, local_path: str, remote_path: str) -> None:
        """Atomically replace ``remote_path`` with the finished local file ``local_path``."""
        target = self.fs_path(remote_path)
        self._makedirs(posixpath.dirname(target))
        if not self.publish_by_rename:
            self.fs.put_file(local_path, target)
            return
        tmp = _tmp_name(target)
        try:
            self.fs.put_file(local_path, tmp)
            self._replace(tmp, target)
        except BaseException:
            _quietly(self.fs.rm, tmp)
            raise

    def download_file(self, remote_path: str, local_path: str) -> None:
        """Copy ``remote_path`` to ``local_path``; a partial download never replaces
        ``local_path``."""
        folder = os.path.dirname(os.path.abspath(local_path))
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".download-", suffix=_TMP_SUFFIX, dir=folder)
        os.close(fd)
        try:
            self.fs.get_file(self.fs_path(remote_path), tmp)
            os.replace(tmp, local_path)
        except BaseException:
            _quietly(os.remove, tmp)
            raise

    def upload_dir(self, local_dir: str, remote_dir: str) -> list[str]:
        """Upload every file under ``local_dir`` (e.g. TensorBoard logs), each atomically;
        returns the remote paths written."""
        written = []
        for root, _, files in os.walk(local_dir):
            for name in sorted(files):
                local = os.path.join(root, name)
                rel = os.path.relpath(local, local_dir).replace(os.sep, "/")
                remote = self.join(remote_dir, rel)
                self.upload_file(local, remote)
                written.append(remote)
        return written

    def delete(self, path: str) -> None:
        """Remove ``path`` (recursively); a missing path is not an error."""
        target = self.fs_path(path)
        if self.fs.exists(target):
            self.fs.rm(target, recursive=True)

    def is_parquet_dataset(self, path: str) -> bool:
        """True when ``path`` is a directory holding at least one Parquet file."""
        target = self.fs_path(path)
        try:
            if not self.fs.isdir(target):
                return False
            return any(
                p.endswith(".parquet") and not posixpath.basename(p).startswith(("_", "."))
                for p in self.fs.find(target)
            )
        except FileNotFoundError:
            return False

    def get_parquet_dataset(self, path: str) -> Any:
        """A ``pyarrow.dataset.Dataset`` over the Parquet files under ``path`` (files sorted
        by path; hidden, ``_``-prefixed and, if there are ``.parquet`` files, other files
        skipped)."""
        return open_parquet_dataset(self.arrow_filesystem, self.fs_path(path))

    # -- checks ------------------------------------------------------------------------------

    def check_writable(self) -> None:
        """Create the prefix and write and delete a probe file, so that a store that cannot
        be written fails now, naming the path and the cause, and not in the middle of a run.

        Raises:
            RuntimeError: the prefix cannot be created or written.
        """
        probe = self.join(self.prefix_path, f".flyte-hvd-write-check-{uuid.uuid4().hex}")
        try:
            self._makedirs(self.fs_path(self.prefix_path))
            self.fs.pipe_file(self.fs_path(probe), b"ok")
            self.fs.rm(self.fs_path(probe))
        except Exception as error:
            raise RuntimeError(
                f"cannot write to the store at `{self.prefix_path}`: {self._explain(error)}"
            ) from error

    def _explain(self, error: Exception) -> str:
        if isinstance(error, PermissionError):
            return (
                f"permission denied ({_brief(error)}). Make the directory writable for this "
                f"user or pick another `prefix_path`."
            )
        return f"{_brief(error)}. Check that the path is correct and reachable."

    def _makedirs(self, path: str) -> None:
        if path:
            self.fs.makedirs(path, exist_ok=True)

    def _replace(self, tmp: str, target: str) -> None:
        self.fs.mv(tmp, target)

    # -- ranks -------------------------------------------------------------------------------

    def to_remote(self, run_id: str | None = None, dataset_idx: str | None = None) -> RemoteStore:
        """A small picklable view of this Store for the ranks of one run and one dataset;
        it carries paths and ``storage_options``, and opens its own connection on first use."""
        if run_id is not None:
            _check_run_id(run_id)
        return RemoteStore(store=self, run_id=run_id, dataset_idx=dataset_idx)


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

    def _make_fs(self) -> fsspec.AbstractFileSystem:
        return fsspec.filesystem("file")

    @property
    def arrow_filesystem(self) -> Any:
        import pyarrow.fs

        return pyarrow.fs.LocalFileSystem()

    def write_bytes(self, path: str, data: bytes) -> None:
        target = self.normalize(path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = _tmp_name(target)
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            _quietly(os.remove, tmp)
            raise

    def upload_file(self, local_path: str, remote_path: str) -> None:
        target = self.normalize(remote_path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = _tmp_name(target)
        try:
            shutil.copyfile(local_path, tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            _quietly(os.remove, tmp)
            raise

    def _makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)


class DBFSLocalStore(LocalStore):
    """Databricks File System through its local FUSE mount (``/dbfs/...``); accepts
    ``dbfs:/...`` and ``file:///dbfs/...`` and hands Spark ``dbfs:/`` URLs."""

    schemes: ClassVar[tuple[str, ...]] = ("dbfs",)

    def normalize(self, path: str) -> str:
        path = str(path)
        if path.startswith("dbfs:"):
            path = "/dbfs/" + path[len("dbfs:") :].lstrip("/")
        elif path.startswith("file://"):
            path = urlparse(path).path
        return posixpath.normpath(path)

    def spark_url(self, path: str) -> str:
        return "dbfs:/" + self.normalize(path)[len("/dbfs/") :]


class S3Store(Store):
    """Amazon S3 or any S3-compatible endpoint, through s3fs.

    Credentials and endpoint come from ``storage_options`` (``key``, ``secret``, ``token``,
    ``endpoint_url``, ``client_kwargs``) or the usual AWS environment variables
    (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``, profiles,
    instance roles). Spark writes prepared data itself only when the cluster has the S3A
    connector (``s3a://``); otherwise ``prepare_data`` uploads it through s3fs.
    """

    schemes: ClassVar[tuple[str, ...]] = ("s3", "s3a")
    publish_by_rename = False  # an S3 object appears only when its upload completes

    def normalize(self, path: str) -> str:
        return str(path).rstrip("/")

    def fs_path(self, path: str) -> str:
        return self.normalize(path).split("://", 1)[-1]

    def spark_url(self, path: str) -> str:
        return "s3a://" + self.fs_path(path)

    @property
    def bucket(self) -> str:
        return self.fs_path(self.prefix_path).split("/", 1)[0]

    def _make_fs(self) -> fsspec.AbstractFileSystem:
        import s3fs

        # A fresh instance: fsspec's instance cache would keep credentials from an older
        # environment.
        return s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)

    def _makedirs(self, path: str) -> None:
        pass  # S3 has no directories; a missing bucket shows up on the first write

    def _explain(self, error: Exception) -> str:
        if isinstance(error, FileNotFoundError):
            return (
                f"the bucket `{self.bucket}` does not exist or is not visible with these "
                f"credentials ({_brief(error)}). Create it or fix `prefix_path`."
            )
        if isinstance(error, PermissionError):
            return (
                f"access denied ({_brief(error)}). Check the credentials (`storage_options` "
                f"'key'/'secret', or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY), the endpoint "
                f"(`endpoint_url` or AWS_ENDPOINT_URL) and the bucket's policy."
            )
        return super()._explain(error)


class HDFSStore(Store):
    """HDFS through pyarrow's ``HadoopFileSystem`` (needs libhdfs, ``JAVA_HOME`` and the
    Hadoop ``CLASSPATH`` on every host). ``hdfs:///path`` uses the default namenode.

    HDFS cannot rename over an existing file, so a replace deletes the old file just before
    the rename: a crash in that instant leaves the finished temporary beside the target.
    """

    schemes: ClassVar[tuple[str, ...]] = ("hdfs",)

    def normalize(self, path: str) -> str:
        return str(path).rstrip("/")

    def fs_path(self, path: str) -> str:
        return urlparse(self.normalize(path)).path or "/"

    @property
    def host(self) -> str:
        return urlparse(self.prefix_path).hostname or "default"

    @property
    def port(self) -> int:
        return urlparse(self.prefix_path).port or 0

    def _make_fs(self) -> fsspec.AbstractFileSystem:
        from fsspec.implementations.arrow import HadoopFileSystem

        return HadoopFileSystem(host=self.host, port=self.port, **self.storage_options)

    @property
    def arrow_filesystem(self) -> Any:
        return self.fs.fs  # the pyarrow filesystem under fsspec's wrapper

    def _replace(self, tmp: str, target: str) -> None:
        if self.fs.exists(target):
            self.fs.rm(target)
        self.fs.mv(tmp, target)

    def _explain(self, error: Exception) -> str:
        return (
            f"{_brief(error)}. HDFSStore needs libhdfs (ARROW_LIBHDFS_DIR or "
            f"HADOOP_HOME), JAVA_HOME and the Hadoop CLASSPATH, and a reachable namenode at "
            f"`{self.host}:{self.port or 'default port'}`."
        )


_STORE_CLASSES: tuple[type[Store], ...] = (LocalStore, S3Store, HDFSStore, DBFSLocalStore)


def store_class_for(prefix_path: str) -> type[Store]:
    """The Store class that handles ``prefix_path``'s scheme."""
    path = _check_path("prefix_path", prefix_path)
    if path.startswith("/dbfs/") or path == "/dbfs" or path.startswith("file:///dbfs/"):
        return DBFSLocalStore
    scheme = urlparse(path).scheme.lower() if "://" in path or path.startswith("dbfs:") else ""
    for cls in _STORE_CLASSES:
        if scheme in cls.schemes:
            return cls
    raise ValueError(
        f"`prefix_path`={path!r} has the scheme `{scheme}`, which no Store handles; use a local "
        f"path, file://, s3://, s3a://, hdfs:// or dbfs:/."
    )


@dataclass(frozen=True)
class RemoteStore:
    """What a rank needs from the Store for one run and one dataset; picklable (the
    filesystem connection is opened again on the rank)."""

    store: Store
    run_id: str | None = None
    dataset_idx: str | None = None

    @property
    def train_data_path(self) -> str:
        return self.store.get_train_data_path(self.dataset_idx)

    @property
    def val_data_path(self) -> str:
        return self.store.get_val_data_path(self.dataset_idx)

    @property
    def run_path(self) -> str:
        return self.store.get_run_path(self._run())

    def checkpoint_path(self, extension: str) -> str:
        return self.store.get_checkpoint_path(self._run(), extension)

    @property
    def state_path(self) -> str:
        return self.store.get_state_path(self._run())

    @property
    def logs_path(self) -> str:
        return self.store.get_logs_path(self._run())

    @property
    def saving_runs(self) -> bool:
        return self.store.saving_runs

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        return self.store.fs

    @property
    def arrow_filesystem(self) -> Any:
        return self.store.arrow_filesystem

    def fs_path(self, path: str) -> str:
        return self.store.fs_path(path)

    def exists(self, path: str) -> bool:
        return self.store.exists(path)

    def read(self, path: str) -> bytes:
        return self.store.read(path)

    def write_bytes(self, path: str, data: bytes) -> None:
        self.store.write_bytes(path, data)

    def write_text(self, path: str, text: str) -> None:
        self.store.write_text(path, text)

    def upload_file(self, local_path: str, remote_path: str) -> None:
        self.store.upload_file(local_path, remote_path)

    def download_file(self, remote_path: str, local_path: str) -> None:
        self.store.download_file(remote_path, local_path)

    def upload_dir(self, local_dir: str, remote_dir: str) -> list[str]:
        return self.store.upload_dir(local_dir, remote_dir)

    def _run(self) -> str:
        if self.run_id is None:
            raise ValueError("this RemoteStore has no `run_id`; pass one to `to_remote`.")
        return self.run_id


def _check_path(name: str, path: Any) -> str:
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"`{name}` must be a non-empty path or URL; found {path!r}.")
    return path


def _check_run_id(run_id: Any) -> str:
    if not isinstance(run_id, str) or not run_id or "/" in run_id or run_id in (".", ".."):
        raise ValueError(f"`run_id` must be a non-empty name without '/'; found {run_id!r}.")
    return run_id


def _brief(error: BaseException, limit: int = 300) -> str:
    """The exception's type and first line (pyarrow's can list a hundred search paths)."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0] if lines else ''}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _tmp_name(target: str) -> str:
    folder, name = posixpath.split(target)
    return posixpath.join(folder, f".{name}.{uuid.uuid4().hex[:12]}{_TMP_SUFFIX}")


def _quietly(fn: Any, *args: Any) -> None:
    with contextlib.suppress(Exception):
        fn(*args)
