"""A rank's share of the DataFrame its run was given (``run(fn, data=df)``), with no Store.

The barrier stage runs over ``df`` itself, repartitioned to one partition per rank (balanced
by rows): each Spark task receives its partition as Arrow batches, writes them to a file in
a private folder of its executor's scratch space before its rank starts, and removes the
folder when the rank has ended. The rank reads the file memory-mapped (``get_partition``): the rows
cross from Spark to the rank once, through the local disk's page cache.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

from flyte_hvd.launch.rendezvous import PARTITION_ENV

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame

_FOLDER_PREFIX = "flyte-hvd-partition-"


def check_data(data: Any, connect: bool) -> DataFrame:
    """``run``'s ``data``: a DataFrame of the session the run launches on."""
    kind = "Spark Connect" if connect else "classic"
    expected: type
    if connect:
        from pyspark.sql.connect.dataframe import DataFrame as expected
    else:
        from pyspark.sql.classic.dataframe import DataFrame as expected
    if not isinstance(data, expected):
        raise ValueError(
            f"`data` must be a Spark DataFrame of the active {kind} session, whose rows the "
            f"ranks share; found {type(data).__module__}.{type(data).__name__}. Build it with "
            f"that session (e.g. `spark.read.parquet(...)`) or leave `data` out."
        )
    return cast("DataFrame", data)


def arrow_schema(df: DataFrame) -> bytes:
    """``df``'s schema as Arrow sees it in ``mapInArrow`` (vectors as structs), serialized:
    what a rank with no rows gets as its partition's columns."""
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(df.schema).serialize().to_pybytes()


@contextlib.contextmanager
def spilled(batches: Iterator[pa.RecordBatch], schema: bytes) -> Iterator[tuple[str, int]]:
    """``batches`` written to an Arrow file in a private temporary folder, removed after the
    block whatever happens; yields the file's path and its number of rows."""
    import pyarrow as pa

    folder = tempfile.mkdtemp(prefix=_FOLDER_PREFIX, dir=_scratch_folder())
    try:
        path = os.path.join(folder, "partition.arrow")
        rows = 0
        with pa.OSFile(path, "wb") as sink:
            writer = None
            for batch in batches:
                if writer is None:
                    writer = pa.ipc.new_file(sink, batch.schema)
                writer.write_batch(batch)
                rows += batch.num_rows
            if writer is None:  # no rows here: the DataFrame's columns, empty
                writer = pa.ipc.new_file(sink, pa.ipc.read_schema(pa.py_buffer(schema)))
            writer.close()
        yield path, rows
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _scratch_folder() -> str | None:
    """The executor's scratch space (``spark.local.dir``, which Spark hands its Python
    workers as ``SPARK_LOCAL_DIRS``), else None: the temporary folder."""
    folders = [f for f in os.environ.get("SPARK_LOCAL_DIRS", "").split(",") if os.path.isdir(f)]
    return folders[0] if folders else None


def partition_folder() -> str:
    """Inside a rank of ``run(fn, data=df)``: the private folder of its partition's file, where
    the rank may keep files of its own until it ends (its task removes the folder then)."""
    return os.path.dirname(_partition_path())


def get_partition() -> pa.Table:
    """Inside a rank of ``run(fn, data=df)``: this rank's rows of ``df`` as a pyarrow Table
    (memory-mapped from its task's local file; vector columns as Arrow structs). Every rank
    has a partition of its own, balanced by rows; a rank may have none when ``df`` has
    fewer rows than there are ranks (its table then has the columns and no rows).

    Raises:
        RuntimeError: called outside a rank of a run given ``data``.
    """
    import pyarrow as pa

    return pa.ipc.open_file(pa.memory_map(_partition_path())).read_all()


def _partition_path() -> str:
    path = os.environ.get(PARTITION_ENV)
    if not path:
        raise RuntimeError(
            "`get_partition()` found no partition: it returns a rank's share of the DataFrame "
            "given to `run(fn, data=df)`, and this process is not a rank of such a run. Pass "
            "the DataFrame as `data`, or read the data from a Store."
        )
    return path
