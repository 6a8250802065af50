"""Opening the Parquet files of a prepared dataset through any filesystem (pyarrow's own or
an fsspec one): what the Store, the metadata reader and the loaders share."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    import fsspec
    import pyarrow.dataset as ds
    import pyarrow.fs as pafs

# What the readers accept: a pyarrow filesystem, or an fsspec one (wrapped for pyarrow).
FileSystem: TypeAlias = "pafs.FileSystem | fsspec.AbstractFileSystem"

# The JSON sidecar ``prepare_data`` writes inside each dataset's folder (``dataset``).
METADATA_FILENAME = "_flyte_hvd_metadata.json"


def open_parquet_dataset(filesystem: FileSystem, path: str) -> ds.Dataset:
    """A ``pyarrow.dataset.Dataset`` of the Parquet files under ``path``, files sorted by path
    (or of the one file ``path`` names).

    Hidden and ``_``-prefixed files (``_SUCCESS``, ``.crc``, the sidecar) are skipped; when
    some files end in ``.parquet``, only those are read, so stray files do not break reading.

    Raises:
        ValueError: ``path`` is missing or holds no files.
    """
    import pyarrow.dataset as ds
    import pyarrow.fs as pafs

    fs = as_arrow_filesystem(filesystem)
    if fs.get_file_info(path).type == pafs.FileType.File:  # one file, not a folder of them
        return ds.dataset([path], filesystem=fs, format="parquet")
    try:
        infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
    except (FileNotFoundError, OSError) as error:
        raise ValueError(
            f"no Parquet dataset at `{path}` ({error}); prepare the data first or fix the path."
        ) from error
    files = sorted(
        i.path
        for i in infos
        if i.type == pafs.FileType.File
        and not any(part.startswith((".", "_")) for part in i.path[len(path) :].split("/"))
    )
    parquet = [f for f in files if f.endswith(".parquet")]
    if not files:
        raise ValueError(
            f"no Parquet files under `{path}`; prepare the data first or fix the path."
        )
    return ds.dataset(parquet or files, filesystem=fs, format="parquet")


def as_arrow_filesystem(filesystem: FileSystem) -> pafs.FileSystem:
    """A pyarrow filesystem for ``filesystem`` (pyarrow's own, or fsspec's wrapped)."""
    import fsspec
    import pyarrow.fs as pafs
    from fsspec.implementations.arrow import ArrowFSWrapper
    from fsspec.implementations.local import LocalFileSystem

    if isinstance(filesystem, pafs.FileSystem):
        return filesystem
    if isinstance(filesystem, LocalFileSystem):
        return pafs.LocalFileSystem()
    if isinstance(filesystem, ArrowFSWrapper):
        return filesystem.fs
    if isinstance(filesystem, fsspec.AbstractFileSystem):
        return pafs.PyFileSystem(pafs.FSSpecHandler(filesystem))
    raise ValueError(
        f"`filesystem` must be a pyarrow or fsspec filesystem; found {type(filesystem).__name__}."
    )
