"""The names a Store gives what it writes, and the checks and parts of paths every module of
the package shares (schemes, run ids, temporaries, local folders)."""

from __future__ import annotations

import os
import posixpath
import uuid
from urllib.parse import urlparse

__all__ = [
    "CHECKPOINT_STEM",
    "LOGS_DIRNAME",
    "RUNS_DIRNAME",
    "STATE_FILENAME",
    "TEST_DATA_NAME",
    "TMP_SUFFIX",
    "TRAIN_DATA_NAME",
    "VAL_DATA_NAME",
    "check_path",
    "check_run_id",
    "local_files",
    "scheme_of",
    "temp_name",
]

CHECKPOINT_STEM = "checkpoint"  # + the framework's extension, unless a file name is chosen
STATE_FILENAME = "state.json"
LOGS_DIRNAME = "logs"
TRAIN_DATA_NAME = "intermediate_train_data"
VAL_DATA_NAME = "intermediate_val_data"
TEST_DATA_NAME = "intermediate_test_data"
RUNS_DIRNAME = "runs"
TMP_SUFFIX = ".tmp"  # of a file being written, never listed as a checkpoint


def check_path(name: str, path: object) -> str:
    """``path`` (a str or ``os.PathLike``) as a str, or a ValueError naming the argument."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"`{name}` must be a non-empty path or URL; found {path!r}.")
    return path


def check_run_id(run_id: object) -> str:
    """``run_id``, a name for a run's folder, or a ValueError."""
    if not isinstance(run_id, str) or not run_id or "/" in run_id or run_id in (".", ".."):
        raise ValueError(f"`run_id` must be a non-empty name without '/'; found {run_id!r}.")
    return run_id


def scheme_of(path: str) -> str:
    """The lower-case scheme of a URL (``dbfs:/x`` and ``file:/x`` included), '' for a path."""
    if path.startswith("dbfs:"):
        return "dbfs"
    if "://" in path:
        return urlparse(path).scheme.lower()
    if path.startswith("file:"):
        return "file"
    return ""


def temp_name(target: str) -> str:
    """A hidden, unique temporary beside ``target``: written whole, then renamed to it."""
    folder, name = posixpath.split(target)
    return posixpath.join(folder, f".{name}.{uuid.uuid4().hex[:12]}{TMP_SUFFIX}")


def local_files(local_dir: str) -> list[tuple[str, str]]:
    """(path, path relative to ``local_dir`` with '/') of every file under ``local_dir``."""
    found = []
    for root, _, files in os.walk(local_dir):
        for name in sorted(files):
            local = os.path.join(root, name)
            found.append((local, os.path.relpath(local, local_dir).replace(os.sep, "/")))
    return found
