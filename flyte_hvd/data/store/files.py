"""A Store's files: its fsspec filesystem, reads and atomic writes through it, and the check
that it can be written (``check_writable``, which ``Store.create`` runs).

Every write that replaces a file is atomic, so a process that dies mid-write never destroys the
last good checkpoint: file systems write a temporary file beside the target and rename it;
object stores publish an object only when its single PUT (or multipart upload) completes.
"""

from __future__ import annotations

import contextlib
import functools
import os
import posixpath
import tempfile
import uuid
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import fsspec

from flyte_hvd.data.parquet import FileSystem
from flyte_hvd.data.store.bounded import bounded, check_reachable, store_timeout
from flyte_hvd.data.store.errors import explain_write_error
from flyte_hvd.data.store.layout import StoreLayout
from flyte_hvd.data.store.paths import (
    TMP_SUFFIX,
    check_path,
    check_run_id,
    local_files,
    temp_name,
)

__all__ = ["RunSync", "StoreFiles", "local_output_dir"]


class StoreFiles(StoreLayout):
    """The layout plus the filesystem: ``fs`` (opened on first use, also on each rank), the
    operations of a run on it and the write check (``Store`` documents the arguments).

    A backend opens its filesystem (``_make_fs``), says how a file is published
    (``publish_by_rename``, ``_replace``, ``_makedirs``) where fsspec's defaults do not fit,
    and what its failures mean (``_explain``, ``_explain_open``, ``_connect``, ``_endpoint``,
    ``_check_shared``).
    """

    # True: publish a file by writing a temporary beside it and renaming it over the target.
    # False: the store publishes an object only once its upload completes (object stores).
    publish_by_rename: ClassVar[bool] = True

    def __init__(
        self,
        prefix_path: str,
        storage_options: dict[str, Any] | None = None,  # fsspec's options for the filesystem
        temp_dir: str | os.PathLike[str] | None = None,
        timeout: float | None = None,
        **layout: Any,  # ``StoreLayout``'s arguments (``Store`` documents them all)
    ):
        super().__init__(prefix_path, **layout)
        if storage_options is not None and not isinstance(storage_options, dict):
            raise ValueError(
                f"`storage_options` must be a dict; found {type(storage_options).__name__}."
            )
        self.storage_options = dict(storage_options or {})
        self.temp_dir = None if temp_dir is None else check_path("temp_dir", temp_dir)
        self.timeout = store_timeout(timeout)
        self._fs: fsspec.AbstractFileSystem | None = None

    def __getstate__(self) -> dict[str, object]:
        state = self.__dict__.copy()
        state["_fs"] = None  # no live connections travel to the ranks
        return state

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

    def _make_fs(self) -> fsspec.AbstractFileSystem:
        raise NotImplementedError

    def address(self) -> str:
        """Where the store's server is, for messages about reaching it."""
        return f"`{self.prefix_path}` as the ranks' hosts see it"

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
        tmp = temp_name(target)
        try:
            self.fs.put_file(local_path, tmp)
            self._replace(tmp, target)
        except BaseException:
            with contextlib.suppress(Exception):
                self.fs.rm(tmp)
            raise

    def download_file(self, remote_path: str, local_path: str) -> None:
        """Copy ``remote_path`` to ``local_path``; a partial download never replaces
        ``local_path``."""
        folder = os.path.dirname(os.path.abspath(local_path))
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".download-", suffix=TMP_SUFFIX, dir=folder)
        os.close(fd)
        try:
            self.fs.get_file(self.fs_path(remote_path), tmp)
            os.replace(tmp, local_path)
        except BaseException:
            with contextlib.suppress(Exception):
                os.remove(tmp)
            raise

    def upload_dir(self, local_dir: str, remote_dir: str) -> list[str]:
        """Upload every file under ``local_dir`` (e.g. TensorBoard logs), each atomically;
        returns the remote paths written."""
        written = []
        for local, rel in local_files(local_dir):
            remote = self.join(remote_dir, rel)
            self.upload_file(local, remote)
            written.append(remote)
        return written

    def delete(self, path: str) -> None:
        """Remove ``path`` (recursively); a missing path is not an error."""
        target = self.fs_path(path)
        if self.fs.exists(target):
            self.fs.rm(target, recursive=True)

    def get_local_output_dir_fn(
        self, run_id: str
    ) -> Callable[[], contextlib.AbstractContextManager[str]]:
        """A function returning a context manager that yields a fresh local folder for the
        run's output (checkpoints, logs) and removes it on exit; ``sync_fn`` uploads such a
        folder. It is picklable, so it can travel to the ranks; the folder is made under
        ``temp_dir`` when one was given."""
        return functools.partial(local_output_dir, self.temp_dir, check_run_id(run_id))

    def sync_fn(self, run_id: str) -> Callable[[str], list[str]]:
        """A function that uploads a local folder into the run's folder in the store (each
        file replaced atomically, paths kept relative) and returns the store paths written.
        Called again, it uploads only the files that changed since (size or modification
        time), so it can run after every epoch. It is picklable (ranks call it)."""
        return RunSync(self, self.get_run_path(run_id))

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
            check_reachable(self, endpoint, probe, self.timeout)
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
        """Why the prefix could not be written (a backend that knows its errors says more)."""
        return explain_write_error(error)

    def _connect(self) -> None:
        """Open the filesystem (which reads the credentials), so that ``check_writable`` can
        tell a failure there from one of the first write."""
        self.fs  # noqa: B018

    def _explain_open(self, error: Exception) -> str:
        """Why the filesystem could not be opened (``_explain`` unless a class knows more)."""
        return self._explain(error)

    def _endpoint(self) -> str | None:
        """The URL of the store's server, which ``check_writable`` connects to first (None:
        no check)."""
        return None

    # -- publishing a file -----------------------------------------------------------------

    def _makedirs(self, path: str) -> None:
        if path:
            self.fs.makedirs(path, exist_ok=True)

    def _local_temp_dir(self) -> str | None:
        if self.temp_dir is not None:
            os.makedirs(self.temp_dir, exist_ok=True)
        return self.temp_dir

    def _replace(self, tmp: str, target: str) -> None:
        self.fs.mv(tmp, target)


class RunSync:
    """``Store.sync_fn``'s function: uploads a local folder into a run's folder, skipping
    files unchanged since its last call. A class, not a closure, so plain pickle ships it."""

    def __init__(self, store: StoreFiles, run_path: str):
        self.store = store
        self.run_path = run_path
        self._uploaded: dict[str, tuple[int, int]] = {}  # local path -> (mtime_ns, size)

    def __call__(self, local_run_path: str) -> list[str]:
        local_run_path = check_path("local_run_path", local_run_path)
        if not os.path.isdir(local_run_path):
            raise FileNotFoundError(
                f"`local_run_path`={local_run_path!r} is not a folder; `sync` uploads a local "
                f"folder (e.g. the one `get_local_output_dir` gave) into `{self.run_path}`."
            )
        written = []
        for local, rel in local_files(local_run_path):
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
def local_output_dir(temp_dir: str | None, run_id: str) -> Iterator[str]:
    """A fresh local folder for a run's output, removed on exit."""
    if temp_dir is not None:
        os.makedirs(temp_dir, exist_ok=True)  # on a rank, the driver's folder may not exist
    with tempfile.TemporaryDirectory(prefix=f"flyte-hvd-{run_id}-", dir=temp_dir) as folder:
        yield folder
