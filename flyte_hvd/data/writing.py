"""How ``prepare_data`` writes a split: by Spark itself when the cluster can reach the
store's URL, otherwise by each task uploading its files through the store's fsspec
filesystem; either way as files of equal row counts, in Spark jobs that an interrupt
(Ctrl-C) cancels before it goes on.

pyspark is imported only inside the functions that run Spark jobs.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

import pyarrow as pa

from flyte_hvd.core.log import get_logger
from flyte_hvd.data.columns import quoted
from flyte_hvd.data.dataset import (
    FIELD_METADATA_KEY,
    VECTOR_KINDS,
    ColumnInfo,
    arrow_storage_schema,
    encode_batch,
)
from flyte_hvd.data.store import Store, bounded
from flyte_hvd.launch.environment import local_storage_env

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.connect.session import SparkSession as ConnectSparkSession

# A classic SparkSession or a Spark Connect one: the two share no base class.
AnySparkSession: TypeAlias = "SparkSession | ConnectSparkSession"

logger = get_logger(__name__)
T = TypeVar("T")  # what a Spark action returns

# Data per write task, as Spark's own split size (spark.sql.files.maxPartitionBytes): a small
# split is written by few tasks, each writing several files, since every task and every
# committed file costs tens of milliseconds whatever its size (measured: 200k rows in 20 files
# by 2 tasks take three quarters of the time 20 tasks take).
WRITE_TASK_BYTES = 128 << 20
# How long an interrupted write may take to end its Spark jobs (and Spark its cleanup) before
# the interrupt goes on regardless.
CANCEL_WAIT_S = 60.0


def write_tasks(rows: int, infos: list[ColumnInfo], num_processes: int, files: int) -> int:
    """Spark tasks for writing ``rows``: one per ``WRITE_TASK_BYTES`` of decoded data, at
    least one per rank and at most one per file."""
    import math

    import numpy as np

    row_bytes = sum(math.prod(i.shape) * np.dtype(i.dtype).itemsize for i in infos)
    return max(num_processes, min(files, -(-rows * row_bytes // WRITE_TASK_BYTES)))


def write_split(
    part: DataFrame, store: Store, path: str, infos: list[ColumnInfo], rows_per_file: int
) -> None:
    """Spark writes straight to the store's URL when its cluster can reach it; otherwise each
    task writes its partition to local files and uploads them through the store's fsspec.
    Either way a file holds at most ``rows_per_file`` rows."""
    spark = part.sparkSession
    url = store.spark_url(path)
    if spark_can_write(spark, url):
        from pyspark.sql import functions as F

        if any(i.encoding == "sparse" for i in infos):
            part = part.mapInArrow(_EncodeTask(infos), _spark_storage_ddl(infos))
            cols = [F.col(quoted(i.name)) for i in infos]
        else:
            from pyspark.ml.functions import vector_to_array

            cols = [
                vector_to_array(F.col(quoted(i.name)), "float64")
                if i.kind in VECTOR_KINDS
                else F.col(quoted(i.name))
                for i in infos
            ]
        part = part.select(
            *[
                col.alias(i.name, metadata={FIELD_METADATA_KEY: i.to_dict()})
                for col, i in zip(cols, infos, strict=True)
            ]
        )
        writer = part.write.mode("overwrite").option("compression", "snappy")
        for leaf, floating in _leaf_paths(infos).items():
            if floating:
                writer = writer.option(f"parquet.enable.dictionary#{leaf}", "false")
        writer = writer.option("maxRecordsPerFile", rows_per_file)
        cancellable(spark, lambda: writer.parquet(url))
        return
    task = _StagedWriteTask(store, path, infos, local_storage_env(_master(spark)), rows_per_file)
    written = cancellable(spark, part.mapInArrow(task, "file string, rows long").collect)
    expected = {r["file"] for r in written}
    found = bounded(store, ("listing", "in"), path, 0, store.fs.find, store.fs_path(path))
    for stray in set(found) - expected:  # from retried tasks
        if stray.endswith(".parquet"):
            bounded(store, ("deleting", "from"), stray, 0, store.fs.rm, stray)


def cancellable(spark: AnySparkSession, action: Callable[[], T]) -> T:
    """``action()``, Spark jobs (the checks, a write), in a thread of its own whose jobs carry
    a tag of their own. When the waiting thread is interrupted (Ctrl-C), the jobs with that
    tag are cancelled, those the action starts meanwhile too, until the action has ended (up
    to ``CANCEL_WAIT_S``); then the interrupt goes on. An interrupted call would otherwise go
    on in the JVM (a job it had not started yet is not cancelled, and Spark's cleanup of a
    cancelled write comes after): the next prepare would write beside it, and the two remove
    each other's ``_temporary`` folder."""
    tag = f"flyte-hvd-prepare-{uuid.uuid4().hex[:12]}"
    outcome: dict[str, Any] = {}
    done = threading.Event()

    def call() -> None:
        spark.addTag(tag)
        try:
            outcome["value"] = action()
        except BaseException as error:
            outcome["error"] = error
        finally:
            spark.removeTag(tag)
            done.set()

    threading.Thread(target=call, name="flyte-hvd-prepare", daemon=True).start()
    try:
        done.wait()
    except BaseException:
        deadline = time.monotonic() + CANCEL_WAIT_S
        while not done.is_set() and time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                spark.interruptTag(tag)
            done.wait(0.2)
        if not done.is_set():
            logger.warning(
                "the interrupted Spark jobs of prepare_data did not end within %gs; they (tag "
                "%s) may still be running",
                CANCEL_WAIT_S,
                tag,
            )
        raise
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]  # type: ignore[no-any-return]  # the action's own result


def _leaf_paths(infos: list[ColumnInfo]) -> dict[str, bool]:
    """Each stored Parquet leaf column's path, and whether it holds floating-point values.

    Those are written without dictionary encoding: measured values rarely repeat, so the
    writers build each column chunk's dictionary only to give it up (a third of a 200 k-row
    write's time). Integer and boolean columns (class labels, ids) keep it."""
    import numpy as np

    leaves = {}
    for i in infos:
        floating = np.dtype(i.dtype).kind in "fc"
        if i.encoding == "sparse":
            leaves[f"{i.name}.indices.list.element"] = False
            leaves[f"{i.name}.values.list.element"] = floating
        else:
            leaves[i.name if i.encoding == "plain" else f"{i.name}.list.element"] = floating
    return leaves


def _master(spark: AnySparkSession) -> str:
    """The master URL of a classic or a Spark Connect session (``spark.conf`` works on both;
    ``sparkContext`` does not exist on Connect)."""
    return str(spark.conf.get("spark.master", "") or "")


def spark_can_write(spark: AnySparkSession, url: str) -> bool:
    """Whether the cluster has a Hadoop FileSystem for ``url``: its scheme names a class,
    and that class answers for ``url`` (a scheme can be mapped to a class whose own client
    is missing, e.g. S3A without its AWS SDK, or a view with no mount for this bucket)."""
    scheme = url.split(":", 1)[0] if ":" in url else "file"
    try:
        jvm: Any = spark._jvm  # py4j's JVM view: untyped (pyspark declares it Optional)
        conf = spark._jsc.hadoopConfiguration()
        jvm.org.apache.hadoop.fs.FileSystem.getFileSystemClass(scheme, conf)
        path = jvm.org.apache.hadoop.fs.Path(url)
        path.getFileSystem(conf).exists(path)
        return True
    except AttributeError:  # Spark Connect: no JVM to ask
        return scheme in ("file", "hdfs", "dbfs")
    except Exception:
        return False


def _spark_storage_ddl(infos: list[ColumnInfo]) -> str:
    spark_types = {
        "bool": "boolean",
        "int8": "tinyint",
        "int16": "smallint",
        "int32": "int",
        "int64": "bigint",
        "float32": "float",
        "float64": "double",
    }
    parts = []
    for i in infos:
        t = spark_types[i.dtype]
        if i.encoding == "list":
            t = f"array<{t}>"
        elif i.encoding == "sparse":
            t = f"struct<indices: array<int>, values: array<{t}>>"
        parts.append(f"{quoted(i.name)} {t}")
    return ", ".join(parts)


class _EncodeTask:
    def __init__(self, infos: list[ColumnInfo]):
        self.infos = infos

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            yield encode_batch(batch, self.infos)


class _StagedWriteTask:
    """Writes one Spark partition to local Parquet files of at most ``rows_per_file`` rows and
    uploads each (one atomic PUT) as ``part-<partition>-<n>.parquet``: a retried task
    overwrites its own files (the repartition gives it the same rows again)."""

    def __init__(
        self,
        store: Store,
        path: str,
        infos: list[ColumnInfo],
        env: dict[str, str],
        rows_per_file: int,
    ):
        self.store = store
        self.path = path
        self.infos = infos
        self.env = env  # the driver's storage settings, for a local master's workers
        self.rows_per_file = rows_per_file

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        assert ctx is not None  # always set inside a Spark task
        pid = ctx.partitionId()
        files: list[str] = []
        counts: list[int] = []
        pending: list[pa.RecordBatch] = []
        rows = 0
        with tempfile.TemporaryDirectory(prefix="flyte-hvd-stage-") as tmp:
            for batch in batches:
                while batch.num_rows:
                    take = min(batch.num_rows, self.rows_per_file - rows)
                    pending.append(batch.slice(0, take))
                    batch, rows = batch.slice(take), rows + take
                    if rows == self.rows_per_file:
                        files.append(self._upload(tmp, pid, len(files), pending))
                        counts.append(rows)
                        pending, rows = [], 0
            if rows:
                files.append(self._upload(tmp, pid, len(files), pending))
                counts.append(rows)
        if files:
            yield pa.RecordBatch.from_pydict({"file": files, "rows": counts})

    def _upload(self, tmp: str, pid: int, n: int, batches: list[pa.RecordBatch]) -> str:
        import pyarrow.parquet as pq

        local = os.path.join(tmp, "part.parquet")
        dictionary = [leaf for leaf, floating in _leaf_paths(self.infos).items() if not floating]
        with pq.ParquetWriter(
            local, arrow_storage_schema(self.infos), compression="snappy", use_dictionary=dictionary
        ) as w:
            for batch in batches:
                w.write_batch(encode_batch(batch, self.infos))
        remote = self.store.join(self.path, f"part-{pid:05d}-{n:04d}.parquet")
        os.environ.update(self.env)
        size = os.path.getsize(local)  # within the store's timeout, as the ranks' uploads
        bounded(
            self.store, ("uploading", "to"), remote, size, self.store.upload_file, local, remote
        )
        return self.store.fs_path(remote)
