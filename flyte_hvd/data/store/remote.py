"""``RemoteStore``: what the ranks get of a Store (``Store.to_remote``), one run's and one
dataset's paths and the operations of training on them, each bounded by the Store's timeout."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import fsspec

from flyte_hvd.data.parquet import FileSystem
from flyte_hvd.data.store.bounded import bounded, unreachable_error
from flyte_hvd.data.store.errors import StoreTimeoutError, is_unreachable
from flyte_hvd.data.store.paths import local_files

if TYPE_CHECKING:
    # What a rank needs of a Store: its paths and files (``base`` imports this module).
    from flyte_hvd.data.store.files import StoreFiles

__all__ = ["RemoteStore"]

T = TypeVar("T")  # what a bounded store operation returns


@dataclass(frozen=True)
class RemoteStore:
    """What a rank needs from the Store for one run and one dataset; picklable (the
    filesystem connection is opened again on the rank)."""

    store: StoreFiles  # a Store
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
        self._bounded(
            ("uploading", "to"), remote_path, size, self.store.upload_file, local_path, remote_path
        )

    def download_file(self, remote_path: str, local_path: str) -> None:
        target = self.store.fs_path(remote_path)
        size = self._bounded(("looking for", "in"), remote_path, 0, self.store.fs.size, target)
        self._bounded(
            ("downloading", "from"),
            remote_path,
            size or 0,
            self.store.download_file,
            remote_path,
            local_path,
        )

    def upload_dir(self, local_dir: str, remote_dir: str) -> list[str]:
        written = []
        for local, rel in local_files(local_dir):
            remote = self.store.join(remote_dir, rel)
            self.upload_file(local, remote)
            written.append(remote)
        return written

    def _bounded(
        self, verb: tuple[str, str], path: str, size: int, fn: Callable[..., T], *args: object
    ) -> T:
        """``fn(*args)`` within the Store's timeout (``bounded``); an error that says the
        store cannot be reached becomes a ``StoreUnreachableError`` naming the operation."""
        store = self.store
        try:
            return bounded(store, verb, path, size, fn, *args)
        except StoreTimeoutError:
            raise
        except Exception as error:
            if not is_unreachable(error):
                raise
            raise unreachable_error(store, verb, path, error) from None

    def _run(self) -> str:
        if self.run_id is None:
            raise ValueError("this RemoteStore has no `run_id`; pass one to `to_remote`.")
        return self.run_id
