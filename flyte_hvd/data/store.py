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

Horovod's Store API (``horovod.spark.common.store``, 0.28) is here under its names, so code
written for Horovod runs with only the import changed: ``Store.create``,
``AbstractFilesystemStore``, ``FilesystemStore`` (any fsspec URL: ``gs://``, ``abfs://``,
``sftp://``...), ``LocalStore``, ``HDFSStore``, ``DBFSLocalStore`` and their methods
(``get_checkpoint_filename``, ``get_local_output_dir_fn``, ``sync_fn``, ``get_full_path``,
``get_localized_path``, ``copy``, ``matches``...). Where a meaning differs, the method says so.

This module imports neither pyspark nor TensorFlow: ranks use it through ``to_remote``.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import importlib
import os
import pickle
import posixpath
import shutil
import socket
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar
from urllib.parse import urlparse

import fsspec

from flyte_hvd.core.errors import ExplainedError
from flyte_hvd.core.log import get_logger, warn_once
from flyte_hvd.data.parquet import METADATA_FILENAME, FileSystem, open_parquet_dataset
from flyte_hvd.launch import stall

if TYPE_CHECKING:
    import keras
    import pyarrow.dataset as ds

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

logger = get_logger(__name__)
T = TypeVar("T")  # what a bounded store operation returns

CHECKPOINT_STEM = "checkpoint"  # + the framework's extension, unless a file name is chosen
STATE_FILENAME = "state.json"
LOGS_DIRNAME = "logs"
TRAIN_DATA_NAME = "intermediate_train_data"
VAL_DATA_NAME = "intermediate_val_data"
TEST_DATA_NAME = "intermediate_test_data"
RUNS_DIRNAME = "runs"
_TMP_SUFFIX = ".tmp"
# How long one store operation of the ranks (a checkpoint upload, reading state.json...) or of
# the driver (Store.create's check, the metadata) may take: a hung store must not hang a fit.
TIMEOUT_ENV = "FLYTE_HVD_STORE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 50.0  # below the stall check time (60 s): the error comes first
# A transfer gets this much more per MiB moved: a large file on a slow link is not a hung store.
SECONDS_PER_MIB = 1.0
# What exceptions of botocore, aiohttp and fsspec are called when the store cannot be reached.
_UNREACHABLE_ERRORS = frozenset({
    "EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
    "ConnectionClosedError", "ClientConnectorError", "ServerDisconnectedError",
    "ServerTimeoutError", "FSTimeoutError",
})  # fmt: skip


class StoreTimeoutError(ExplainedError):
    """A store operation of a rank did not finish in time (``FLYTE_HVD_STORE_TIMEOUT_S`` or the
    Store's ``timeout``)."""


class StoreUnreachableError(ExplainedError):
    """A store operation of a rank could not reach the store (connection refused, reset...)."""


# Protocols whose single PUT publishes an object atomically and that have no real directories.
_OBJECT_STORE_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "abfs", "abfss", "az", "oss"})
# The flyte-hvd extra that installs the fsspec package of a protocol (named in the error a
# missing package gives).
_PACKAGE_EXTRAS = {"gcsfs": "gcs", "adlfs": "azure"}


@dataclass(frozen=True)
class _CloudHelp:
    """What a FilesystemStore's errors tell a user of one object store."""

    bucket: str  # what the first path segment is called there
    credentials: str
    endpoint: str


_GCS_HELP = _CloudHelp(
    bucket="bucket",
    credentials="`storage_options` 'token' (a service-account JSON file, 'google_default', "
    "'cloud' or 'anon') or GOOGLE_APPLICATION_CREDENTIALS",
    endpoint="`storage_options` 'endpoint_url' or STORAGE_EMULATOR_HOST",
)
_AZURE_HELP = _CloudHelp(
    bucket="container",
    credentials="`storage_options` 'connection_string', or 'account_name' with 'account_key', "
    "'sas_token' or a service principal, or AZURE_STORAGE_CONNECTION_STRING / "
    "AZURE_STORAGE_ACCOUNT_NAME and AZURE_STORAGE_ACCOUNT_KEY",
    endpoint="`storage_options` 'account_host', or the connection string's BlobEndpoint",
)
_CLOUD_HELP = {"gs": _GCS_HELP, "gcs": _GCS_HELP, "abfs": _AZURE_HELP, "abfss": _AZURE_HELP,
               "az": _AZURE_HELP}  # fmt: skip


def _warn_once(key: str, message: str) -> None:
    warn_once(logger, f"store:{key}", message)


class _SavingRuns:
    """``Store.saving_runs``: truthy like the bool it holds (our property) and returning it
    when called (Horovod's ``saving_runs()`` method), so both spellings work."""

    __slots__ = ("_value",)

    def __init__(self, value: bool) -> None:
        self._value = bool(value)

    def __bool__(self) -> bool:
        return self._value

    def __call__(self) -> bool:
        return self._value

    def __eq__(self, other: object) -> bool:
        return self._value == (other._value if isinstance(other, _SavingRuns) else other)

    def __hash__(self) -> int:
        return hash(self._value)

    def __repr__(self) -> str:
        return repr(self._value)


class Store:
    """Paths and atomic file operations for one prefix; use ``Store.create(prefix_path)``.

    This is also Horovod's ``AbstractFilesystemStore`` (an alias): every Store here sits on a
    filesystem (fsspec's), and ``Store.create`` returns the right subclass for a URL.

    Args:
        prefix_path: root of everything the Store writes (a local path or a URL).
        train_path: override where prepared training data goes (a dataset's index is
            appended as ``.<idx>``).
        val_path: the same for validation data.
        test_path: the same for test data.
        runs_path: override ``<prefix>/runs``.
        save_runs: whether a run's folder (checkpoints, state, logs) is kept after a
            successful fit; False removes it once the trained model is back on the driver.
        storage_options: passed to the fsspec filesystem (for S3: ``key``, ``secret``,
            ``endpoint_url``, ``client_kwargs``...). They travel with ``to_remote`` to the
            ranks; prefer environment variables or instance roles for secrets.
        checkpoint_filename: name of the model file in a run (default: ``checkpoint`` plus
            the framework's extension: ``.keras``, ``.pt``, ``.ckpt``).
        temp_dir: local folder for temporary files (``get_local_output_dir_fn``'s folders,
            files staged before an upload); default: the system's temporary folder.
        timeout: seconds one store operation of the ranks (a checkpoint, state or log upload,
            a read to resume) or of the driver (``Store.create``'s write check, the prepared
            data's metadata) may take, plus one second per MiB it moves; then the run fails
            naming the operation. Default: ``FLYTE_HVD_STORE_TIMEOUT_S``, else 50.
        **kwargs: other keyword arguments are accepted, as Horovod's stores accept them, and
            ignored with a warning (once per name), since they mean nothing here.
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
        storage_options: dict[str, Any] | None = None,  # fsspec's options for the filesystem
        checkpoint_filename: str | None = None,
        temp_dir: str | os.PathLike[str] | None = None,
        timeout: float | None = None,
        **kwargs: Any,  # Horovod's other arguments: ignored, with a warning
    ):
        for key in kwargs:
            _warn_once(
                f"{type(self).__name__}.{key}",
                f"`{type(self).__name__}` got `{key}`, which is not one of its arguments; it is "
                f"ignored (Horovod's stores ignore unknown keyword arguments too). Check the "
                f"spelling if you meant `train_path`, `val_path`, `test_path`, `runs_path`, "
                f"`save_runs`, `storage_options`, `checkpoint_filename`, `temp_dir` or "
                f"`timeout`.",
            )
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
        self.temp_dir = None if temp_dir is None else _check_path("temp_dir", temp_dir)
        self.timeout = store_timeout(timeout)
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
        storage_options: dict[str, Any] | None = None,  # fsspec's options for the filesystem
        checkpoint_filename: str | None = None,
        **kwargs: Any,  # the chosen class's other arguments
    ) -> Store:
        """The Store for ``prefix_path``'s scheme, checked writable now rather than mid-run.

        Local paths and ``file://`` give a ``LocalStore``, ``s3://``/``s3a://`` an
        ``S3Store``, ``hdfs://`` an ``HDFSStore``, ``dbfs:/`` and ``/dbfs/`` a
        ``DBFSLocalStore``; any other protocol fsspec knows (``gs://``, ``abfs://``,
        ``sftp://``...) a ``FilesystemStore``. ``kwargs`` go to that class (e.g. ``temp_dir``,
        or ``user``/``kerb_ticket`` for HDFS).

        Raises:
            ValueError: an unsupported scheme, a filesystem whose files only this process
                sees (``memory://``), or a malformed argument.
            ImportError: fsspec knows the scheme but the package serving it is not installed
                (the message names it, and the flyte-hvd extra that installs it: ``gcs``,
                ``azure``).
            RuntimeError: the filesystem cannot be opened, or the prefix cannot be created or
                written (the message names the path, the cause, such as permission, a missing
                bucket or container or refused credentials, and what to set).
        """
        cls = store_class_for(prefix_path)
        # By keyword: HDFSStore's positional arguments after the prefix are Horovod's
        # host/port/user..., not train_path/val_path...
        store = cls(
            prefix_path,
            train_path=train_path,
            val_path=val_path,
            test_path=test_path,
            runs_path=runs_path,
            save_runs=save_runs,
            storage_options=storage_options,
            checkpoint_filename=checkpoint_filename,
            **kwargs,
        )
        store.check_writable()
        return store

    @classmethod
    def matches(cls, path: str) -> bool:
        """Whether this Store class handles ``path``'s scheme (Horovod's ``matches``);
        ``Store.create`` uses the first class that does, ``FilesystemStore`` last."""
        return _scheme_of(_check_path("path", path)) in cls.schemes

    def __getstate__(self) -> dict[str, object]:
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
        """Where a run's model goes.

        With an ``extension`` (the framework's: ``.keras``, ``.pt``, ``.ckpt``): the model
        file, ``checkpoint_filename`` when one was chosen, else ``checkpoint<extension>``.
        Without one (Horovod's call, ``get_checkpoint_path(run_id)``): the folder that holds
        the run's checkpoint files, i.e. the run's folder, so that Horovod's
        ``join(get_checkpoint_path(run_id), get_checkpoint_filename())`` names the file.
        Horovod returns None there when ``save_runs`` is False; here the run's folder is used
        during training either way (and removed after fit), so its path is returned.
        """
        run_path = self.get_run_path(run_id)
        if extension == "":
            return run_path
        return self.join(run_path, self.get_checkpoint_filename(extension))

    def get_checkpoint_filename(self, extension: str = "") -> str:
        """The model file's name inside a run's folder (Horovod's method).

        ``checkpoint_filename`` when one was chosen; else ``checkpoint`` followed by
        ``extension``: plain ``checkpoint`` as Horovod names it, ``checkpoint.keras`` etc.
        as our estimators write it (they pass their framework's extension).

        Raises:
            ValueError: ``extension`` is not empty and not a file extension such as '.keras'.
        """
        if self.checkpoint_filename is not None:
            return self.checkpoint_filename
        if extension and (not extension.startswith(".") or "/" in extension):
            raise ValueError(
                f"`extension` must be the model format's file extension such as '.keras' or "
                f"'.pt' (this Store has no `checkpoint_filename`); found {extension!r}."
            )
        return CHECKPOINT_STEM + extension

    def get_state_path(self, run_id: str) -> str:
        return self.join(self.get_run_path(run_id), STATE_FILENAME)

    def get_logs_path(self, run_id: str) -> str:
        return self.join(self.get_run_path(run_id), LOGS_DIRNAME)

    def get_logs_subdir(self) -> str:
        """The name of a run's TensorBoard folder (``logs``), as Horovod's method gives it."""
        return LOGS_DIRNAME

    def get_data_metadata_path(self, path: str) -> str:
        """Where the metadata of the dataset at ``path`` lives: ``prepare_data``'s JSON sidecar
        inside the dataset's folder. (Horovod keeps a pickled cache beside the folder; the
        sidecar plays that role here and is read by ``read_metadata``.)"""

        return self.join(self.normalize(_check_path("path", path)), METADATA_FILENAME)

    def get_checkpoints(self, run_id: str, suffix: str | None = None) -> list[str]:
        """Finished checkpoint files of a run (default: those with the chosen checkpoint file's
        suffix, else ``checkpoint`` and ``checkpoint.*``), sorted, as full paths; in-flight
        temporaries are never listed. (Horovod's default ``suffix`` is '.ckpt'; pass it to get
        only those.)"""
        if suffix is None and self.checkpoint_filename is not None:
            suffix = posixpath.splitext(self.checkpoint_filename)[1]
        run_path = self.get_run_path(run_id)
        if not self.exists(run_path):
            return []
        names = [
            posixpath.basename(p.rstrip("/"))
            for p in self.fs.ls(self.fs_path(run_path), detail=False)
        ]
        return sorted(
            self.join(run_path, n)
            for n in names
            if (
                n.endswith(suffix)
                if suffix is not None
                else n == CHECKPOINT_STEM or n.startswith(CHECKPOINT_STEM + ".")
            )
            and not n.startswith(".")
            and not n.endswith(_TMP_SUFFIX)
        )

    @property
    def saving_runs(self) -> _SavingRuns:
        """Whether a run's folder is kept after fit; use it as a bool (``if
        store.saving_runs:``) or call it as Horovod does (``store.saving_runs()``)."""
        return _SavingRuns(self._save_runs)

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

    def get_localized_path(self, path: str) -> str:
        """``path`` without the scheme and host, as the fsspec filesystem ``fs`` takes it
        (Horovod's name for ``fs_path``)."""
        return self.fs_path(_check_path("path", path))

    def get_full_path(self, path: str) -> str:
        """``path`` as a full URL in this store (``file:///...`` for local stores); a path
        that already names another scheme is returned unchanged, as Horovod does."""
        path = _check_path("path", path)
        scheme = _scheme_of(path)
        if scheme and scheme not in self._own_schemes():
            return path
        return self._full_url(path)

    def get_full_path_fn(self) -> Callable[[str], str]:
        """A function giving ``get_full_path`` (picklable, so it can travel to the ranks)."""
        return self.get_full_path

    def _own_schemes(self) -> tuple[str, ...]:
        return self.schemes

    def _full_url(self, path: str) -> str:
        return self.normalize(path)

    # -- filesystems -------------------------------------------------------------------------

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        """The fsspec filesystem, created on first use (also on each rank)."""
        if self._fs is None:
            self._fs = self._make_fs()
        return self._fs

    @property
    def arrow_filesystem(self) -> FileSystem:
        """A filesystem ``pyarrow.dataset`` reads from (paths from ``fs_path``)."""
        return self.fs

    def get_filesystem(self) -> fsspec.AbstractFileSystem:
        """The fsspec filesystem (``fs``), as Horovod's ``FilesystemStore.get_filesystem``
        returns it; it takes ``get_localized_path`` paths. For a pyarrow filesystem use
        ``arrow_filesystem``."""
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
        with tempfile.TemporaryDirectory(prefix="flyte-hvd-", dir=self._local_temp_dir()) as tmp:
            local = os.path.join(tmp, "data")
            with open(local, "wb") as f:
                f.write(data)
            self.upload_file(local, path)

    def create_exclusive(self, path: str, data: bytes) -> bool:
        """Write ``path`` only where no file is: True when this call created it, False when
        one was there. Two writers racing for one path: exactly one gets True on local
        filesystems and S3 (a conditional PUT); on other filesystems, which offer no such
        write, the check and the write are two steps."""
        if self.exists(path):
            return False
        self.write_bytes(path, data)
        return True

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
        for local, rel in _local_files(local_dir):
            remote = self.join(remote_dir, rel)
            self.upload_file(local, remote)
            written.append(remote)
        return written

    def copy(
        self,
        lpath: str,
        rpath: str,
        recursive: bool = False,
        callback: fsspec.callbacks.Callback | None = None,
        **kwargs: Any,  # Horovod's arguments to fsspec's put_file
    ) -> list[str]:
        """Copy the local file or folder ``lpath`` to ``rpath`` in the store (Horovod's
        ``copy``); returns the store paths written.

        A file is written at ``rpath``. A folder needs ``recursive=True``, and its contents
        land directly in ``rpath`` (``rpath/<relative path>``), never in a new
        ``rpath/<folder name>`` even when ``rpath`` exists: unlike fsspec's ``put``, as in
        Horovod. Each file replaces its target atomically.

        Args:
            lpath: a local file or folder.
            rpath: where it goes in this store.
            recursive: copy a folder's contents (required for a folder).
            callback: an fsspec ``Callback``: told the number of files, then each one done.
            **kwargs: Horovod passes them to fsspec's ``put_file`` (e.g. ``overwrite=True``);
                every write here replaces its target, so they are ignored.

        Raises:
            FileNotFoundError: ``lpath`` does not exist.
            ValueError: ``lpath`` is a folder and ``recursive`` is False.
        """
        lpath = _check_path("lpath", lpath)
        rpath = _check_path("rpath", rpath)
        # overwrite=True (what Horovod's sync passes) is what every write here does anyway.
        ignored = sorted(k for k, v in kwargs.items() if not (k == "overwrite" and v is True))
        if ignored:
            _warn_once(
                "Store.copy.kwargs",
                f"`Store.copy` ignores {ignored}: they are fsspec `put_file` options in "
                f"Horovod; here every file it writes replaces its target atomically.",
            )
        if os.path.isdir(lpath):
            if not recursive:
                raise ValueError(
                    f"`lpath`={lpath!r} is a folder; pass `recursive=True` to copy its contents "
                    f"into `rpath`={rpath!r}, or give a file."
                )
            pairs = [(local, self.join(rpath, rel)) for local, rel in _local_files(lpath)]
        elif os.path.isfile(lpath):
            pairs = [(lpath, rpath)]
        else:
            raise FileNotFoundError(
                f"`lpath`={lpath!r} does not exist; `copy` sends a local file or folder into "
                f"the store."
            )
        if callback is not None:
            callback.set_size(len(pairs))
        for local, remote in pairs:
            self.upload_file(local, remote)
            if callback is not None:
                callback.relative_update(1)
        return [remote for _, remote in pairs]

    def get_local_output_dir_fn(
        self, run_id: str
    ) -> Callable[[], contextlib.AbstractContextManager[str]]:
        """A function returning a context manager that yields a fresh local folder for the
        run's output (checkpoints, logs) and removes it on exit; ``sync_fn`` uploads such a
        folder. It is picklable, so it can travel to the ranks; the folder is made under
        ``temp_dir`` when one was given."""
        return functools.partial(_local_output_dir, self.temp_dir, _check_run_id(run_id))

    def sync_fn(self, run_id: str) -> Callable[[str], list[str]]:
        """A function that uploads a local folder into the run's folder in the store (each
        file replaced atomically, paths kept relative) and returns the store paths written.
        Called again, it uploads only the files that changed since (size or modification
        time), so it can run after every epoch. It is picklable (ranks call it)."""
        return _RunSync(self, self.get_run_path(run_id))

    def read_serialized_keras_model(
        self,
        ckpt_path: str,
        model: keras.Model | None = None,
        custom_objects: dict[str, Any] | None = None,  # Keras' name -> class or function
    ) -> str:
        """The Keras model file at ``ckpt_path``, read through the store, serialized as
        Horovod's estimators pass models around: base64 (ASCII) of the pickled file bytes,
        which Horovod's ``codec.loads_base64`` (or ``pickle.loads(base64.b64decode(s))``)
        turns back into the bytes of a ``.keras``/``.h5`` file.

        Horovod loads the model with TensorFlow and saves it again; a whole-model file
        (what ``ModelCheckpoint`` writes here) already is that serialized model, so it is
        read as is, without TensorFlow. ``model`` (the structure for a weights-only
        checkpoint) and ``custom_objects`` (needed only to load the model) are accepted for
        Horovod's signature and not needed.

        Raises:
            FileNotFoundError: there is no file at ``ckpt_path``.
            ValueError: ``ckpt_path`` is a folder (e.g. a TensorFlow SavedModel), not one file.
        """
        ckpt_path = _check_path("ckpt_path", ckpt_path)
        target = self.fs_path(ckpt_path)
        if self.fs.isdir(target):
            raise ValueError(
                f"`ckpt_path`={ckpt_path!r} is a folder (a TensorFlow SavedModel?); expected "
                f"one Keras model file such as a '.keras' or '.h5' checkpoint. Save whole-model "
                f"checkpoints to a single file."
            )
        if not self.fs.exists(target):
            raise FileNotFoundError(
                f"no checkpoint at `ckpt_path`={ckpt_path!r}; check the run id, or that the "
                f"run saved a checkpoint (`store.get_checkpoints(run_id)` lists them)."
            )
        data = self.read(ckpt_path)
        return base64.b64encode(pickle.dumps(data, protocol=pickle.HIGHEST_PROTOCOL)).decode(
            "ascii"
        )

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

    def get_parquet_dataset(self, path: str) -> ds.Dataset:
        """A ``pyarrow.dataset.Dataset`` over the Parquet files under ``path`` (files sorted
        by path; hidden, ``_``-prefixed and, if there are ``.parquet`` files, other files
        skipped)."""
        return open_parquet_dataset(self.arrow_filesystem, self.fs_path(path))

    # -- checks ------------------------------------------------------------------------------

    def check_writable(self) -> None:
        """Create the prefix and write and delete a probe file, so that a store that cannot
        be written fails now, naming the path and the cause, and not in the middle of a run.

        Raises:
            ValueError: only this process sees the store's files (``memory://``).
            RuntimeError: the prefix cannot be created or written.
            StoreTimeoutError: the store did not answer within its ``timeout``.
            StoreUnreachableError: its server cannot be reached (for ``gs://``, checked with
                one connection first, rather than through the client's retries).
        """
        self._check_shared()
        probe = self.join(self.prefix_path, f".flyte-hvd-write-check-{uuid.uuid4().hex}")
        # Within the store's timeout, as every operation of the ranks: an endpoint that
        # accepts connections and never answers must not hang `Store.create`.
        bounded(self, ("writing", "to"), probe, 0, self._write_probe, probe)

    def _write_probe(self, probe: str) -> None:
        endpoint = self._endpoint()
        if endpoint is not None:
            # A client may retry an endpoint it cannot reach for most of the timeout (gcsfs:
            # about 50 s without a network); one connection says at once.
            _check_reachable(self, endpoint, probe)
        try:
            self._connect()
        except Exception as error:
            raise RuntimeError(
                f"cannot open the store at `{self.prefix_path}`: {self._explain_open(error)}"
            ) from error
        try:
            self._makedirs(self.fs_path(self.prefix_path))
            self.fs.pipe_file(self.fs_path(probe), b"ok")
            self.fs.rm(self.fs_path(probe))
        except Exception as error:
            raise RuntimeError(
                f"cannot write to the store at `{self.prefix_path}`: {self._explain(error)}"
            ) from error

    def _check_shared(self) -> None:
        """The ranks and Spark's executors are other processes: a filesystem whose content
        lives inside this process is refused (ValueError)."""

    def _explain(self, error: Exception) -> str:
        if isinstance(error, PermissionError):
            return (
                f"permission denied ({_brief(error)}). Make the directory writable for this "
                f"user or pick another `prefix_path`."
            )
        return f"{_brief(error)}. Check that the path is correct and reachable."

    def _connect(self) -> None:
        """Open the filesystem (which reads the credentials), so that ``check_writable`` can
        tell a failure there from one of the first write."""
        self.fs  # noqa: B018

    def _explain_open(self, error: Exception) -> str:
        """Why the filesystem could not be opened (``_explain`` unless a class knows more)."""
        return self._explain(error)

    def address(self) -> str:
        """Where the store's server is, for messages about reaching it."""
        return f"`{self.prefix_path}` as the ranks' hosts see it"

    def _endpoint(self) -> str | None:
        """The URL of the store's server, which ``check_writable`` connects to first (None:
        no check)."""
        return None

    def _makedirs(self, path: str) -> None:
        if path:
            self.fs.makedirs(path, exist_ok=True)

    def _local_temp_dir(self) -> str | None:
        if self.temp_dir is not None:
            os.makedirs(self.temp_dir, exist_ok=True)
        return self.temp_dir

    def _replace(self, tmp: str, target: str) -> None:
        self.fs.mv(tmp, target)

    # -- ranks -------------------------------------------------------------------------------

    def to_remote(self, run_id: str | None = None, dataset_idx: str | None = None) -> RemoteStore:
        """A small picklable view of this Store for the ranks of one run and one dataset;
        it carries paths and ``storage_options``, and opens its own connection on first use."""
        if run_id is not None:
            _check_run_id(run_id)
        return RemoteStore(store=self, run_id=run_id, dataset_idx=dataset_idx)


# Horovod's base of the filesystem stores. Every Store here is one, so the name is an alias:
# `isinstance(store, AbstractFilesystemStore)` holds for all of them, and a Horovod subclass of
# it is a Store subclass (implement `_make_fs`, and `normalize`/`fs_path` for URLs).
AbstractFilesystemStore = Store


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
            _quietly(os.remove, tmp)
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
            _quietly(os.remove, tmp)
        return True

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
        path = _check_path("prefix_path", prefix_path)
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
        return cls.matches_dbfs(_check_path("path", path))

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
        if not DBFSLocalStore.matches_dbfs(_check_path("path", path)):
            raise ValueError(
                f"`path`={path!r} is not a DBFS path; expected `/dbfs/...`, `dbfs:/...`, "
                f"`file:/dbfs/...` or `file:///dbfs/...`."
            )
        return _dbfs_fuse_path(path)

    def normalize(self, path: str) -> str:
        return _dbfs_fuse_path(str(path))

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

    def _full_url(self, path: str) -> str:
        path = self.normalize(path)
        if "://" in path:
            return path
        scheme = _scheme_of(self.prefix_path) or "s3"  # the prefix's own: s3 or s3a
        return f"{scheme}://{path.lstrip('/')}"

    @property
    def bucket(self) -> str:
        return self.fs_path(self.prefix_path).split("/", 1)[0]

    def _make_fs(self) -> fsspec.AbstractFileSystem:
        import s3fs

        options = dict(self.storage_options)
        # s3fs's limits per request (5 s to connect, 15 s without an answer; then it retries),
        # never longer than a whole operation may take; `config_kwargs` given win.
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("connect_timeout", min(5.0, self.timeout))
        config.setdefault("read_timeout", min(15.0, self.timeout))
        options["config_kwargs"] = config
        # A fresh instance: fsspec's instance cache would keep credentials from an older
        # environment.
        return s3fs.S3FileSystem(skip_instance_cache=True, **options)

    def address(self) -> str:
        endpoint = self.storage_options.get("endpoint_url") or (
            self.storage_options.get("client_kwargs") or {}
        ).get("endpoint_url")
        endpoint = (
            endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        )
        where = f"endpoint {endpoint}" if endpoint else "AWS's endpoint for the bucket's region"
        return (
            f"{where}; it is `endpoint_url` in `storage_options`, or AWS_ENDPOINT_URL where the "
            f"ranks run"
        )

    def _makedirs(self, path: str) -> None:
        pass  # S3 has no directories; a missing bucket shows up on the first write

    def create_exclusive(self, path: str, data: bytes) -> bool:
        try:  # one PUT with If-None-Match: * (S3 answers 412 when the key exists)
            self.fs.pipe_file(self.fs_path(path), data, mode="create")
        except FileExistsError:
            return False
        return True

    def _explain(self, error: Exception) -> str:
        if type(error).__name__ == "NoCredentialsError":  # botocore's: nothing to sign with
            return (
                f"no AWS credentials were found ({_brief(error)}). Give them in "
                f"`storage_options` ('key' and 'secret', or 'profile'), or set "
                f"AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, or an instance "
                f"role) where the driver and the executors run; for a public bucket, "
                f"storage_options={{'anon': True}}."
            )
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
    Hadoop ``CLASSPATH`` on every host). ``prefix_path`` is ``hdfs://host:port/path``,
    ``hdfs:///path`` (the default namenode) or ``/path`` (taken as ``hdfs:///path``).

    HDFS cannot rename over an existing file, so a replace deletes the old file just before
    the rename: a crash in that instant leaves the finished temporary beside the target.

    Args:
        prefix_path: where the store lives on HDFS.
        host: the namenode to connect to; default: the URL's, else ``default`` (the
            cluster's configured default). Paths keep the URL's host and port.
        port: the namenode's port; default: the URL's, else 0.
        user: the HDFS user to act as.
        kerb_ticket: path of the Kerberos ticket cache.
        driver: accepted for Horovod's signature; pyarrow always uses libhdfs (JNI), so any
            other value is ignored with a warning.
        extra_conf: extra Hadoop configuration (``{"dfs.replication": "2"}``...).
        temp_dir: local folder for temporary files (see ``Store``).
        *args: ``Store``'s arguments, after these.
        **kwargs: ``Store``'s arguments (``train_path``..., ``storage_options``, also passed
            to pyarrow's ``HadoopFileSystem``).

    Raises:
        ValueError: ``prefix_path`` is not an HDFS path, or ``port`` is not an integer.
    """

    schemes: ClassVar[tuple[str, ...]] = ("hdfs",)

    def __init__(
        self,
        prefix_path: str,
        host: str | None = None,
        port: int | None = None,
        user: str | None = None,
        kerb_ticket: str | None = None,
        driver: str = "libhdfs",
        extra_conf: dict[str, str] | None = None,
        temp_dir: str | os.PathLike[str] | None = None,
        *args: Any,  # ``Store``'s arguments, passed on
        **kwargs: Any,  # ``Store``'s arguments, passed on
    ):
        path = _check_path("prefix_path", prefix_path)
        scheme = _scheme_of(path)
        if scheme not in ("", "hdfs"):
            raise ValueError(
                f"`prefix_path`={path!r} has the scheme `{scheme}`; `HDFSStore` expects "
                f"`hdfs://host:port/path`, `hdfs:///path` or `/path`. Use `Store.create` to get "
                f"the store for another scheme."
            )
        # What bare absolute paths are prefixed with: the URL's scheme, host and port.
        self._url_prefix = "hdfs://" + (urlparse(path).netloc if scheme else "")
        if port is not None and (isinstance(port, bool) or not isinstance(port, int)):
            raise ValueError(f"`port` must be an integer such as 8020; found {port!r}.")
        if extra_conf is not None and not isinstance(extra_conf, dict):
            raise ValueError(
                f"`extra_conf` must be a dict of Hadoop settings; found "
                f"{type(extra_conf).__name__}."
            )
        if driver != "libhdfs":
            _warn_once(
                "HDFSStore.driver",
                f"`HDFSStore` got `driver`={driver!r}, which is accepted for Horovod "
                f"compatibility and does nothing here: pyarrow's HadoopFileSystem always uses "
                f"libhdfs.",
            )
        self._host_arg = host
        self._port_arg = port
        self._hdfs_options = {
            k: v
            for k, v in (("user", user), ("kerb_ticket", kerb_ticket), ("extra_conf", extra_conf))
            if v is not None
        }
        if len(args) > 7:
            raise TypeError(
                f"`HDFSStore` takes at most 7 positional arguments after `temp_dir` (`train_path` "
                f"... `checkpoint_filename`); found {len(args)}. Pass the others by keyword."
            )
        super().__init__(path, *args, **{**kwargs, "temp_dir": temp_dir})

    def normalize(self, path: str) -> str:
        path = str(path)
        scheme = _scheme_of(path)
        if not scheme:
            if not path.startswith("/"):
                raise ValueError(
                    f"`{path}` is not an HDFS path: expected `hdfs://host:port/path`, "
                    f"`hdfs:///path` or an absolute path such as `/user/me/exp`."
                )
            path = self._url_prefix + path
        elif scheme != "hdfs":
            raise ValueError(
                f"`{path}` has the scheme `{scheme}`; this `HDFSStore` takes `hdfs://` URLs "
                f"or absolute paths."
            )
        return path.rstrip("/")

    def fs_path(self, path: str) -> str:
        return urlparse(self.normalize(path)).path or "/"

    @property
    def host(self) -> str:
        return self._host_arg or urlparse(self.prefix_path).hostname or "default"

    @property
    def port(self) -> int:
        return self._port_arg or urlparse(self.prefix_path).port or 0

    def _make_fs(self) -> fsspec.AbstractFileSystem:
        from fsspec.implementations.arrow import HadoopFileSystem

        # The constructor's user/kerb_ticket/extra_conf win over the same storage_options.
        options = {**self.storage_options, **self._hdfs_options}
        return HadoopFileSystem(host=self.host, port=self.port, **options)

    @property
    def arrow_filesystem(self) -> FileSystem:
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


class FilesystemStore(Store):
    """A Store on any filesystem fsspec knows: ``gs://`` (gcsfs), ``abfs://`` (adlfs),
    ``sftp://``... and local paths (``file://``). ``Store.create`` picks it for protocols
    without a class of their own; it refuses ``memory://``, whose files only this process sees
    (the class itself accepts it, for tests in one process).

    The filesystem is built as fsspec builds it for the URL (options the URL carries, such
    as a user or host), updated with ``storage_options`` (credentials, endpoint...). Paths
    are kept as URLs (``memory://exp/runs``); ``get_localized_path`` gives the filesystem's
    form. Object stores (gs, abfs...) publish a file with one upload, others write a
    temporary beside the target and rename it.

    Google Cloud Storage takes ``token`` (a service-account JSON file, 'google_default',
    'anon'...), ``project`` and ``endpoint_url``, or GOOGLE_APPLICATION_CREDENTIALS and
    STORAGE_EMULATOR_HOST; Azure takes ``connection_string``, or ``account_name`` with
    ``account_key`` or ``sas_token``, or the AZURE_STORAGE_* variables. ``Store.create``
    names a missing bucket or container and the credentials to check.

    Args:
        prefix_path: the store's root URL.
        train_path: as for ``Store``.
        val_path: as for ``Store``.
        test_path: as for ``Store``.
        runs_path: as for ``Store``.
        save_runs: as for ``Store``.
        storage_options: as for ``Store``.
        checkpoint_filename: as for ``Store``.
        temp_dir: as for ``Store``.
        timeout: as for ``Store``.
        **kwargs: as for ``Store``.

    Raises:
        ValueError: fsspec does not know the scheme.
        ImportError: fsspec knows it but the package serving it is not installed (the
            message names the package, and its flyte-hvd extra where there is one).
    """

    def __init__(
        self,
        prefix_path: str,
        train_path: str | None = None,
        val_path: str | None = None,
        test_path: str | None = None,
        runs_path: str | None = None,
        save_runs: bool = True,
        storage_options: dict[str, Any] | None = None,  # fsspec's options for the filesystem
        checkpoint_filename: str | None = None,
        temp_dir: str | os.PathLike[str] | None = None,
        timeout: float | None = None,
        **kwargs: Any,  # ``Store``'s other arguments, passed on
    ):
        path = _check_path("prefix_path", prefix_path)
        self.protocol = _scheme_of(path) or "file"
        self._given_prefix = path  # for messages; normalizing needs the class below
        _filesystem_class(self.protocol, path)  # fail now, naming the package to install
        super().__init__(
            path,
            train_path=train_path,
            val_path=val_path,
            test_path=test_path,
            runs_path=runs_path,
            save_runs=save_runs,
            storage_options=storage_options,
            checkpoint_filename=checkpoint_filename,
            temp_dir=temp_dir,
            timeout=timeout,
            **kwargs,
        )

    @classmethod
    def matches(cls, path: str) -> bool:
        """Whether fsspec knows ``path``'s protocol (a path without one is local); Horovod's
        matches everything, but a scheme nothing serves is better refused at creation."""
        return _fsspec_knows(_scheme_of(_check_path("path", path)) or "file")

    def _fs_class(self) -> type[fsspec.AbstractFileSystem]:
        return _filesystem_class(self.protocol, self._given_prefix)

    def _own_schemes(self) -> tuple[str, ...]:
        protocols = self._fs_class().protocol
        return (self.protocol, *((protocols,) if isinstance(protocols, str) else protocols))

    def normalize(self, path: str) -> str:
        path = str(path)
        scheme = _scheme_of(path)
        if not scheme:
            path = f"{self.protocol}://{self._fs_class()._strip_protocol(path)}"
        elif scheme not in self._own_schemes():
            raise ValueError(
                f"`{path}` has the scheme `{scheme}`, but this FilesystemStore reads and writes "
                f"through `{self.protocol}://`; give paths on that filesystem (or without a "
                f"scheme)."
            )
        head, _, tail = path.partition("://")
        return f"{head}://{tail.rstrip('/') or '/'}"

    def fs_path(self, path: str) -> str:
        return self._fs_class()._strip_protocol(self.normalize(path))

    def spark_url(self, path: str) -> str:
        return self.normalize(path)

    def _make_fs(self) -> fsspec.AbstractFileSystem:
        cls = self._fs_class()
        options = cls._get_kwargs_from_urls(self.prefix_path)
        options.update(self.storage_options)
        # A fresh instance: fsspec's cache would share one (and its credentials) across stores.
        return cls(skip_instance_cache=True, **options)

    def upload_file(self, local_path: str, remote_path: str) -> None:
        if self.protocol in _OBJECT_STORE_PROTOCOLS:
            # The object appears only once its upload completes: no temporary needed.
            self.fs.put_file(local_path, self.fs_path(remote_path))
            return
        super().upload_file(local_path, remote_path)

    def _makedirs(self, path: str) -> None:
        if self.protocol not in _OBJECT_STORE_PROTOCOLS:  # no directories (nor buckets) there
            super()._makedirs(path)

    def _replace(self, tmp: str, target: str) -> None:
        try:
            self.fs.mv(tmp, target)
        except OSError:
            # Some filesystems (sftp, hdfs-like) refuse to rename over an existing file.
            if not self.fs.exists(target):
                raise
            self.fs.rm(target)
            self.fs.mv(tmp, target)

    @property
    def bucket(self) -> str:
        """The bucket (Google Cloud Storage) or container (Azure) of ``prefix_path``."""
        return self.fs_path(self.prefix_path).lstrip("/").split("/", 1)[0]

    def _explain(self, error: Exception) -> str:
        cloud = _CLOUD_HELP.get(self.protocol)
        if cloud is not None:
            if _is_missing_bucket(error):
                return (
                    f"the {cloud.bucket} `{self.bucket}` does not exist or is not visible with "
                    f"these credentials ({_brief(error)}). Create it or fix `prefix_path`."
                )
            if _is_access_denied(error):
                return (
                    f"access denied ({_brief(error)}). Check the credentials "
                    f"({cloud.credentials}), the endpoint ({cloud.endpoint}) and the "
                    f"{cloud.bucket}'s permissions."
                )
        if isinstance(error, PermissionError):
            return super()._explain(error)
        return (
            f"{_brief(error)}. Check the path, the `storage_options` (credentials, endpoint) "
            f"and that the `{self.protocol}://` filesystem is reachable."
        )

    def _endpoint(self) -> str | None:
        if self.protocol not in ("gs", "gcs") or "session_kwargs" in self.storage_options:
            return None  # (a session of the user's own may go through a proxy)
        given = self.storage_options.get("endpoint_url")
        emulator = os.environ.get("STORAGE_EMULATOR_HOST", "")
        if not given and emulator not in ("", "default"):  # as gcsfs reads it
            given = emulator if "://" in emulator else f"http://{emulator}"
        return str(given or "https://storage.googleapis.com")

    def address(self) -> str:
        endpoint = self._endpoint()
        if endpoint is None:
            return super().address()
        return (
            f"endpoint {endpoint}; it is `endpoint_url` in `storage_options`, or "
            f"STORAGE_EMULATOR_HOST where the ranks run"
        )

    def _check_shared(self) -> None:
        from fsspec.implementations.memory import MemoryFileSystem

        if issubclass(self._fs_class(), MemoryFileSystem):
            raise ValueError(
                f"`{self.prefix_path}` is on fsspec's in-memory filesystem ({self.protocol}://), "
                f"whose files live inside this Python process only: the ranks and Spark's "
                f"executors are other processes and would not see them. Use a folder every "
                f"process can reach (a local path on one machine, e.g. '/tmp/flyte-hvd'; a "
                f"shared mount) or an object store (s3://, gs://, abfs://, hdfs://)."
            )

    def _connect(self) -> None:
        fs = self.fs
        # gcsfs retries a request whose access token cannot be had 6 times (about 30 s) before
        # it gives up; asking for the token first fails at once with the token server's answer
        # (a revoked key, a bad signature...). Anonymous access has none to ask for.
        refresh = getattr(getattr(fs, "credentials", None), "maybe_refresh", None)
        if self.protocol in ("gs", "gcs") and callable(refresh):
            refresh()

    def _explain_open(self, error: Exception) -> str:
        cloud = _CLOUD_HELP.get(self.protocol)
        cause = error.__cause__
        brief = _brief(error) + (f"; {_brief(cause)}" if cause is not None else "")
        hint = (
            f"the credentials ({cloud.credentials}) and the endpoint ({cloud.endpoint})"
            if cloud is not None
            else "the `storage_options` (credentials, endpoint)"
        )
        return (
            f"`{self._fs_class().__module__.split('.')[0]}` could not sign in with these "
            f"`storage_options` ({brief}). Check {hint}."
        )


_STORE_CLASSES: tuple[type[Store], ...] = (LocalStore, S3Store, HDFSStore, DBFSLocalStore)


def store_class_for(prefix_path: str) -> type[Store]:
    """The Store class that handles ``prefix_path``'s scheme: our own class for local paths,
    s3, hdfs and dbfs, else ``FilesystemStore`` for any protocol fsspec knows.

    Raises:
        ValueError: neither a Store class nor fsspec knows the scheme.
    """
    path = _check_path("prefix_path", prefix_path)
    if path.startswith(("/dbfs/", "file:///dbfs/", "file:/dbfs/")) or path == "/dbfs":
        return DBFSLocalStore
    scheme = _scheme_of(path)
    for cls in _STORE_CLASSES:
        if scheme in cls.schemes:
            return cls
    if FilesystemStore.matches(path):
        return FilesystemStore
    raise ValueError(_unknown_scheme(path, scheme))


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
    def test_data_path(self) -> str:
        return self.store.get_test_data_path(self.dataset_idx)

    @property
    def runs_path(self) -> str:
        return self.store.get_runs_path()

    @property
    def run_path(self) -> str:
        return self.store.get_run_path(self._run())

    def checkpoint_path(self, extension: str) -> str:
        """The run's model file (``checkpoint_filename``, else ``checkpoint<extension>``)."""
        return self.store.join(self.run_path, self.store.get_checkpoint_filename(extension))

    @property
    def checkpoint_filename(self) -> str:
        return self.store.get_checkpoint_filename()

    @property
    def logs_subdir(self) -> str:
        return self.store.get_logs_subdir()

    @property
    def get_local_output_dir(self) -> Callable[[], contextlib.AbstractContextManager[str]]:
        """Horovod's attribute: ``with remote.get_local_output_dir() as folder:``."""
        return self.store.get_local_output_dir_fn(self._run())

    @functools.cached_property
    def sync(self) -> Callable[[str], list[str]]:
        """Horovod's attribute: ``remote.sync(folder)`` uploads it into the run's folder
        (one function per view, so repeated calls upload only what changed)."""
        return self.store.sync_fn(self._run())

    @property
    def state_path(self) -> str:
        return self.store.get_state_path(self._run())

    @property
    def logs_path(self) -> str:
        return self.store.get_logs_path(self._run())

    @property
    def saving_runs(self) -> bool:
        return bool(self.store.saving_runs)  # a plain bool, as Horovod's remote store has

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        return self.store.fs

    @property
    def arrow_filesystem(self) -> FileSystem:
        return self.store.arrow_filesystem

    def fs_path(self, path: str) -> str:
        return self.store.fs_path(path)

    # The operations of training (checkpoints, state, logs, reads to resume) each have a
    # bounded time (the Store's `timeout`): a store that hangs fails the run, naming itself.

    def exists(self, path: str) -> bool:
        return self._bounded(("looking for", "in"), path, 0, self.store.exists, path)

    def read(self, path: str) -> bytes:
        return self._bounded(("reading", "from"), path, 0, self.store.read, path)

    def write_bytes(self, path: str, data: bytes) -> None:
        self._bounded(("writing", "to"), path, len(data), self.store.write_bytes, path, data)

    def write_text(self, path: str, text: str) -> None:
        self.write_bytes(path, text.encode("utf-8"))

    def upload_file(self, local_path: str, remote_path: str) -> None:
        size = os.path.getsize(local_path)
        self._bounded(("uploading", "to"), remote_path, size, self.store.upload_file,
                      local_path, remote_path)  # fmt: skip

    def download_file(self, remote_path: str, local_path: str) -> None:
        target = self.store.fs_path(remote_path)
        size = self._bounded(("looking for", "in"), remote_path, 0, self.store.fs.size, target)
        self._bounded(("downloading", "from"), remote_path, size or 0, self.store.download_file,
                      remote_path, local_path)  # fmt: skip

    def upload_dir(self, local_dir: str, remote_dir: str) -> list[str]:
        written = []
        for local, rel in _local_files(local_dir):
            remote = self.store.join(remote_dir, rel)
            self.upload_file(local, remote)
            written.append(remote)
        return written

    def _bounded(self, verb: tuple[str, str], path: str, size: int,
                 fn: Callable[..., T], *args: object) -> T:  # fmt: skip
        """``fn(*args)`` within the Store's timeout (``bounded``); an error that says the
        store cannot be reached becomes a ``StoreUnreachableError`` naming the operation."""
        store = self.store
        try:
            return bounded(store, verb, path, size, fn, *args)
        except StoreTimeoutError:
            raise
        except Exception as error:
            if not _unreachable(error):
                raise
            raise _unreachable_error(store, verb, path, error) from None

    def _run(self) -> str:
        if self.run_id is None:
            raise ValueError("this RemoteStore has no `run_id`; pass one to `to_remote`.")
        return self.run_id


def _doing(store: Store, verb: tuple[str, str], path: str) -> str:
    """What a store operation does, for messages: "uploading runs/r/x to s3://bucket/exp"."""
    prefix = store.prefix_path
    rel = path[len(prefix) :].lstrip("/") if path.startswith(prefix) else path
    return f"{verb[0]} {rel} {verb[1]} {prefix}"


def _unreachable_error(store: Store, verb: tuple[str, str], path: str,
                       error: BaseException) -> StoreUnreachableError:  # fmt: skip
    return StoreUnreachableError(
        f"cannot reach the store at `{store.prefix_path}` while {_doing(store, verb, path)}: "
        f"{_brief(error)}. Check that the store is up and reachable from every executor "
        f"({store.address()})."
    )


def _check_reachable(store: Store, endpoint: str, path: str) -> None:
    """One connection to ``endpoint`` (a URL), or a ``StoreUnreachableError`` naming it."""
    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection(
            (url.hostname or "", port), timeout=min(5.0, store.timeout)
        ).close()
    except OSError as error:
        raise _unreachable_error(store, ("writing", "to"), path, error) from None


def bounded(store: Store, verb: tuple[str, str], path: str, size: int,
            fn: Callable[..., T], *args: object) -> T:  # fmt: skip
    """``fn(*args)`` (one operation on ``store``, on ``path``) in a thread of its own, waited
    for up to the Store's timeout (plus ``SECONDS_PER_MIB`` per MiB of ``size``): on the
    driver (``Store.create``'s check, ``prepare_data``'s metadata) as on the ranks
    (``RemoteStore``). A hung store leaves that thread blocked, and the caller gets a
    ``StoreTimeoutError`` naming the operation, the store and the setting."""
    doing = _doing(store, verb, path)
    base = getattr(store, "timeout", DEFAULT_TIMEOUT_S)
    limit = base + SECONDS_PER_MIB * size / (1 << 20)
    outcome: dict[str, Any] = {}
    done = threading.Event()

    def call() -> None:
        try:
            outcome["value"] = fn(*args)
        except BaseException as error:
            outcome["error"] = error
        finally:
            done.set()

    with stall.activity(doing):
        threading.Thread(target=call, name="flyte-hvd-store", daemon=True).start()
        finished = done.wait(limit)
    if not finished:
        raise StoreTimeoutError(
            f"{doing} did not finish within {round(limit, 1):g}s: the store does not answer "
            f"({store.address()}). Check that it is up and reachable from every executor; "
            f"if the link is that slow, raise the Store's `timeout` or {TIMEOUT_ENV} "
            f"(now {base:g}s, plus {SECONDS_PER_MIB:g}s per MiB moved)."
        )
    error = outcome.get("error")
    if error is not None:
        raise error
    return outcome["value"]  # type: ignore[no-any-return]  # fn's own result


class _RunSync:
    """``Store.sync_fn``'s function: uploads a local folder into a run's folder, skipping
    files unchanged since its last call. A class, not a closure, so plain pickle ships it."""

    def __init__(self, store: Store, run_path: str):
        self.store = store
        self.run_path = run_path
        self._uploaded: dict[str, tuple[int, int]] = {}  # local path -> (mtime_ns, size)

    def __call__(self, local_run_path: str) -> list[str]:
        local_run_path = _check_path("local_run_path", local_run_path)
        if not os.path.isdir(local_run_path):
            raise FileNotFoundError(
                f"`local_run_path`={local_run_path!r} is not a folder; `sync` uploads a local "
                f"folder (e.g. the one `get_local_output_dir` gave) into `{self.run_path}`."
            )
        written = []
        for local, rel in _local_files(local_run_path):
            st = os.stat(local)
            stamp = (st.st_mtime_ns, st.st_size)  # taken before the upload: a later change
            if self._uploaded.get(local) == stamp:  # shows up as new on the next call
                continue
            remote = self.store.join(self.run_path, rel)
            self.store.upload_file(local, remote)
            self._uploaded[local] = stamp
            written.append(remote)
        return written


@contextlib.contextmanager
def _local_output_dir(temp_dir: str | None, run_id: str) -> Iterator[str]:
    """A fresh local folder for a run's output, removed on exit."""
    if temp_dir is not None:
        os.makedirs(temp_dir, exist_ok=True)  # on a rank, the driver's folder may not exist
    with tempfile.TemporaryDirectory(prefix=f"flyte-hvd-{run_id}-", dir=temp_dir) as folder:
        yield folder


def _local_files(local_dir: str) -> list[tuple[str, str]]:
    """(path, path relative to ``local_dir`` with '/') of every file under ``local_dir``."""
    found = []
    for root, _, files in os.walk(local_dir):
        for name in sorted(files):
            local = os.path.join(root, name)
            found.append((local, os.path.relpath(local, local_dir).replace(os.sep, "/")))
    return found


def _scheme_of(path: str) -> str:
    """The lower-case scheme of a URL (``dbfs:/x`` and ``file:/x`` included), '' for a path."""
    if path.startswith("dbfs:"):
        return "dbfs"
    if "://" in path:
        return urlparse(path).scheme.lower()
    if path.startswith("file:"):
        return "file"
    return ""


def _dbfs_fuse_path(path: str) -> str:
    if path.startswith("dbfs:"):
        path = "/dbfs/" + path[len("dbfs:") :].lstrip("/")
    elif path.startswith("file://"):
        path = urlparse(path).path
    elif path.startswith("file:"):
        path = path[len("file:") :]
    return posixpath.normpath(path)


def url_to_fs(url: str, **storage_options: Any) -> tuple[fsspec.AbstractFileSystem, str]:
    """fsspec's ``url_to_fs``, with fsspec's own package for the URL's scheme (s3fs, gcsfs,
    adlfs...) even where another library registered its filesystem over it (as the Flyte 2
    SDK does with obstore's)."""
    if "::" in url:  # a chained URL (``simplecache::s3://...``): fsspec's own resolution
        return fsspec.core.url_to_fs(url, **storage_options)
    cls = _filesystem_class(_scheme_of(url) or "file", url)
    options = {**cls._get_kwargs_from_urls(url), **storage_options}
    return cls(**options), cls._strip_protocol(url)


def _fsspec_knows(protocol: str) -> bool:
    from fsspec.registry import known_implementations, registry

    return protocol in registry or protocol in known_implementations


def _filesystem_class(protocol: str, path: str) -> type[fsspec.AbstractFileSystem]:
    """fsspec's class for ``protocol``, or an error saying what to install or use."""
    from fsspec.registry import known_implementations

    if not _fsspec_knows(protocol):
        raise ValueError(_unknown_scheme(path, protocol))
    spec = known_implementations.get(protocol, {})
    try:
        if "class" in spec:
            # fsspec's own package for the scheme (gcsfs, adlfs...), even where another
            # library registered its filesystem over it (the Flyte 2 SDK puts obstore's over
            # s3, gs, abfs...): the Store's options, checks and atomic writes are that
            # package's.
            module, _, name = spec["class"].rpartition(".")
            return getattr(importlib.import_module(module), name)
        return fsspec.get_filesystem_class(protocol)
    except ImportError as error:
        # fsspec chains the import's own error, which names the missing module.
        missing = (
            getattr(error.__cause__, "name", None)
            or error.name
            or spec.get("class", "?").split(".")[0]
        )
        extra = _PACKAGE_EXTRAS.get(missing)
        install = (
            f"`pip install 'flyte-hvd[{extra}]'` or `pip install {missing}`"
            if extra
            else f"`pip install {missing}`"
        )
        raise ImportError(
            f"`prefix_path`={path!r} uses the scheme `{protocol}`, which fsspec serves with "
            f"`{spec.get('class', '?')}`, but the package `{missing}` is not installed "
            f"(fsspec: {_brief(error)}). Install it where the driver and the ranks run "
            f"({install}), or use another `prefix_path`.",
            name=missing,
        ) from error


def _is_missing_bucket(error: BaseException) -> bool:
    """A write failed because the bucket or container is not there: gcsfs says
    FileNotFoundError, adlfs passes on Azure's ``ContainerNotFound``."""
    return isinstance(error, FileNotFoundError) or (
        getattr(error, "error_code", None) == "ContainerNotFound"
    )


def _is_access_denied(error: BaseException) -> bool:
    """A request was refused for its credentials: an HTTP 401/403 (Azure's errors carry
    ``status_code``, gcsfs's ``HttpError`` ``code``; gcsfs raises a plain OSError
    'Forbidden' for a 403)."""
    status = getattr(error, "status_code", None) or getattr(error, "code", None)
    return (
        isinstance(error, PermissionError)
        or status in (401, 403)
        or str(error).startswith("Forbidden")
    )


def _unknown_scheme(path: str, scheme: str) -> str:
    return (
        f"`prefix_path`={path!r} has the scheme `{scheme}`, which neither a flyte_hvd Store nor "
        f"fsspec handles; use a local path, file://, s3://, s3a://, hdfs://, dbfs:/ or "
        f"another protocol fsspec knows (`fsspec.available_protocols()`), or register one "
        f"with `fsspec.register_implementation`."
    )


def _check_path(name: str, path: object) -> str:
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"`{name}` must be a non-empty path or URL; found {path!r}.")
    return path


def store_timeout(timeout: object = None) -> float:
    """A Store's ``timeout``: the argument, else ``FLYTE_HVD_STORE_TIMEOUT_S``, else 50 s."""
    if timeout is None:
        raw = os.environ.get(TIMEOUT_ENV, "").strip()
        if not raw:
            return DEFAULT_TIMEOUT_S
        try:
            value = float(raw)
        except ValueError:
            value = float("nan")
        if not 0 < value < float("inf"):
            raise ValueError(
                f"{TIMEOUT_ENV}={raw!r}: expected the seconds one store operation of the ranks "
                f"may take (> 0), e.g. 120."
            )
        return value
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not (0 < timeout < float("inf"))
    ):
        raise ValueError(
            f"`timeout` must be the seconds one store operation of the ranks may take (> 0), "
            f"e.g. 120; found {timeout!r}."
        )
    return float(timeout)


def _unreachable(error: BaseException) -> bool:
    """Whether ``error`` (or what it was raised from) says the store could not be reached."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        names = {c.__name__ for c in type(current).__mro__}
        if isinstance(current, ConnectionError | TimeoutError) or names & _UNREACHABLE_ERRORS:
            return True
        current = current.__cause__ or current.__context__
    return False


def _durable_temp(target: str, data: bytes) -> str:
    """``data`` in a temporary file beside ``target`` (its folder made), flushed to disk: it
    can then be renamed or linked to ``target`` whole."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = _tmp_name(target)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        _quietly(os.remove, tmp)
        raise
    return tmp


def _check_run_id(run_id: object) -> str:
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


def _quietly(fn: Callable[..., object], *args: object) -> None:
    with contextlib.suppress(Exception):
        fn(*args)
