"""``prepare_data``: a Spark DataFrame to Parquet in the Store, for the ranks to read.

One Spark aggregation checks the selected columns in the JVM (rows, nulls, NaN labels, vector
and array lengths, sparse or dense; ``flyte_hvd.data.statistics``), so bad data fails before
anything is written; then each split is written as about ``num_processes *
partitions_per_process`` files of equal row counts (``flyte_hvd.data.writing``). The
arguments are checked against the DataFrame's columns first (``flyte_hvd.data.columns``);
the validation split is ``flyte_hvd.data.split``'s. The format is in
``flyte_hvd.data.dataset``. Each write has folders of its own and holds a lease in the store
while it runs (``flyte_hvd.data.lease``); the next prepare removes the folders of a write whose
lease went stale (its driver was killed mid-write).

pyspark is imported only inside the functions that run Spark jobs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import secrets
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from flyte_hvd.core.log import get_logger, verbosity_level
from flyte_hvd.core.types import JSONObject
from flyte_hvd.data.columns import (
    Selection,
    check_count,
    check_exist,
    check_spark_dataframe,
    column_names,
    quoted,
    select_columns,
    spark_kind,
)
from flyte_hvd.data.dataset import (
    FORMAT,
    METADATA_FILENAME,
    VECTOR_KINDS,
    ColumnInfo,
    DatasetMetadata,
    get_dataset_metadata,
    read_metadata,
    scan_parquet,
)
from flyte_hvd.data.lease import (
    LEASE_SECONDS,
    StoreLease,
    current_attempt,
    read_lease,
    stale,
)
from flyte_hvd.data.parquet import as_arrow_filesystem
from flyte_hvd.data.split import (
    SPLIT_COL,
    SPLIT_SEED,
    split_part,
    train_val_split,
    validation_flag,
)
from flyte_hvd.data.statistics import Stats, check_split_rows, inspect_columns, split_rows
from flyte_hvd.data.store import Store, bounded
from flyte_hvd.data.writing import (
    CANCEL_WAIT_S,
    WRITE_TASK_BYTES,
    cancellable,
    write_split,
    write_tasks,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

logger = get_logger(__name__)

# A write's lease, beside its train folder: ``intermediate_train_data.<idx>.lease.json``.
_WRITE_LEASE = ".lease.json"

__all__ = [
    "CANCEL_WAIT_S",
    "SPLIT_SEED",
    "WRITE_TASK_BYTES",
    "ColumnInfo",
    "DatasetMetadata",
    "check_spark_dataframe",
    "dataframe_metadata",
    "get_dataset_metadata",
    "prepare_data",
    "read_metadata",
    "stream_data",
    "train_val_split",
    "validation_flag",
]

# -- prepare_data ----------------------------------------------------------------------------


@contextlib.contextmanager
def prepare_data(
    num_processes: int,
    store: Store,
    df: DataFrame,
    label_columns: Sequence[str],
    feature_columns: Sequence[str] | None = None,
    validation: float | str | None = None,
    sample_weight_col: str | None = None,
    compress_sparse: bool = False,
    partitions_per_process: int = 10,
    verbose: int = 0,
    allow_non_finite_features: bool = False,
    on_checked: Callable[[], object] | None = None,
) -> Iterator[str]:
    """Write ``df``'s selected columns to Parquet in ``store``; yields the dataset index.

    ``with prepare_data(2, store, df, ["y"]) as idx:`` then
    ``get_dataset_metadata(store, idx)`` and loaders over ``store.get_train_data_path(idx)``.
    The data stays in the store after the block, and preparing the same DataFrame (same plan,
    schema, columns and options) again reuses it.

    Args:
        num_processes: ranks that will read the data; each split gets at least this many
            Parquet files so that every rank has a shard.
        label_columns: the label columns to keep.
        feature_columns: the feature columns to keep (default: every column that is not a
            label, the sample weight or the validation column).
        validation: a float in (0, 1) for a seeded random split, or the name of a column
            whose true/non-zero rows go to validation (the column is not stored).
        sample_weight_col: a numeric column of per-row weights.
        compress_sparse: store vector columns whose rows are all sparse as (indices, values).
        partitions_per_process: Parquet files per process and split.
        verbose: 1 logs what was written or reused at INFO (0: at DEBUG).
        allow_non_finite_features: keep NaN and infinity in feature columns (refused by
            default: they make the loss NaN without a word).
        on_checked: called once the data passed its checks, just before Spark writes it
            (not when a prepared dataset is reused); the estimators start rank processes
            then, so that their imports run during the write.

    Raises:
        ValueError: bad arguments or data: a missing column, an unsupported type, no rows,
            an empty split, a null, or NaN or infinity in any column (a NaN makes the loss
            NaN and ruins every weight after one step, so it is refused here).
        RuntimeError: the data could not be written (nothing half-written is kept).

    Example:
        >>> from flyte_hvd.data import Store, get_dataset_metadata, prepare_data
        >>> store = Store.create(work_dir)  # a path, or s3://bucket/exp, hdfs://..., dbfs:/...
        >>> with prepare_data(2, store, df, label_columns=["y"], validation=0.2) as idx:
        ...     train_meta, val_meta = get_dataset_metadata(store, idx)  # doctest: +SKIP
        >>> train_meta.rows + val_meta.rows == df.count()  # doctest: +SKIP
        True
    """
    check_count("num_processes", num_processes)
    check_count("partitions_per_process", partitions_per_process)
    _check_store(store)
    check_spark_dataframe(df, "`df`")
    columns = select_columns(df, label_columns, feature_columns, validation, sample_weight_col)
    options = _options(
        columns, num_processes, partitions_per_process, compress_sparse, allow_non_finite_features
    )
    key = _dataset_key(df, options)
    job = _Job(
        store=store,
        columns=columns,
        num_processes=num_processes,
        files=num_processes * partitions_per_process,
        key=key,
        idx=key[:16],
        level=verbosity_level(verbose),
    )
    idx = _prepare(job, df, allow_non_finite_features, compress_sparse, on_checked)
    _prepared_stores[idx] = store
    yield idx


def _check_store(store: object) -> None:
    if not isinstance(store, Store):
        raise ValueError(
            f"`store` must be a flyte_hvd Store (Store.create(prefix_path)); "
            f"found {type(store).__name__}."
        )


def _options(
    columns: Selection,
    num_processes: int,
    partitions_per_process: int,
    compress_sparse: bool,
    allow_non_finite_features: bool,
) -> JSONObject:
    """The options that, with the DataFrame, make a prepared dataset (its key)."""
    options: JSONObject = {
        "features": columns.features,
        "labels": columns.labels,
        "weight": columns.weight,
        "validation": columns.validation,
        "compress_sparse": bool(compress_sparse),
        "num_processes": num_processes,
        "partitions_per_process": partitions_per_process,
    }
    if allow_non_finite_features:
        options["allow_non_finite_features"] = True
    return options


@dataclasses.dataclass(frozen=True)
class _Job:
    """What one ``prepare_data`` call writes, and where."""

    store: Store
    columns: Selection
    num_processes: int
    files: int  # Parquet files per split
    key: str  # of the DataFrame and the options: a dataset with the same key is reused
    idx: str  # the dataset index: the key's start, then the write's own token
    level: int  # logging level of what is written or reused

    @property
    def paths(self) -> dict[str, str]:
        """Each split's folder in the store: "train", and "val" with a validation split."""
        paths = {"train": self.store.get_train_data_path(self.idx)}
        if self.columns.validation is not None:
            paths["val"] = self.store.get_val_data_path(self.idx)
        return paths


def _prepare(
    job: _Job,
    df: DataFrame,
    allow_non_finite_features: bool,
    compress_sparse: bool,
    on_checked: Callable[[], object] | None,
) -> str:
    """Checks ``df``'s data and writes it, unless the store holds this dataset already;
    returns the dataset's index."""
    found = _prepared(job)
    if found is not None:
        logger.log(job.level, f"reusing prepared dataset {found.idx} at {found.paths['train']}")
        return found.idx
    sel, stats, infos = _checked_selection(
        df, job.columns, allow_non_finite_features, compress_sparse
    )
    check_split_rows(stats, job.columns.validation, job.num_processes)
    if on_checked is not None:
        on_checked()
    # Folders of this write's own: fits of the same data at once on one store (two nodes of
    # an execution, a sweep) each write theirs, and none replaces files another one reads.
    job = dataclasses.replace(job, idx=f"{job.idx}-{secrets.token_hex(4)}")
    # Its lease tells another prepare whether the write still runs: a driver killed mid-write
    # (a preempted pod) leaves folders no one reads, which the next prepare removes.
    # The name is this write's own, so the lease is free; were it not, the check before the
    # sidecars (``held``) fails the write.
    lease = StoreLease(job.store, _write_lease_path(job.store, job.idx), f"dataset `{job.idx}`")
    lease.try_acquire()
    try:
        _write(job, sel, stats, infos, lease)
    finally:
        lease.release()
    return job.idx


def _write_lease_path(store: Store, idx: str) -> str:
    """The lease of the write of dataset ``idx``: beside its train folder."""
    return store.get_train_data_path(idx) + _WRITE_LEASE


def _prepared(job: _Job) -> _Job | None:
    """``job`` at a complete dataset of its key in the store, if there is one: at one of the
    key's writes (``<idx>-<token>``), or at the key's start alone (as datasets were written
    before writes had folders of their own). Removes the folders of dead writes on the way."""
    store = job.store
    parent, name = store.get_train_data_path().rsplit("/", 1)
    own = f"{name}.{job.idx}"

    def listing() -> list[str]:
        folder = store.fs_path(parent)
        store.fs.invalidate_cache(folder)  # another process may have written one since
        try:
            return [p.rstrip("/").rsplit("/", 1)[-1] for p in store.fs.ls(folder, detail=False)]
        except FileNotFoundError:
            return []

    names = bounded(store, ("listing", "in"), parent, 0, listing)
    leases = sorted(n for n in names if n.startswith(f"{name}.") and n.endswith(_WRITE_LEASE))
    _remove_dead_writes(store, [n[len(name) + 1 : -len(_WRITE_LEASE)] for n in leases])
    datasets = (n for n in names if not n.endswith(_WRITE_LEASE))
    for folder in sorted(n for n in datasets if n == own or n.startswith(f"{own}-")):
        candidate = dataclasses.replace(job, idx=folder[len(name) + 1 :])
        if _complete(store, candidate.paths, job.key):
            return candidate
    return None


def _checked_selection(
    df: DataFrame, columns: Selection, allow_non_finite_features: bool, compress_sparse: bool
) -> tuple[DataFrame, Stats, list[ColumnInfo]]:
    """The stored columns of ``df`` (with the split flag when there is a validation split),
    their statistics and column records, from one Spark aggregation that refuses data a model
    cannot take."""
    from pyspark.sql import functions as F

    cols = [F.col(quoted(c)) for c in columns.stored]
    if columns.validation is not None:
        cols.append(validation_flag(columns.validation).alias(SPLIT_COL))
    sel = df.select(*cols)
    checked = {*columns.labels, *columns.weights}
    if not allow_non_finite_features:
        checked |= set(columns.features)
    stats, infos = cancellable(
        sel.sparkSession,
        lambda: inspect_columns(
            sel,
            columns.kinds,
            checked,
            columns.validation is not None,
            set(columns.features),
            compress_sparse,
        ),
    )
    return sel, stats, infos


def _remove_dead_writes(store: Store, leased: list[str]) -> None:
    """Removes the datasets among ``leased`` (indexes whose write holds a lease) whose write
    ended without finishing: its lease is stale (``flyte_hvd.data.lease``), also at once where
    an earlier attempt of this Flyte task held it."""
    attempt = current_attempt() if leased else None
    for idx in leased:
        path = _write_lease_path(store, idx)
        lease = read_lease(store, path)
        why = None if lease is None else stale(lease, attempt)  # None: gone since the listing
        if why is None:
            continue  # a write in progress, or one that ended since
        folders = [store.get_train_data_path(idx), store.get_val_data_path(idx)]
        for folder in [*folders, path]:  # the lease last: a removal cut short is redone
            bounded(store, ("deleting", "from"), folder, 0, store.delete, folder)
        logger.warning(
            "removed dataset %s, a write that did not finish (%s): its lease `%s` %s",
            idx,
            ", ".join(f"`{f}`" for f in folders),
            path,
            why,
        )


def _write(
    job: _Job, sel: DataFrame, stats: Stats, infos: list[ColumnInfo], lease: StoreLease
) -> None:
    """Each split, then the metadata sidecars that mark them complete, while ``lease`` is
    this write's; nothing is kept of a write that fails."""
    store, paths = job.store, job.paths
    try:
        written = {
            split: _write_one(job, split, path, sel, stats, infos) for split, path in paths.items()
        }
        if not lease.held():
            raise RuntimeError(
                f"the write of dataset {job.idx} lost its lease `{lease.path}`: the store did "
                f"not answer its renewals for {LEASE_SECONDS:g}s, so another prepare took the "
                f"write for a dead one and may have removed its files. Nothing of it is kept; "
                f"fit again."
            )
        for split, path in paths.items():  # the sidecars mark the splits complete
            sidecar = store.join(path, METADATA_FILENAME)
            text = written[split].to_json()
            bounded(store, ("writing", "to"), sidecar, 0, store.write_text, sidecar, text)
    except BaseException:
        for path in paths.values():
            with contextlib.suppress(Exception):
                store.delete(path)
        raise
    for split, meta in written.items():
        logger.log(job.level, f"{split}: {meta.rows} rows, {meta.files} files, {meta.bytes} bytes")


def _write_one(
    job: _Job, split: str, path: str, sel: DataFrame, stats: Stats, infos: list[ColumnInfo]
) -> DatasetMetadata:
    """Writes ``split`` to ``path`` and returns its metadata, read back from the files."""
    store, columns = job.store, job.columns
    rows = split_rows(stats, split, columns.validation)
    tasks = write_tasks(rows, infos, job.num_processes, job.files)
    part = split_part(sel, split, columns.validation).repartition(tasks)
    logger.log(job.level, f"writing the {split} split to {path} ({tasks} tasks)")
    write_split(part, store, path, infos, rows_per_file=max(1, -(-rows // job.files)))
    filesystem = as_arrow_filesystem(store.arrow_filesystem)
    meta = bounded(
        store,
        ("reading", "from"),
        path,
        0,
        scan_parquet,
        filesystem,
        store.fs_path(path),
        tuple(infos),
    )
    _check_rows_per_process(split, meta.rows, job.num_processes)
    return DatasetMetadata(
        columns=tuple(infos),
        rows=meta.rows,
        bytes=meta.bytes,
        files=meta.files,
        row_groups=meta.row_groups,
        dataset_idx=job.idx,
        split=split,
        key=job.key,
        label_columns=tuple(columns.labels),
        feature_columns=tuple(columns.features),
        sample_weight_col=columns.weight,
    )


def _check_rows_per_process(split: str, rows: int, num_processes: int) -> None:
    if rows < num_processes:
        raise ValueError(
            f"the {split} split has {rows} rows, fewer than `num_processes`="
            f"{num_processes}; every process needs rows. Use more data, fewer "
            f"processes, or a different `validation`."
        )


# -- streaming: the same checks, nothing written ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class Streamed:
    """A DataFrame checked as ``prepare_data`` checks it, for the ranks to receive straight
    from Spark (``run(fn, data=streamed.df)``) rather than from Parquet in a Store."""

    df: DataFrame  # the stored columns (vectors as arrays), and SPLIT_COL with a validation
    metadata: tuple[DatasetMetadata, DatasetMetadata | None]  # train, validation (or None)


def stream_data(
    num_processes: int,
    df: DataFrame,
    label_columns: Sequence[str],
    feature_columns: Sequence[str] | None = None,
    validation: float | str | None = None,
    sample_weight_col: str | None = None,
    compress_sparse: bool = False,
    allow_non_finite_features: bool = False,
    on_checked: Callable[[], object] | None = None,
) -> Streamed:
    """``prepare_data``'s arguments, checks and metadata without the write: one Spark
    aggregation refuses bad data (with ``prepare_data``'s messages) and counts each split's
    rows; the returned DataFrame is what the ranks then receive, a partition each, with the
    validation flag for ``data.loader.partition_splits`` to split by.

    Raises:
        ValueError: as ``prepare_data``.
    """
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F

    check_count("num_processes", num_processes)
    check_spark_dataframe(df, "`df`")
    columns = select_columns(df, label_columns, feature_columns, validation, sample_weight_col)
    sel, stats, infos = _checked_selection(df, columns, allow_non_finite_features, compress_sparse)
    check_split_rows(stats, columns.validation, num_processes)
    splits = ["train"] if columns.validation is None else ["train", "val"]
    metadata = {}
    for split in splits:
        rows = split_rows(stats, split, columns.validation)
        _check_rows_per_process(split, rows, num_processes)
        metadata[split] = DatasetMetadata(
            columns=tuple(infos),
            rows=rows,
            bytes=0,
            files=0,
            row_groups=0,
            split=split,
            label_columns=tuple(columns.labels),
            feature_columns=tuple(columns.features),
            sample_weight_col=columns.weight,
        )
    if on_checked is not None:
        on_checked()
    # Dense vectors cross to the ranks as arrays: the JVM writes Spark's vector struct to
    # Arrow several times slower than it runs vector_to_array (see `estimators.base`).
    dense = {i.name for i in infos if i.kind in VECTOR_KINDS and i.encoding == "list"}
    stage = sel.select(
        *[
            vector_to_array(F.col(quoted(c)), "float64").alias(c)
            if c in dense
            else F.col(quoted(c))
            for c in sel.columns
        ]
    )
    return Streamed(df=stage, metadata=(metadata["train"], metadata.get("val")))


def dataframe_metadata(
    df: DataFrame, columns: Sequence[str] | None = None, compress_sparse: bool = False
) -> DatasetMetadata:
    """What ``prepare_data`` records of ``df``'s columns (all of them by default), without
    writing anything: each column's kind, numpy dtype and per-row shape, and the row count,
    from one Spark aggregation. The estimators' models take it as their ``metadata``, and
    ``check_shape_compatibility`` checks model shapes against it.

    Raises:
        ValueError: a missing column, or one a model cannot take: an unsupported type, nulls,
            NaN or infinity, arrays or vectors of different lengths in different rows.
    """
    from pyspark.sql import functions as F

    names = list(df.columns) if columns is None else column_names("columns", columns)
    check_exist("columns", names, list(df.columns))
    types = {f.name: f.dataType for f in df.schema.fields}
    kinds = {c: spark_kind(c, types[c]) for c in names}
    sel = df.select(*[F.col(quoted(c)) for c in names])
    stats, infos = inspect_columns(sel, kinds, set(names), False, set(), compress_sparse)
    return DatasetMetadata(columns=tuple(infos), rows=stats["rows"], bytes=0, files=0, row_groups=0)


# The store each dataset this process prepared went to, by index: Horovod's helpers for
# direct-Parquet training (``get_dataset_properties(idx)``) take only the index.
_prepared_stores: dict[str, Store] = {}


def prepared_store(dataset_idx: str) -> Store:
    """The store ``prepare_data`` wrote ``dataset_idx`` to in this process."""
    try:
        return _prepared_stores[dataset_idx]
    except KeyError:
        known = sorted(_prepared_stores) or "none"
        raise ValueError(
            f"dataset {dataset_idx!r} was not prepared by this process (prepared: {known}); "
            f"pass its `store`, or prepare it first with prepare_data."
        ) from None


def forget_prepared() -> None:
    """Forget which datasets this process prepared; their data stays in the store."""
    _prepared_stores.clear()


def _dataset_key(df: DataFrame, options: JSONObject) -> str:
    try:
        files = sorted(df.inputFiles())
    except Exception:
        files = []
    blob = json.dumps(
        {
            "format": FORMAT,
            "plan": df.semanticHash(),
            "schema": df.schema.json(),
            "input_files": files,
            **options,
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def _complete(store: Store, paths: dict[str, str], key: str) -> bool:
    for path in paths.values():
        sidecar = store.join(path, METADATA_FILENAME)
        try:
            text = bounded(store, ("reading", "from"), sidecar, 0, store.read_text, sidecar)
            if DatasetMetadata.from_json(text).key != key:
                return False
        except (FileNotFoundError, ValueError, KeyError):
            return False
    return True
