"""Horovod's Store methods that flyte_hvd's own training does not call, under Horovod's names
and meanings (``horovod.spark.common.store``, 0.28), so code written for Horovod runs with
only the import changed. Where a meaning differs, the method says so.

Horovod's other names are elsewhere: ``AbstractFilesystemStore`` is the ``Store`` itself
(``base``), the path methods (``get_checkpoint_filename``, ``get_full_path``,
``get_localized_path``...) are the layout's, ``sync_fn`` and ``get_local_output_dir_fn`` the
files' (the ranks use them through ``RemoteStore``).
"""

from __future__ import annotations

import base64
import os
import pickle
import posixpath
from typing import TYPE_CHECKING, Any

import fsspec

from flyte_hvd.data.parquet import open_parquet_dataset
from flyte_hvd.data.store.errors import warn_once_about
from flyte_hvd.data.store.files import StoreFiles
from flyte_hvd.data.store.paths import CHECKPOINT_STEM, TMP_SUFFIX, check_path, local_files

if TYPE_CHECKING:
    import pyarrow.dataset as ds

__all__ = ["HorovodStoreMethods"]


class HorovodStoreMethods(StoreFiles):
    """Horovod's methods of a Store beyond the layout and the operations of a run: ``copy``,
    ``get_checkpoints``, ``get_filesystem``, ``is_parquet_dataset``, ``get_parquet_dataset``
    and ``read_serialized_keras_model``."""

    def get_filesystem(self) -> fsspec.AbstractFileSystem:
        """The fsspec filesystem (``fs``), as Horovod's ``FilesystemStore.get_filesystem``
        returns it; it takes ``get_localized_path`` paths. For a pyarrow filesystem use
        ``arrow_filesystem``."""
        return self.fs

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
            and not n.endswith(TMP_SUFFIX)
        )

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
        lpath = check_path("lpath", lpath)
        rpath = check_path("rpath", rpath)
        # overwrite=True (what Horovod's sync passes) is what every write here does anyway.
        ignored = sorted(k for k, v in kwargs.items() if not (k == "overwrite" and v is True))
        if ignored:
            warn_once_about(
                "Store.copy.kwargs",
                f"`Store.copy` ignores {ignored}: they are fsspec `put_file` options in "
                f"Horovod; here every file it writes replaces its target atomically.",
            )
        pairs = self._copy_pairs(lpath, rpath, recursive)
        if callback is not None:
            callback.set_size(len(pairs))
        for local, remote in pairs:
            self.upload_file(local, remote)
            if callback is not None:
                callback.relative_update(1)
        return [remote for _, remote in pairs]

    def _copy_pairs(self, lpath: str, rpath: str, recursive: bool) -> list[tuple[str, str]]:
        """(local file, store path) of each file ``copy`` writes."""
        if os.path.isdir(lpath):
            if not recursive:
                raise ValueError(
                    f"`lpath`={lpath!r} is a folder; pass `recursive=True` to copy its contents "
                    f"into `rpath`={rpath!r}, or give a file."
                )
            return [(local, self.join(rpath, rel)) for local, rel in local_files(lpath)]
        if os.path.isfile(lpath):
            return [(lpath, rpath)]
        raise FileNotFoundError(
            f"`lpath`={lpath!r} does not exist; `copy` sends a local file or folder into the store."
        )

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

    def read_serialized_keras_model(
        self,
        ckpt_path: str,
        model: object = None,  # Horovod's keras.Model, for a weights-only checkpoint
        custom_objects: dict[str, Any] | None = None,  # Keras' name -> class or function
    ) -> str:
        """The model file at ``ckpt_path``, read through the store, serialized as Horovod's
        estimators pass models around: base64 (ASCII) of the pickled file bytes, which
        Horovod's ``codec.loads_base64`` (or ``pickle.loads(base64.b64decode(s))``) turns
        back into the bytes of a ``.keras``/``.h5`` file.

        Horovod loads the model with TensorFlow and saves it again; a whole-model file
        (what ``ModelCheckpoint`` writes here) already is that serialized model, so it is
        read as is, without TensorFlow or Keras. ``model`` (the structure for a weights-only
        checkpoint) and ``custom_objects`` (needed only to load the model) are accepted for
        Horovod's signature and not needed.

        Raises:
            FileNotFoundError: there is no file at ``ckpt_path``.
            ValueError: ``ckpt_path`` is a folder (e.g. a TensorFlow SavedModel), not one file.
        """
        ckpt_path = check_path("ckpt_path", ckpt_path)
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
        data = pickle.dumps(self.read(ckpt_path), protocol=pickle.HIGHEST_PROTOCOL)
        return base64.b64encode(data).decode("ascii")
