"""``run``/``launch`` on whichever kind of SparkSession is active.

A classic session (with a ``SparkContext``) runs the ranks in an RDD barrier stage
(``rdd_stage``); a Spark Connect session, which has no ``SparkContext``, in the same barrier stage
launched through the DataFrame API (``dataframe_stage``). Both give the same results, output,
errors, retries and cancellation.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any, TypeAlias

from flyte_hvd.core.log import get_logger, warn_once
from flyte_hvd.core.types import UserValue
from flyte_hvd.launch.environment import driver_env
from flyte_hvd.stage import dataframe_stage, partition, pipeline, rdd_stage

if TYPE_CHECKING:
    import threading

    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.connect.session import SparkSession as ConnectSparkSession
    from typing_extensions import TypeIs

# A classic SparkSession or a Spark Connect one: the two share no base class.
AnySparkSession: TypeAlias = "SparkSession | ConnectSparkSession"

logger = get_logger(__name__)


def is_connect_session(spark: object) -> TypeIs[ConnectSparkSession]:
    """Whether ``spark`` is a Spark Connect session (no SparkContext, no py4j)."""
    module = sys.modules.get("pyspark.sql.connect.session")
    return module is not None and isinstance(spark, module.SparkSession)


def active_session() -> AnySparkSession:
    """The session ``run`` launches on: this thread's active Spark Connect session, else the
    active classic one, else (in a thread the user started) the classic session the builder
    made, else the default Connect session."""
    connect = sys.modules.get("pyspark.sql.connect.session")
    if connect is not None:
        session = connect.SparkSession.getActiveSession()
        if session is not None:
            return session
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        raise RuntimeError(
            "flyte_hvd.spark needs pyspark: install it (`pip install pyspark`)."
        ) from None
    session = SparkSession.getActiveSession()
    if session is None:  # another thread's session: the one the builder made, from any thread
        try:
            session = SparkSession.active()
        except Exception:  # pyspark's NO_ACTIVE_OR_DEFAULT_SESSION
            session = None
    if session is None and connect is not None:
        session = connect.SparkSession._get_default_session()
    if session is None:
        raise RuntimeError(
            "no active SparkSession: create one first (SparkSession.builder.getOrCreate(), "
            "or SparkSession.builder.remote('sc://host:15002').getOrCreate() for Spark "
            "Connect), or run without Spark through HorovodRunner(np=-N) or "
            "`flyte-hvd-run -np N`."
        )
    return session


# Spark assumes `spark.sql.defaultSizeInBytes` (Long.MaxValue, 8 EiB) for a plan it cannot
# size; no real estimate comes near.
_UNKNOWN_SIZE = 1 << 60


def estimated_bytes(df: DataFrame) -> int | None:
    """Spark's estimate of ``df``'s size in bytes: the optimizer's statistics of its plan, which
    adaptive execution and join planning go by (exact for a cached DataFrame; a filter keeps its
    input's size, so it errs high). None where the plan has no estimate."""
    if is_connect_session(df.sparkSession):
        size = dataframe_stage.estimated_bytes(df)
    else:
        size = int(df._jdf.queryExecution().optimizedPlan().stats().sizeInBytes())
    return None if size is None or size >= _UNKNOWN_SIZE else size


def task_slots(spark: AnySparkSession) -> int:
    """How many tasks the cluster of ``spark`` can run at once now."""
    if is_connect_session(spark):
        return dataframe_stage.task_slots(spark)
    return rdd_stage.task_slots(spark.sparkContext)


def default_parallelism(spark: AnySparkSession) -> int:
    """``spark.sparkContext.defaultParallelism``, on either kind of session."""
    if is_connect_session(spark):
        return dataframe_stage.default_parallelism(spark)
    return int(spark.sparkContext.defaultParallelism)


def run(
    fn: Callable[..., UserValue],
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,  # ``fn``'s keyword arguments
    num_proc: int | None = None,
    start_timeout: float | None = None,
    use_mpi: bool | None = None,
    use_gloo: bool | None = None,
    extra_mpi_args: str | None = None,
    env: dict[str, str] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    verbose: int = 1,
    nics: set[str] | list[str] | None = None,
    prefix_output_with_timestamp: bool = False,
    executable: str | None = None,
    max_result_bytes: int | None = None,
    data: DataFrame | None = None,
) -> list[UserValue]:
    """Run ``fn(*args, **kwargs)`` on ``num_proc`` ranks of the active SparkSession (classic
    or Spark Connect): one Spark barrier stage, one task per rank, one rank process per task.

    Args:
        fn: travels to the ranks with cloudpickle, so it may capture local variables.
        args: positional arguments of ``fn``.
        kwargs: keyword arguments of ``fn``.
        num_proc: number of ranks; defaults to ``spark.default.parallelism``.
        start_timeout: seconds for scheduling plus rendezvous; defaults to
            ``HOROVOD_SPARK_START_TIMEOUT``, then 600.
        use_mpi, use_gloo, extra_mpi_args, executable: Horovod's launcher choices, accepted
            and without effect (ranks run under MPICH, each under its own ``mpiexec -n 1``,
            with the Python of Spark's workers); each says so once.
        env: environment variables for the ranks; by default the driver's environment as it
            is at the call, less what describes the driver's own host (``PATH``, ``HOME``,
            ``PYTHONPATH``, ``JAVA_HOME``, ``SPARK_*``, ``CUDA_VISIBLE_DEVICES``, thread
            counts; see ``flyte_hvd.launch.environment.driver_env``), as Horovod's ``run``.
        stdout, stderr: where rank output goes on the driver (``sys.stdout``, ``sys.stderr``).
        verbose: the level of the launcher's own messages on the `flyte_hvd` logger: INFO
            when >= 1 (shown by default), DEBUG when 0.
        nics: network interfaces the ranks' MPI traffic uses (``{'eth0'}``).
        prefix_output_with_timestamp: prefix every rank line with the time it arrived.
        max_result_bytes: the largest pickled return value a rank may give back; above it
            the run fails, naming the rank and the size. Defaults to
            ``FLYTE_HVD_MAX_RESULT_BYTES``, then 2 GiB. A result above 1 MiB goes to the
            driver over the task's link into a temporary file, never through a JVM's heap.
        data: a DataFrame of the session, whose rows the ranks share with no Store: one
            partition per rank, balanced by rows (``flyte_hvd.spark.get_partition()``).

    Returns:
        Each rank's return value, in rank order.

    Raises:
        RanksFailedError: a rank raised or died, called ``sys.exit`` inside ``fn``, or
            returned a value that cannot be pickled or is above ``max_result_bytes``; the
            message names it and says why.

    Example:
        >>> from flyte_hvd.spark import run
        >>> def train(lr):
        ...     import flyte_hvd.core as hvd
        ...     hvd.init()
        ...     return hvd.rank(), lr * hvd.size()
        >>> run(train, args=(0.1,), num_proc=2)  # doctest: +SKIP
        [(0, 0.2), (1, 0.2)]
    """
    env = horovod_run_args(env, use_mpi, use_gloo, extra_mpi_args, nics, executable)
    return launch(
        fn,
        args,
        kwargs,
        num_proc=num_proc,
        start_timeout=start_timeout,
        env=env,
        stdout=stdout,
        stderr=stderr,
        verbose=verbose,
        prefix_output_with_timestamp=prefix_output_with_timestamp,
        max_result_bytes=max_result_bytes,
        data=data,
    ).results


def _warn_unused(name: str, meaning: str) -> None:
    """One warning per process for a Horovod argument that does nothing here."""
    warn_once(
        logger, f"run:{name}", f"`{name}` is accepted for Horovod compatibility and {meaning}"
    )


def horovod_run_args(
    env: dict[str, str] | None,
    use_mpi: bool | None = None,
    use_gloo: bool | None = None,
    extra_mpi_args: str | None = None,
    nics: set[str] | list[str] | None = None,
    executable: str | None = None,
) -> dict[str, str] | None:
    """Horovod's launcher arguments of ``run``: ``nics`` restricts the ranks' MPI traffic to
    those interfaces (``FI_TCP_IFACE`` for MPICH's libfabric TCP, ``UCX_NET_DEVICES`` for
    UCX), added to ``env``; the others do nothing here and say so once."""
    if use_mpi is not None or use_gloo is not None:
        _warn_unused("use_mpi/use_gloo", "does nothing: ranks always talk over MPICH")
    if extra_mpi_args:
        _warn_unused("extra_mpi_args", "does nothing: each rank runs under its own `mpiexec -n 1`")
    if executable is not None and executable != sys.executable:
        _warn_unused(
            "executable",
            "does nothing: ranks run the Python of Spark's workers "
            "(`spark.pyspark.python` / PYSPARK_PYTHON)",
        )
    if not nics:
        return env
    if isinstance(nics, str) or not all(isinstance(n, str) and n for n in nics):
        raise ValueError(
            f"`nics` must be a set of interface names, e.g. {{'eth0'}}; found {nics!r}."
        )
    names = sorted(nics)
    return {**(env or driver_env()), "FI_TCP_IFACE": names[0], "UCX_NET_DEVICES": ",".join(names)}


def backend_of(spark: AnySparkSession) -> pipeline.StageBackend:
    """The stage backend of a session of either kind."""
    if is_connect_session(spark):
        return dataframe_stage.ConnectBackend(spark)
    return rdd_stage.ClassicBackend(spark.sparkContext)


def launch(
    fn: Callable[..., UserValue],
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,  # ``fn``'s keyword arguments
    num_proc: int | None = None,
    start_timeout: float | None = None,
    env: dict[str, str] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    verbose: int = 1,
    prefix_output_with_timestamp: bool = False,
    preload: tuple[str, ...] = (),
    max_result_bytes: int | None = None,
    data: DataFrame | None = None,
) -> pipeline.RunReport:
    """``run``, returning the full ``RunReport`` (used by benchmarks and the estimators):
    each rank's result and start-up timeline. ``preload`` names modules that spare rank
    processes import ahead of the next run (``flyte_hvd.launch.spare``); the estimators pass
    their framework's."""
    spark = active_session()
    backend = backend_of(spark)
    if data is not None:
        data = partition.check_data(data, is_connect_session(spark))
    spec = pipeline.LaunchSpec.of(
        fn,
        args,
        kwargs,
        num_proc=num_proc,
        start_timeout=start_timeout,
        env=env,
        stdout=stdout,
        stderr=stderr,
        verbose=verbose,
        prefix_output_with_timestamp=prefix_output_with_timestamp,
        preload=preload,
        default_num_proc=backend.default_parallelism,
        max_result_bytes=max_result_bytes,
    )
    return pipeline.launch(spec, backend, data)


def check_slots(num_proc: int | None, start_timeout: float | None = None) -> None:
    """What a launch checks first, for callers with work to do before it (the estimators,
    before they prepare data and start spare ranks): the active session's cluster has
    ``num_proc`` free task slots, waiting up to the start timeout only while executors it
    asked for still register.

    Raises:
        RuntimeError: the cluster cannot hold the ranks (what to change is in the message).
    """
    backend = backend_of(active_session())
    count = pipeline.check_num_proc(backend.default_parallelism() if num_proc is None else num_proc)
    timeout = pipeline.start_timeout_of(start_timeout)
    backend.wait_for_slots(count, time.monotonic() + timeout, timeout)


def start_spares(
    num_proc: int, env: dict[str, str] | None, preload: tuple[str, ...], data: bool = False
) -> threading.Thread | None:
    """Spare rank processes started ahead of a run: for a run given ``data`` (a DataFrame
    stage) on either kind of session (``dataframe_stage.start_spares``), otherwise on a
    classic session (``rdd_stage.start_spares``); nothing for a Spark Connect run without
    data, whose ranks start as usual."""
    spark = active_session()
    if data:
        return dataframe_stage.start_spares(spark, num_proc, env, preload)  # type: ignore[arg-type]
    if is_connect_session(spark):
        return None
    return rdd_stage.start_spares(spark.sparkContext, num_proc, env, preload)
