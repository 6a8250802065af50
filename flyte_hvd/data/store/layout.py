"""Where a Store puts things: the layout under its prefix, and paths in the forms the user,
fsspec and Spark each want them. No filesystem is opened here."""

from __future__ import annotations

import posixpath
from collections.abc import Callable
from typing import ClassVar

from flyte_hvd.data.parquet import METADATA_FILENAME
from flyte_hvd.data.store.paths import (
    CHECKPOINT_STEM,
    LOGS_DIRNAME,
    RUNS_DIRNAME,
    STATE_FILENAME,
    TEST_DATA_NAME,
    TRAIN_DATA_NAME,
    VAL_DATA_NAME,
    check_path,
    check_run_id,
    scheme_of,
)

__all__ = ["SavingRuns", "StoreLayout"]


class SavingRuns:
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
        return self._value == (other._value if isinstance(other, SavingRuns) else other)

    def __hash__(self) -> int:
        return hash(self._value)

    def __repr__(self) -> str:
        return repr(self._value)


class StoreLayout:
    """The paths of a Store (``Store`` documents the arguments)::

        <prefix>/intermediate_train_data.<idx>/   Parquet written by prepare_data
        <prefix>/intermediate_val_data.<idx>/
        <prefix>/intermediate_train_data.<idx>.lease.json   a write in progress
        <prefix>/runs/<run_id>/checkpoint.<ext>   best or last model (.keras, .pt...)
        <prefix>/runs/<run_id>/state.json         epoch reached, metrics history
        <prefix>/runs/<run_id>/logs/              TensorBoard event files

    A backend says which schemes it serves (``schemes``) and how its paths are written
    (``normalize``, ``fs_path``, ``spark_url``, ``_full_url``).
    """

    schemes: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        prefix_path: str,
        train_path: str | None = None,
        val_path: str | None = None,
        test_path: str | None = None,
        runs_path: str | None = None,
        save_runs: bool = True,
        checkpoint_filename: str | None = None,
    ):
        self.prefix_path = self.normalize(check_path("prefix_path", prefix_path))
        self._train_path = self._own_path("train_path", train_path, TRAIN_DATA_NAME)
        self._val_path = self._own_path("val_path", val_path, VAL_DATA_NAME)
        self._test_path = self._own_path("test_path", test_path, TEST_DATA_NAME)
        self._runs_path = self._own_path("runs_path", runs_path, RUNS_DIRNAME)
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

    @classmethod
    def matches(cls, path: str) -> bool:
        """Whether this Store class handles ``path``'s scheme (Horovod's ``matches``);
        ``Store.create`` uses the first class that does, ``FilesystemStore`` last."""
        return scheme_of(check_path("path", path)) in cls.schemes

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.prefix_path!r})"

    # -- the layout (Horovod's names) --------------------------------------------------------

    def get_train_data_path(self, idx: str | int | None = None) -> str:
        return self._train_path if idx is None else f"{self._train_path}.{idx}"

    def get_val_data_path(self, idx: str | int | None = None) -> str:
        return self._val_path if idx is None else f"{self._val_path}.{idx}"

    def get_test_data_path(self, idx: str | int | None = None) -> str:
        return self._test_path if idx is None else f"{self._test_path}.{idx}"

    def get_runs_path(self) -> str:
        return self._runs_path

    def get_run_path(self, run_id: str) -> str:
        return self.join(self._runs_path, check_run_id(run_id))

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

        return self.join(self.normalize(check_path("path", path)), METADATA_FILENAME)

    @property
    def saving_runs(self) -> SavingRuns:
        """Whether a run's folder is kept after fit; use it as a bool (``if
        store.saving_runs:``) or call it as Horovod does (``store.saving_runs()``)."""
        return SavingRuns(self._save_runs)

    # -- forms of a path ---------------------------------------------------------------------

    def join(self, *parts: str) -> str:
        return posixpath.join(*parts)

    def _own_path(self, name: str, path: str | None, default_name: str) -> str:
        if path is None:
            return self.join(self.prefix_path, default_name)
        return self.normalize(check_path(name, path))

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
        return self.fs_path(check_path("path", path))

    def get_full_path(self, path: str) -> str:
        """``path`` as a full URL in this store (``file:///...`` for local stores); a path
        that already names another scheme is returned unchanged, as Horovod does."""
        path = check_path("path", path)
        scheme = scheme_of(path)
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
