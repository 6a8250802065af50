"""Ranks in a barrier stage launched through the DataFrame API: the launch path for Spark Connect.

A Spark Connect session has no ``SparkContext``, RDDs or py4j, so ``run`` cannot build its
barrier stage with ``rdd.barrier().mapPartitions``. The same stage is reachable through the
DataFrame API: ``spark.range(0, n, numPartitions=n).mapInArrow(task, schema, barrier=True)``;
inside, ``BarrierTaskContext`` (``partitionId``, ``resources``) works as in an RDD
stage, so each task supervises one rank exactly as on a classic session. What differs is
around the stage:

- results come back as rows: each rank's pickled return value, cut into chunks small enough
  for Connect's Arrow batches, reassembled in rank order on the client;
- the free task slots are counted from what a Connect session can read (the session's
  configuration, and the parallelism the server plans a ``range`` with), not from the
  scheduler through py4j;
- the stage is cancelled through the session's operation tags (``addTag``/``interruptTag``);
- rank output comes back over the same ``DriverLink`` as on a classic session, to a server on
  the client host, at the address through which the client reaches the Connect server.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, overload

from flyte_hvd.core.log import get_logger
from flyte_hvd.stage import partition, pipeline, rank_task

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, Row
    from pyspark.sql.connect.session import SparkSession

logger = get_logger(__name__)

# Rows of at most this many bytes: Connect ships results in Arrow batches of at most
# `spark.connect.grpc.arrow.maxBatchSize` (4 MiB by default); a row must fit in one.
CHUNK_BYTES = 1 << 20
_SCHEMA = "rank int, chunk int, data binary"
_SLOT_POLL_S = 1.0


class SessionConf:
    """A Connect session's settings, read once (one round trip), with the two members of
    ``SparkContext`` that the pipeline's cluster checks read: ``master`` and
    ``getConf().get``."""

    def __init__(self, spark: SparkSession):
        self._conf: dict[str, str] = dict(spark.conf.getAll)
        self.master = self._conf.get("spark.master", "")

    def getConf(self) -> SessionConf:
        return self

    @overload
    def get(self, key: str, /) -> str | None: ...

    @overload
    def get(self, key: str, default: str, /) -> str: ...

    def get(self, key: str, default: str | None = None) -> str | None:
        return self._conf.get(key, default)

    def getAll(self) -> list[tuple[str, str]]:
        return list(self._conf.items())


def default_parallelism(spark: SparkSession) -> int:
    """The cluster's default parallelism as the server plans it: the number of splits of a
    ``range`` without ``numPartitions`` (an analysis round trip, no job). Spark sets it to the
    cores of the executors registered now (the N of ``local[N]``), unless
    ``spark.default.parallelism`` overrides it."""
    # A private method that pyspark's annotations do not declare (so a Column to mypy).
    plan = spark.range(0, 1 << 30)._explain_string(extended=False)  # type: ignore[operator]
    match = re.search(r"splits=(\d+)", plan)
    if match is None:
        raise RuntimeError(
            f"cannot count the cluster's task slots: the plan of `spark.range` names no "
            f"splits ({plan.strip()[:200]!r}); pass `num_proc` explicitly."
        )
    return int(match.group(1))


_BYTE_UNITS = {"B": 0, "KiB": 10, "MiB": 20, "GiB": 30, "TiB": 40, "PiB": 50, "EiB": 60}


def estimated_bytes(df: DataFrame) -> int | None:
    """The optimizer's size estimate of ``df``'s plan, read from its cost explanation (one
    analysis round trip, no job): the root's ``Statistics(sizeInBytes=209.8 MiB, ...)``, in
    Spark's rounded units. None when the explanation gives none."""
    plan = df._explain_string(mode="cost")  # type: ignore[operator]  # as above
    match = re.search(r"Statistics\(sizeInBytes=([0-9.]+(?:E[+-]?[0-9]+)?) ?([KMGTPE]iB|B)\b", plan)
    if match is None:
        return None
    return int(float(match.group(1)) * (1 << _BYTE_UNITS[match.group(2)]))


def task_slots(spark: SparkSession, conf: SessionConf | None = None) -> int:
    """How many tasks the cluster can run at once now, as far as a Connect session can tell:
    executor cores (the default parallelism) over ``spark.task.cpus``, and, when tasks ask
    for GPUs, no more than the executors' GPUs allow."""
    conf = conf or SessionConf(spark)
    if conf.get("spark.default.parallelism") is not None and not pipeline.is_local(conf.master):
        # The planned parallelism is the setting, not the cores; count from the executors.
        cores = _int(conf, "spark.executor.instances", 0) * _int(conf, "spark.executor.cores", 1)
    else:
        cores = default_parallelism(spark)
    slots = cores // max(1, _int(conf, "spark.task.cpus", 1))
    task_gpus = float(conf.get("spark.task.resource.gpu.amount") or 0)
    executors = _int(conf, "spark.executor.instances", 0)
    if task_gpus > 0 and executors and not pipeline.is_local(conf.master):
        per_executor = _int(conf, "spark.executor.resource.gpu.amount", 0)
        slots = min(slots, executors * int(per_executor // task_gpus))
    return slots


def _int(conf: SessionConf, key: str, default: int) -> int:
    raw = conf.get(key)
    try:
        return int(raw) if raw else default
    except ValueError:
        return default


def wait_for_slots(
    spark: SparkSession, conf: SessionConf, num_proc: int, deadline: float, timeout: float
) -> None:
    """``rdd_stage.wait_for_slots`` for a Connect session: fail fast when the stage can never be
    scheduled (Spark itself would retry the barrier check for minutes); wait only while
    executors the application asked for may still be registering."""
    if (conf.get("spark.dynamicAllocation.enabled") or "false").lower() == "true":
        raise RuntimeError(
            "Spark barrier stages cannot run with dynamic allocation: set "
            f"spark.dynamicAllocation.enabled=false and spark.executor.instances so the "
            f"cluster has {num_proc} task slots."
        )
    expected = pipeline.expected_executors(conf)
    while True:
        slots = task_slots(spark, conf)
        if slots >= num_proc:
            return
        per_executor = max(1, _int(conf, "spark.executor.cores", 1))
        registered = default_parallelism(spark) // per_executor
        coming = expected is not None and registered < expected
        if not coming or time.monotonic() >= deadline:
            raise RuntimeError(
                pipeline.slots_message(conf, num_proc, slots, registered, coming, timeout)
            )
        time.sleep(_SLOT_POLL_S)


def link_host(spark: SparkSession) -> str:
    """The address of this (client) host that the cluster can reach: the one the client
    uses to reach the Connect server. The server's ``spark.driver.host`` names the driver's
    host, which is not the client's when the client runs elsewhere."""
    endpoint = spark.client._builder.endpoint  # type: ignore[attr-defined]  # "host:port", undeclared
    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")
    if host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((host, int(port)))  # UDP: picks the route, sends nothing
        return str(probe.getsockname()[0])
    except OSError:
        return socket.gethostbyname(socket.gethostname())
    finally:
        probe.close()


def stage_task(
    task: rank_task.BarrierTask, data_schema: bytes | None = None
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """Wraps a barrier task (``rank_task.barrier_task``) as a ``mapInArrow`` function: its
    ``(rank, payload)`` comes back as rows of ``CHUNK_BYTES``-sized chunks. With
    ``data_schema`` (a run given ``data``), the input batches are the rank's partition: they
    go to a local file first (``partition.spilled``), which the rank reads."""

    def run_rank(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        if data_schema is None:
            for _ in batches:  # the one input row: the partition index, which the task knows
                pass
            yield from as_rows(task(None))
            return
        with partition.spilled(batches, data_schema) as (path, _):
            yield from as_rows(task(path))

    return run_rank


def as_rows(results: Iterator[tuple[int, bytes]]) -> Iterator[pa.RecordBatch]:
    """A barrier task's ``(rank, payload)`` as Arrow rows of ``CHUNK_BYTES``-sized chunks."""
    import pyarrow as pa

    schema = pa.schema([("rank", pa.int32()), ("chunk", pa.int32()), ("data", pa.binary())])
    for rank, payload in results:
        chunks = [payload[i : i + CHUNK_BYTES] for i in range(0, len(payload), CHUNK_BYTES)]
        for index, chunk in enumerate(chunks or [b""]):
            yield pa.RecordBatch.from_pydict(
                {"rank": [rank], "chunk": [index], "data": [chunk]}, schema=schema
            )


def run_dataframe_stage(
    source: DataFrame, task: rank_task.BarrierTask, retried: bool, data_schema: bytes | None
) -> list[tuple[int, bytes]]:
    """``task`` in a barrier stage over ``source``'s partitions, one task per partition
    (with ``data_schema``: each gets its partition's rows); each rank's ``(rank, payload)``."""
    stage = source.mapInArrow(stage_task(task, data_schema), _SCHEMA, barrier=True)
    if retried:
        # As on the RDD path: a barrier stage is retried only when it feeds a shuffle.
        stage = stage.repartition(1)
    return join_chunks(stage.collect())


def run_data_stage(
    data: DataFrame, num_proc: int, task: rank_task.BarrierTask, retried: bool
) -> list[tuple[int, bytes]]:
    """``task`` in a barrier stage over ``data``, one partition per rank (balanced by rows),
    each task's partition written for its rank (``partition``); on either kind of session."""
    schema = partition.arrow_schema(data)
    return run_dataframe_stage(data.repartition(num_proc), task, retried, schema)


def start_spares(
    spark: SparkSession, num_proc: int, env: dict[str, str] | None, preload: tuple[str, ...]
) -> threading.Thread | None:
    """Spare rank processes for a DataFrame barrier stage (``pipeline.start_spares``): a
    short ``mapInArrow`` job, so that they start in the Python workers that run the stage's
    Arrow tasks (measured: an RDD job's workers are other processes). On either kind of
    session."""

    def submit(task: rank_task.SpareTask) -> int:
        def started(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
            import pyarrow as pa

            for _ in batches:
                pass
            yield pa.RecordBatch.from_pydict({"started": [sum(task(None))]})

        job = spark.range(0, num_proc, numPartitions=num_proc).mapInArrow(started, "started long")
        return sum(row.started for row in job.collect())

    master = str(spark.conf.get("spark.master", "") or "")
    return pipeline.start_spares(master, num_proc, env, preload, submit)


def join_chunks(rows: list[Row]) -> list[tuple[int, bytes]]:
    """``(rank, payload)`` per rank, in rank order, from the stage's rows."""
    parts: dict[int, list[tuple[int, bytes]]] = {}
    for row in rows:
        parts.setdefault(int(row["rank"]), []).append((int(row["chunk"]), bytes(row["data"])))
    return [(rank, b"".join(c for _, c in sorted(parts[rank]))) for rank in sorted(parts)]


class ConnectBackend:
    """A Spark Connect session's barrier stage (``pipeline.StageBackend``): a DataFrame stage
    (``mapInArrow(barrier=True)``), task slots from the session's settings, results as rows,
    cancelled by operation tag."""

    label = " (DataFrame API)"

    def __init__(self, spark: SparkSession):
        self.spark = spark
        self.conf = SessionConf(spark)
        self.master = self.conf.master

    def default_parallelism(self) -> int:
        return default_parallelism(self.spark)

    def wait_for_slots(self, num_proc: int, deadline: float, timeout: float) -> None:
        wait_for_slots(self.spark, self.conf, num_proc, deadline, timeout)

    def stage_attempts(self) -> int:
        return pipeline.stage_attempts(self.conf)

    def link_host(self) -> str:
        return link_host(self.spark)

    def run_stage(
        self,
        task: rank_task.BarrierTask,
        num_proc: int,
        retried: bool,
        tag: str,
        data: DataFrame | None = None,
    ) -> list[tuple[int, bytes]]:
        self.spark.addTag(tag)
        try:
            if data is not None:
                return run_data_stage(data, num_proc, task, retried)
            source = self.spark.range(0, num_proc, 1, num_proc)
            return run_dataframe_stage(source, task, retried, None)
        finally:
            self.spark.removeTag(tag)

    def cancel(self, tag: str) -> None:
        self.spark.interruptTag(tag)

    def settle(self, tag: str) -> None:
        """Nothing to wait for: the server's SparkContext is not the client's to stop."""
