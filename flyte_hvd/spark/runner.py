"""What runs ranks in a Spark barrier stage, whatever the session: the checks of a launch's
arguments, the barrier task, the driver's verdict when a rank fails; and a classic session's
backend (``ClassicBackend``: an RDD barrier stage).

The driver checks that the cluster can hold the stage (free slots, no dynamic allocation)
before submitting, so a job that cannot start fails in seconds with what to change, not after
Horovod's 600 s "Timed out waiting for Spark tasks". Each barrier task then supervises one rank
process (``flyte_hvd.launch.supervisor``); the ranks meet, and their output and failures come
back to the driver over a ``DriverLink``, and the driver raises one error naming the failing
rank with its traceback. ``pipeline.launch`` puts these together.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, overload

import cloudpickle

from flyte_hvd.core.errors import RanksFailedError
from flyte_hvd.core.log import get_logger
from flyte_hvd.core.types import UserValue
from flyte_hvd.launch import failures as failure_kinds
from flyte_hvd.launch.environment import (
    DRIVER_VERSION_ENV,
    driver_env,
    local_driver_env,
    version_mismatch,
)
from flyte_hvd.launch.job import FunctionJob
from flyte_hvd.launch.supervisor import first_failure, killed_by_signal

if TYPE_CHECKING:
    from pyspark import SparkContext, TaskContext

    from flyte_hvd.spark.driver_link import DriverLink, DriverServer


class _Settings(Protocol):
    @overload
    def get(self, key: str, /) -> str | None: ...
    @overload
    def get(self, key: str, default: str, /) -> str: ...

    def getAll(self) -> list[tuple[str, str]]: ...


class ClusterConf(Protocol):
    """What the preflight helpers read of a cluster: a ``SparkContext``, or a Connect
    session's ``dataframe_stage.SessionConf``."""

    @property
    def master(self) -> str | None: ...

    def getConf(self) -> _Settings: ...


# A barrier task: given its partition (unused: the task knows its rank), it yields its rank's
# ``(rank, pickled result)``.
BarrierTask: TypeAlias = Callable[[object], Iterator[tuple[int, bytes]]]

logger = get_logger(__name__)

# Inside a rank: the accelerator addresses Spark assigned to its task, comma-separated.
DEVICES_ENV = "FLYTE_HVD_SPARK_DEVICES"
_SLOT_POLL_S = 1.0


@dataclass
class RunReport:
    """What one ``run`` produced: results by rank and each rank's start-up timeline."""

    results: list[UserValue]
    submitted_at: float
    events: dict[int, dict[str, float]] = field(default_factory=dict)


def check_num_proc(num_proc: object) -> int:
    if isinstance(num_proc, bool) or not isinstance(num_proc, int):
        raise ValueError(f"`num_proc` must be an int >= 1; found {num_proc!r}.")
    if num_proc < 1:
        raise ValueError(f"`num_proc` must be >= 1; found {num_proc}.")
    return num_proc


def pickle_job(
    fn: Callable[..., UserValue],
    args: tuple,
    kwargs: dict[str, Any] | None,  # ``fn``'s keyword arguments
) -> bytes:
    if not callable(fn):
        raise ValueError(f"`fn` must be callable; found {type(fn).__name__}.")
    if not isinstance(args, tuple | list):
        raise ValueError(f"`args` must be a tuple; found {type(args).__name__}.")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ValueError(f"`kwargs` must be a dict; found {type(kwargs).__name__}.")
    try:
        return cloudpickle.dumps(FunctionJob(fn, tuple(args), dict(kwargs or {})))
    except Exception as error:
        raise ValueError(
            f"`fn` or its arguments cannot be pickled ({type(error).__name__}: {error}); they "
            f"travel to the ranks with cloudpickle. Create objects such as locks, sockets, "
            f"sessions or open files inside `fn` instead of capturing them."
        ) from error


def check_env(env: dict[str, str] | None) -> dict[str, str]:
    env = dict(env or {})
    bad = {k: v for k, v in env.items() if not isinstance(k, str) or not isinstance(v, str)}
    if bad:
        raise ValueError(f"`env` must map str to str; found {bad!r}.")
    return env


def ranks_env(master: str, num_proc: int, env: dict[str, str] | None) -> dict[str, str]:
    """What the ranks' environment takes from the driver: ``env`` when given, else the
    driver's environment as it is now (``driver_env``, as Horovod's ``run`` defaults ``env``
    to ``os.environ``), with a local master's settings (``local_driver_env``) between the
    two."""
    inherited = driver_env() if env is None else {}
    return {**inherited, **local_driver_env(master, num_proc), **check_env(env)}


# -- preflight -------------------------------------------------------------------------------


def task_slots(sc: SparkContext) -> int:
    """How many tasks of the default resource profile the cluster can run at once now
    (what Spark's own barrier check counts: cores and accelerators per executor)."""
    jsc = sc._jsc.sc()
    profile = jsc.resourceProfileManager().defaultResourceProfile()
    return int(jsc.maxNumConcurrentTasks(profile))


def expected_executors(sc: ClusterConf) -> int | None:
    """Executors the application asked for but may not have yet (None in local mode)."""
    master = _master(sc)
    cluster = re.match(r"local-cluster\[\s*(\d+)\s*,", master)
    if cluster:
        return int(cluster.group(1))
    if is_local(master):
        return None
    raw = sc.getConf().get("spark.executor.instances")
    return int(raw) if raw else None


def _master(sc: ClusterConf) -> str:
    # pyspark declares ``SparkContext.master`` optional; a running context always has one.
    return str(sc.master)


def is_local(master: str) -> bool:
    """``local``/``local[N]``/``local[N,F]``: tasks run in the driver JVM."""
    return master == "local" or master.startswith("local[")


def stage_failure(
    server: DriverServer, num_proc: int, error: BaseException | None = None
) -> Exception:
    """The error a failed barrier stage raises on the driver: the ranks' own reports when
    any rank sent one (or the stall watch stopped the run), else what Spark said."""
    failures = dict([server.stuck]) if server.stuck else server.latest_failures()
    if failures:
        first = first_failure(failures)
        return RanksFailedError(
            failures,
            summary=f"rank {first} failed; the Spark barrier stage was stopped",
            output_log=server.output_file(),
        )
    return RuntimeError(
        f"the Spark barrier stage of {num_proc} ranks failed before any rank reported an "
        f"error (an executor was lost, or the stage was cancelled): "
        f"{'no result' if error is None else _first_line(error)}"
    )


# How long the driver waits, after a rank's error on the last attempt, for its peers' reports
# before it stops the stage: a rank the kernel killed is reported by its task as soon as that
# task sees the exit, but its peers' "connection closed" errors can arrive first.
PEER_REPORT_GRACE_S = 2.0


def on_rank_failure(
    max_attempts: int, cancel: Callable[[], None], grace: float = PEER_REPORT_GRACE_S
) -> Callable[[int, int, str], bool]:
    """What the driver does when a rank fails in attempt ``attempts_started``: after the last
    attempt, or at once for a failure no retry can fix (an exception of the user's code,
    ``flyte_hvd.launch.failures``), it cancels the stage (a barrier stage is otherwise
    retried) and returns True (the run ends here); before that it says once per attempt that
    Spark retries the stage.

    The cancel is immediate when a signal killed the rank (that is the cause), else ``grace``
    seconds later, so that the error names the rank that died rather than the peer that
    noticed it first."""
    told: set[int] = set()
    timers: list[threading.Timer] = []

    def cancel_quietly() -> None:  # a timer may fire after the session went away
        try:
            cancel()
        except Exception as error:
            logger.debug("cancelling the stage: %s", error)

    def handle(attempts_started: int, rank: int, traceback: str) -> bool:
        # An exception of the user's code (``failures``) fails the same way on every attempt:
        # the run ends at its first, and a signal's death or a lost store gets Spark's retry.
        user_error = not failure_kinds.classify_text(traceback).recoverable
        if attempts_started >= max_attempts or user_error:
            if killed_by_signal(traceback) or grace <= 0:
                cancel()
            elif not timers:
                timers.append(threading.Timer(grace, cancel_quietly))
                timers[0].daemon = True
                timers[0].start()
            return True
        if attempts_started not in told:
            told.add(attempts_started)
            logger.warning(
                "rank %d failed (%s); Spark retries the stage (attempt %d of %d)",
                rank,
                _last_line(traceback),
                attempts_started + 1,
                max_attempts,
            )
        return False

    return handle


def _registered_executors(sc: SparkContext) -> int:
    return max(0, int(sc._jsc.sc().getExecutorMemoryStatus().size()) - 1)  # minus the driver


def wait_for_slots(sc: SparkContext, num_proc: int, deadline: float, timeout: float) -> None:
    """Fail fast when the stage can never be scheduled; wait (up to the deadline) only while
    executors the application asked for are still registering."""
    conf = sc.getConf()
    if conf.get("spark.dynamicAllocation.enabled", "false").lower() == "true":
        raise RuntimeError(
            "Spark barrier stages cannot run with dynamic allocation: set "
            f"spark.dynamicAllocation.enabled=false and spark.executor.instances so the "
            f"cluster has {num_proc} task slots."
        )
    while True:
        slots = task_slots(sc)
        if slots >= num_proc:
            return
        expected = expected_executors(sc)
        registered = _registered_executors(sc)
        coming = expected is not None and registered < expected
        if not coming or time.monotonic() >= deadline:
            raise RuntimeError(slots_message(sc, num_proc, slots, registered, coming, timeout))
        time.sleep(_SLOT_POLL_S)


def slots_message(
    sc: ClusterConf,
    num_proc: int,
    slots: int,
    registered: int,
    waited: bool,
    timeout: float,
) -> str:
    """Why ``num_proc`` ranks do not fit the cluster's ``slots`` free task slots, and what to
    change (a classic session's check, and Spark Connect's)."""
    conf = sc.getConf()
    master = _master(sc)
    task_cpus = conf.get("spark.task.cpus", "1")
    where = (
        f"master {master}"
        if is_local(master)
        else f"{registered} executor(s) x spark.executor.cores="
        f"{conf.get('spark.executor.cores', '?')}"
    )
    also = f" after waiting {timeout:g}s for executors to register" if waited else ""
    return (
        f"`num_proc`={num_proc} but the cluster has {slots} free task slot(s) ({where}, "
        f"spark.task.cpus={task_cpus}){also}. Lower `num_proc`, or add task slots: "
        + (
            f"a master of local[{num_proc}]."
            if is_local(master)
            else "more executors (spark.executor.instances) or cores (spark.executor.cores)."
        )
        + (_pending_hint(conf) if waited else "")
    )


_NODE_SELECTOR_PREFIXES = (
    "spark.kubernetes.executor.node.selector.",
    "spark.kubernetes.node.selector.",
)


def _pending_hint(conf: _Settings) -> str:
    """Why executors that never register may be Pending pods: the node selectors they carry,
    and how to change or remove one."""
    selectors = sorted(
        (key, value) for key, value in conf.getAll() if key.startswith(_NODE_SELECTOR_PREFIXES)
    )
    if not selectors:
        return ""
    labels = ", ".join(
        f"{key.partition('.node.selector.')[2]}={value} ({key})" for key, value in selectors
    )
    return (
        f" Executor pods that never register may be Pending on their node selector: {labels}. "
        f"If no schedulable node carries that label (`kubectl get nodes --show-labels`), set "
        f"the label your nodes have, or remove the setting with `spark_conf={{key: None}}` "
        f"(HorovodSpark) or by leaving it out of the Spark settings."
    )


def stage_attempts(sc: ClusterConf) -> int:
    """How many times a failed stage may run: ``spark.task.maxFailures`` (Spark's default 4),
    or F of a ``local[N,F]`` master (1 for plain ``local[N]``)."""
    master = _master(sc)
    if is_local(master):
        match = re.match(r"local\[[^,\]]+,\s*(\d+)\]", master)
        return int(match.group(1)) if match else 1
    return max(1, int(sc.getConf().get("spark.task.maxFailures", "4")))


# -- the barrier task ------------------------------------------------------------------------


def _task_rank_env(env: dict[str, str], ctx: TaskContext) -> dict[str, str]:
    """The run's rank environment as this Spark task gives it to its rank: the worker's
    import path and the task's GPUs added."""
    rank_env = dict(env)
    rank_env["PYTHONPATH"] = _worker_import_path(rank_env.get("PYTHONPATH"))
    gpus = ctx.resources().get("gpu")
    if gpus is not None and gpus.addresses:
        rank_env[DEVICES_ENV] = ",".join(gpus.addresses)
        rank_env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus.addresses)
    return rank_env


def start_spares(
    sc: SparkContext, num_proc: int, env: dict[str, str] | None, preload: tuple[str, ...]
) -> threading.Thread | None:
    """Starts, in a background thread, a short Spark job of ``num_proc`` tasks that each
    start a spare rank process importing ``preload`` in their Python worker, unless one is
    idle there (``flyte_hvd.launch.spare``). An estimator calls it once ``prepare_data`` has
    checked the data, before Spark writes it: the ranks' framework imports then run during
    the write, and the barrier tasks that follow in those workers hand their ranks to the
    spares (Spark gives a task the Python worker idle longest; in a new session these are
    the only ones). A task that lands in another worker starts its rank as usual; the spare
    left idle exits with its worker or after ``FLYTE_HVD_SPARE_IDLE_S``. Returns the thread
    (None when spares are off); failures are logged, never raised: the run does not depend
    on it."""
    from flyte_hvd.launch import spare

    if not preload or not spare.enabled():
        return None
    master = str(sc.master)
    rank_env = ranks_env(master, num_proc, env)
    task = _spare_task(rank_env, tuple(preload), is_local(master))

    def submit() -> None:
        try:
            sc.setLocalProperty("spark.job.description", "flyte-hvd: spare rank processes")
            started = sc.parallelize(range(num_proc), num_proc).mapPartitions(task).sum()
            logger.debug("started %d spare rank process(es) ahead of the run", started)
        except Exception as error:  # e.g. the session stopped: the run starts its own ranks
            logger.debug("no spare rank processes ahead of the run: %s", _first_line(error))

    thread = threading.Thread(target=submit, name="flyte-hvd-spares", daemon=True)
    thread.start()
    return thread


def _spare_task(
    rank_env: dict[str, str], preload: tuple[str, ...], single_host: bool
) -> Callable[[object], Iterator[int]]:
    def task(_: object) -> Iterator[int]:
        from pyspark import TaskContext

        from flyte_hvd.launch.supervisor import start_spare_ahead

        ctx = TaskContext.get()
        assert ctx is not None  # inside a Spark task
        env = _task_rank_env(rank_env, ctx)
        yield int(start_spare_ahead(env, preload, single_host))

    return task


# How long a failed run waits for its stage's cancelled tasks to report their end.
SETTLE_TIMEOUT_S = 5.0


class ClassicBackend:
    """A classic session's barrier stage (``pipeline.StageBackend``): an RDD stage, task slots
    from the scheduler, cancelled by job tag."""

    label = ""

    def __init__(self, sc: SparkContext):
        self.sc = sc
        self.master = str(sc.master)

    def default_parallelism(self) -> int:
        return int(self.sc.defaultParallelism)

    def wait_for_slots(self, num_proc: int, deadline: float, timeout: float) -> None:
        wait_for_slots(self.sc, num_proc, deadline, timeout)

    def stage_attempts(self) -> int:
        return stage_attempts(self.sc)

    def link_host(self) -> str:
        """Loopback when every task runs on this host (``local``, ``local[N]``,
        ``local-cluster``), whatever ``spark.driver.host`` says: there it is the host's
        external address, and nothing beyond the host needs the link. Else the driver's
        address, where executors reach the driver."""
        if is_local(self.master) or self.master.startswith("local-cluster["):
            return "127.0.0.1"
        return self.sc.getConf().get("spark.driver.host") or "127.0.0.1"

    def run_stage(
        self, task: BarrierTask, num_proc: int, retried: bool, tag: str
    ) -> list[tuple[int, bytes]]:
        self.sc.addJobTag(tag)
        try:
            rdd = self.sc.parallelize(range(num_proc), num_proc).barrier().mapPartitions(task)
            if retried:
                # Spark retries a failed barrier stage only when it feeds a shuffle (a failed
                # barrier result stage is aborted); the driver stops it after the last attempt.
                rdd = rdd.partitionBy(1)
            return sorted(rdd.collect())
        finally:
            self.sc.removeJobTag(tag)

    def cancel(self, tag: str) -> None:
        self.sc.cancelJobsWithTag(tag)

    def settle(self, tag: str, timeout: float = SETTLE_TIMEOUT_S) -> None:
        """Waits until the stages of the jobs tagged ``tag`` have no running task (at most
        ``timeout``): a cancelled task reports its end after the job failed, and a
        SparkContext stopped meanwhile (a script's ``spark.stop()`` right after our error)
        logs a Java stack for it."""
        tracker = self.sc._jsc.sc().statusTracker()
        deadline = time.monotonic() + timeout
        try:
            stages = [
                stage
                for job in tracker.getJobIdsForTag(tag)
                for stage in (
                    tracker.getJobInfo(job).get().stageIds()
                    if tracker.getJobInfo(job).isDefined()
                    else []
                )
            ]
            while time.monotonic() < deadline:
                infos = [tracker.getStageInfo(stage) for stage in stages]
                if not any(i.isDefined() and i.get().numActiveTasks() > 0 for i in infos):
                    return
                time.sleep(0.05)
        except Exception as error:  # py4j or a stopped context: nothing to wait for
            logger.debug("waiting for the stage's tasks to end: %s", error)


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else "no message"


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


# What a barrier task yields instead of its rank's result when the driver has ended the run.
RUN_FAILED = b"flyte-hvd: the run failed"
# A pickled result above this many bytes goes to the driver over the task's link, into a file,
# and the task yields this prefix and the id the driver keeps it under instead: a result that
# travels with the stage passes whole through the JVMs' heaps (a few hundred MB per rank
# killed a local driver JVM, and the user's SparkSession with it).
INLINE_RESULT_BYTES = 1 << 20
RESULT_ON_LINK = b"flyte-hvd: result kept by the driver as "


def barrier_task(
    job: bytes,
    num_proc: int,
    secret: str,
    driver_address: tuple[str, int],
    env: dict[str, str],
    start_timeout: float,
    single_host: bool = False,
    preload: tuple[str, ...] = (),
) -> BarrierTask:
    """The closure each barrier task runs: plain values only, no driver objects."""

    def task(_: object) -> Iterator[tuple[int, bytes]]:
        from pyspark import BarrierTaskContext

        from flyte_hvd.launch.stall import ForwardWatch
        from flyte_hvd.launch.supervisor import RankSupervisor
        from flyte_hvd.spark.driver_link import DriverLink

        ctx = BarrierTaskContext.get()
        rank = ctx.partitionId()
        link = DriverLink(driver_address, secret, rank)
        link.event("task_started")
        mismatch = version_mismatch(env.get(DRIVER_VERSION_ENV), f"the executor of rank {rank}")
        if mismatch:
            if link.failed(mismatch):  # the driver ends the run and raises it
                link.close()
                yield rank, RUN_FAILED
                return
            link.close()
            raise RuntimeError(mismatch)
        rank_env = _task_rank_env(env, ctx)
        # "host:port" of the task's executor as the driver reaches it: rank 0's host part is
        # MASTER_ADDR when the ranks span hosts (``launch.torch_env``).
        address = ctx.getTaskInfos()[rank].address.rpartition(":")[0]
        supervisor = RankSupervisor(
            job,
            ranks=[rank],
            size=num_proc,
            exchange=_DriverExchange(link),
            secret=secret,
            start_timeout=max(start_timeout, 1.0),
            env=rank_env,
            output=link.output,
            watch=ForwardWatch(link.forward),
            single_host=single_host,  # a local[N] master: nothing listens beyond loopback
            preload=preload,
            address=address,
            read_result=lambda _, path: _task_result(link, path),
        )
        # Spark stops a cancelled Python task only by killing its worker, seconds later; the
        # driver closing the link stops the ranks at once.
        link.on_lost = lambda: supervisor.cancel("the Spark driver ended the run")
        try:
            results = supervisor.run()
        except Exception as error:
            report = (
                error.failures.get(rank, str(error))
                if isinstance(error, RanksFailedError)
                else f"{type(error).__name__}: {error}"
            )
            if link.failed(report):
                # The driver ends the run here and raises the ranks' errors itself: end the
                # task without failing it (Spark would log a Java stack for each failed task).
                yield rank, RUN_FAILED
                return
            if isinstance(error, RanksFailedError):  # Spark retries the stage
                raise RuntimeError(f"flyte-hvd rank {rank} failed:\n{error}") from None
            raise
        finally:
            for name, at in supervisor.timings().get(rank, {}).items():
                link.event(name, at)
            link.close()
        yield rank, results[rank]

    return task


def _task_result(link: DriverLink, path: str) -> bytes:
    """What a barrier task yields for its rank's pickled result, the file at ``path``: the
    pickle itself when small, else the id under which the driver keeps it, sent over
    ``link``."""
    if os.path.getsize(path) <= INLINE_RESULT_BYTES:
        with open(path, "rb") as f:
            return f.read()
    return RESULT_ON_LINK + link.send_result(path).encode()


def load_result(server: DriverServer, payload: bytes) -> UserValue:
    """On the driver: a rank's result from what its task yielded (see ``_task_result``)."""
    if not payload.startswith(RESULT_ON_LINK):
        return cloudpickle.loads(payload)
    path = server.result_path(payload[len(RESULT_ON_LINK) :].decode())
    try:
        with open(path, "rb") as f:
            return cloudpickle.load(f)
    finally:
        os.remove(path)


def _worker_import_path(extra: str | None) -> str:
    """This Python worker's import path for the rank process: it includes what Spark added
    with ``addPyFile`` (e.g. the code a Flyte task was fast-registered with), which the
    worker's PYTHONPATH does not name, so the rank can import what the task's code imports.
    The interpreter's own folders are left out: the rank's interpreter finds them itself."""
    own = tuple(os.path.abspath(p) for p in {sys.prefix, sys.base_prefix, sys.exec_prefix})
    paths = [p for p in (extra or "").split(os.pathsep) if p]
    for entry in sys.path:
        path = os.path.abspath(entry) if entry else ""
        if path and not path.startswith(own) and path not in paths and os.path.exists(path):
            paths.append(path)
    return os.pathsep.join(paths)


class _DriverExchange:
    """Rendezvous rounds through the driver link (authenticated by the run's secret), not
    ``BarrierTaskContext.allGather``, which costs a second a call (see ``driver_link``)."""

    def __init__(self, link: DriverLink):
        self._link = link
        self._rounds = 0
        self._aborted = threading.Event()

    def all_gather(self, rank: int, value: str) -> list[str]:
        round_, self._rounds = self._rounds, self._rounds + 1
        return self._link.all_gather(round_, value, self._aborted)

    def abort(self) -> None:
        self._aborted.set()


def get_available_devices() -> list[str]:
    """Inside a rank: the accelerator addresses Spark assigned to its task (e.g. ``['0']``);
    empty when none were assigned or outside Spark."""
    raw = os.environ.get(DEVICES_ENV, "")
    return [a for a in raw.split(",") if a]
