"""``Store``: its arguments, ``Store.create`` (the backend for a prefix's scheme, checked
writable before a run rather than during it) and ``to_remote`` (the ranks' view).

A Store is built up in layers, one module each: ``layout`` (the paths), ``files`` (the
filesystem, atomic reads and writes, the write check), ``compat`` (Horovod's other methods);
this module adds construction and the backends ``create`` chooses from, which the package
registers (the backends' modules import this one).
"""

from __future__ import annotations

import os
from typing import Any

from flyte_hvd.data.store.compat import HorovodStoreMethods
from flyte_hvd.data.store.errors import warn_once_about
from flyte_hvd.data.store.filesystems import unknown_scheme
from flyte_hvd.data.store.paths import check_path, check_run_id, scheme_of
from flyte_hvd.data.store.remote import RemoteStore

__all__ = ["AbstractFilesystemStore", "Store", "register_backends", "store_class_for"]


class Store(HorovodStoreMethods):
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
            warn_once_about(
                f"{type(self).__name__}.{key}",
                f"`{type(self).__name__}` got `{key}`, which is not one of its arguments; it is "
                f"ignored (Horovod's stores ignore unknown keyword arguments too). Check the "
                f"spelling if you meant `train_path`, `val_path`, `test_path`, `runs_path`, "
                f"`save_runs`, `storage_options`, `checkpoint_filename`, `temp_dir` or "
                f"`timeout`.",
            )
        super().__init__(
            prefix_path,
            train_path=train_path,
            val_path=val_path,
            test_path=test_path,
            runs_path=runs_path,
            save_runs=save_runs,
            storage_options=storage_options,
            checkpoint_filename=checkpoint_filename,
            temp_dir=temp_dir,
            timeout=timeout,
        )

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

    # -- ranks -------------------------------------------------------------------------------

    def to_remote(self, run_id: str | None = None, dataset_idx: str | None = None) -> RemoteStore:
        """A small picklable view of this Store for the ranks of one run and one dataset;
        it carries paths and ``storage_options``, and opens its own connection on first use."""
        if run_id is not None:
            check_run_id(run_id)
        return RemoteStore(store=self, run_id=run_id, dataset_idx=dataset_idx)


# Horovod's base of the filesystem stores. Every Store here is one, so the name is an alias:
# `isinstance(store, AbstractFilesystemStore)` holds for all of them, and a Horovod subclass of
# it is a Store subclass (implement `_make_fs`, and `normalize`/`fs_path` for URLs).
AbstractFilesystemStore = Store

# The classes `store_class_for` tries, in order (the package registers its backends).
_BACKENDS: list[type[Store]] = []


def register_backends(*classes: type[Store]) -> None:
    """Sets the Store classes ``Store.create`` chooses from: the first that has the prefix's
    scheme among its ``schemes``, or whose ``matches`` accepts the prefix, serves it; so a
    narrower class comes before a broader one (``DBFSLocalStore`` before ``LocalStore``;
    ``FilesystemStore``, which takes any protocol fsspec knows, last)."""
    _BACKENDS[:] = classes


def store_class_for(prefix_path: str) -> type[Store]:
    """The Store class that handles ``prefix_path``'s scheme: our own class for local paths,
    s3, hdfs and dbfs, else ``FilesystemStore`` for any protocol fsspec knows.

    Raises:
        ValueError: neither a Store class nor fsspec knows the scheme.
    """
    path = check_path("prefix_path", prefix_path)
    scheme = scheme_of(path)
    for cls in _BACKENDS:
        # A class serves its schemes even where its `matches` is narrower (`DBFS://x` is a
        # DBFSLocalStore's, which then refuses it as not a DBFS path).
        if scheme in cls.schemes or cls.matches(path):
            return cls
    raise ValueError(unknown_scheme(path, scheme))
