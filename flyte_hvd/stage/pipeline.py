"""The one launch pipeline: a ``LaunchSpec`` checked once, run by ``launch(spec, backend)`` on a
``StageBackend``.

Every step that does not depend on the kind of session is here: the checks of a launch's
arguments, the ranks' environment, the start deadline, the cluster checks both kinds share
(stage attempts, why the ranks do not fit), the driver link (output, rendezvous, failures,
stall watch), the driver's verdict when a rank fails, the error when the stage fails, the
results. The task each Spark task runs is ``rank_task.barrier_task``. A backend says only how
its kind of session finds task slots, submits the barrier stage and collects what its tasks
return, and cancels it: ``rdd_stage.ClassicBackend`` (a ``SparkContext``: an RDD barrier
stage) and ``dataframe_stage.ConnectBackend`` (Spark Connect: a DataFrame barrier stage).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import FrameType, TracebackType
from typing import IO, TYPE_CHECKING, Any, Protocol, overload

import cloudpickle

import flyte_hvd
from flyte_hvd.core.errors import RanksFailedError
from flyte_hvd.core.log import get_logger, verbosity_level
from flyte_hvd.core.types import UserValue
from flyte_hvd.launch import failures as failure_kinds
from flyte_hvd.launch import stall, task_identity
from flyte_hvd.launch.environment import DRIVER_VERSION_ENV, driver_env, local_driver_env
from flyte_hvd.launch.job import (
    DEFAULT_MAX_RESULT_BYTES,
    MAX_RESULT_ENV,
    FunctionJob,
    result_limit,
)
from flyte_hvd.launch.supervisor import (
    check_start_timeout,
    first_failure,
    killed_by_signal,
    new_secret,
    start_timeout_from_env,
)
from flyte_hvd.stage import rank_task

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from flyte_hvd.stage.driver_link import DriverServer

logger = get_logger(__name__)

START_TIMEOUT_ENV = "HOROVOD_SPARK_START_TIMEOUT"
DEFAULT_START_TIMEOUT = 600.0


# -- a launch's arguments and the ranks' environment -----------------------------------------


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


# -- what the cluster is (either kind of session) --------------------------------------------


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


def start_spares(
    master: str,
    num_proc: int,
    env: dict[str, str] | None,
    preload: tuple[str, ...],
    submit: Callable[[rank_task.SpareTask], int],
) -> threading.Thread | None:
    """Starts, in a background thread, a short Spark job (``submit`` runs it) of ``num_proc``
    tasks that each start a spare rank process importing ``preload`` in their Python worker,
    unless one is idle there (``flyte_hvd.launch.spare``). An estimator calls it once its data
    is checked: the ranks' framework imports then run while Spark writes or computes the
    data, and the barrier tasks that follow in those workers hand their ranks to the spares
    (Spark gives a task the Python worker idle longest; in a new session these are the only
    ones). The job must be of the stage's kind: RDD tasks and the DataFrame API's Arrow tasks
    run in separate pools of Python workers. A task that lands in another worker starts its
    rank as usual; the spare left idle exits with its worker or after
    ``FLYTE_HVD_SPARE_IDLE_S``. Returns the thread (None when spares are off); failures are
    logged, never raised: the run does not depend on it."""
    from flyte_hvd.launch import spare

    if not preload or not spare.enabled():
        return None
    task = rank_task.spare_task(ranks_env(master, num_proc, env), tuple(preload), is_local(master))

    def run() -> None:
        try:
            logger.debug("started %d spare rank process(es) ahead of the run", submit(task))
        except Exception as error:  # e.g. the session stopped: the run starts its own ranks
            logger.debug("no spare rank processes ahead of the run: %s", first_line(error))

    thread = threading.Thread(target=run, name="flyte-hvd-spares", daemon=True)
    thread.start()
    return thread


def is_local(master: str) -> bool:
    """``local``/``local[N]``/``local[N,F]``: tasks run in the driver JVM."""
    return master == "local" or master.startswith("local[")


def stage_attempts(sc: ClusterConf) -> int:
    """How many times a failed stage may run: ``spark.task.maxFailures`` (Spark's default 4),
    or F of a ``local[N,F]`` master (1 for plain ``local[N]``)."""
    master = _master(sc)
    if is_local(master):
        match = re.match(r"local\[[^,\]]+,\s*(\d+)\]", master)
        return int(match.group(1)) if match else 1
    return max(1, int(sc.getConf().get("spark.task.maxFailures", "4")))


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


# -- when a rank fails -----------------------------------------------------------------------


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
        f"{'no result' if error is None else first_line(error)}"
    )


# How long the driver waits, after a rank's error on the last attempt, for its peers' reports
# before it stops the stage: a rank the kernel killed is reported by its task as soon as that
# task sees the exit, but its peers' "connection closed" errors can arrive first.
PEER_REPORT_GRACE_S = 2.0


def on_rank_failure(
    max_attempts: int,
    cancel: Callable[[], None],
    grace: float = PEER_REPORT_GRACE_S,
    num_proc: int | None = None,
) -> Callable[[int, int, str], bool]:
    """What the driver does when a rank fails in attempt ``attempts_started``: after the last
    attempt, or at once for a failure no retry can fix (an exception of the user's code,
    ``flyte_hvd.launch.failures``), it cancels the stage (a barrier stage is otherwise
    retried) and returns True (the run ends here); before that it says once per attempt that
    Spark retries the stage.

    The cancel is immediate when a signal killed the rank (that is the cause) or when every
    one of the ``num_proc`` ranks has reported (no report is left to wait for), else ``grace``
    seconds later, so that the error names the rank that died rather than the peer that
    noticed it first."""
    told: set[int] = set()
    timers: list[threading.Timer] = []
    reported: dict[int, set[int]] = {}  # attempt -> the ranks that failed in it

    def cancel_quietly() -> None:  # a timer may fire after the session went away
        try:
            cancel()
        except Exception as error:
            logger.debug("cancelling the stage: %s", error)

    def handle(attempts_started: int, rank: int, traceback: str) -> bool:
        # An exception of the user's code (``failures``) fails the same way on every attempt:
        # the run ends at its first, and a signal's death or a lost store gets Spark's retry.
        user_error = not failure_kinds.classify_text(traceback).recoverable
        reported.setdefault(attempts_started, set()).add(rank)
        if attempts_started >= max_attempts or user_error:
            everyone = num_proc is not None and len(reported[attempts_started]) >= num_proc
            if killed_by_signal(traceback) or grace <= 0 or everyone:
                for timer in timers:
                    timer.cancel()
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


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else "no message"


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


class StageBackend(Protocol):
    """What differs between kinds of session."""

    master: str  # the cluster's master URL
    label: str  # how the launcher's log line names the stage's kind

    def default_parallelism(self) -> int: ...

    def wait_for_slots(self, num_proc: int, deadline: float, timeout: float) -> None:
        """Return once the cluster can run ``num_proc`` tasks at once; raise with what to
        change when it cannot (by the deadline)."""

    def stage_attempts(self) -> int:
        """How many times a failed stage may run."""

    def link_host(self) -> str:
        """The driver-side address the stage's tasks reach the driver link at."""

    def run_stage(
        self,
        task: rank_task.BarrierTask,
        num_proc: int,
        retried: bool,
        tag: str,
        data: DataFrame | None = None,
    ) -> list[tuple[int, bytes]]:
        """Runs ``task`` in a barrier stage of ``num_proc`` tasks, tagged ``tag`` (so that
        ``cancel`` reaches it), retried as a whole when ``retried``; returns each task's
        ``(rank, payload)`` in rank order. With ``data``, the stage runs over its rows, one
        partition per task (``partition``)."""

    def cancel(self, tag: str) -> None: ...

    def settle(self, tag: str) -> None:
        """After a failed stage: returns once its cancelled tasks have ended (bounded)."""


def start_timeout_of(start_timeout: float | None) -> float:
    """``start_timeout`` checked, or ``HOROVOD_SPARK_START_TIMEOUT``, then 600 s."""
    if start_timeout is None:
        return start_timeout_from_env(START_TIMEOUT_ENV, DEFAULT_START_TIMEOUT)
    return check_start_timeout(start_timeout)


@dataclass(frozen=True)
class LaunchSpec:
    """A run of ``fn`` on ranks, checked: every field is valid once the spec exists."""

    job: bytes  # the pickled FunctionJob
    num_proc: int
    start_timeout: float
    env: dict[str, str] | None  # None: the driver's environment (``ranks_env``)
    stdout: IO[str] | None = None
    stderr: IO[str] | None = None
    verbose: int = 1
    prefix_output_with_timestamp: bool = False
    preload: tuple[str, ...] = field(default=())
    max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES

    @classmethod
    def of(
        cls,
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
        default_num_proc: Callable[[], int] | None = None,
        max_result_bytes: int | None = None,
    ) -> LaunchSpec:
        """Checks every argument (``num_proc`` defaults to ``default_num_proc()``, the
        timeout to ``HOROVOD_SPARK_START_TIMEOUT``, then 600 s, ``max_result_bytes`` to
        ``FLYTE_HVD_MAX_RESULT_BYTES``, then 2 GiB)."""
        if num_proc is None and default_num_proc is not None:
            num_proc = default_num_proc()
        timeout = start_timeout_of(start_timeout)
        return cls(
            job=pickle_job(fn, args, kwargs),
            num_proc=check_num_proc(num_proc),
            start_timeout=timeout,
            env=None if env is None else check_env(env),
            stdout=stdout,
            stderr=stderr,
            verbose=verbose,
            prefix_output_with_timestamp=prefix_output_with_timestamp,
            preload=tuple(preload),
            max_result_bytes=_check_max_result_bytes(max_result_bytes),
        )


def _check_max_result_bytes(value: object) -> int:
    if value is None:
        return result_limit(os.environ) or DEFAULT_MAX_RESULT_BYTES
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"`max_result_bytes` must be a positive int (bytes); found {value!r}. Leave it "
            f"out for {MAX_RESULT_ENV}, then 2 GiB."
        )
    return value


def launch(spec: LaunchSpec, backend: StageBackend, data: DataFrame | None = None) -> RunReport:
    """Runs ``spec`` on ``backend``'s cluster: one barrier stage, one rank per task; with
    ``data`` (checked), each rank gets its partition of it (``partition.get_partition``)."""
    from flyte_hvd.stage.driver_link import DriverServer

    num_proc = spec.num_proc
    rank_env = ranks_env(backend.master, num_proc, spec.env)
    rank_env[MAX_RESULT_ENV] = str(spec.max_result_bytes)  # each rank checks its own result
    rank_env[DRIVER_VERSION_ENV] = flyte_hvd.__version__  # executors and ranks compare theirs
    # In a Flyte task a stuck collective ends by default (a retry resumes the run).
    in_task = task_identity.current() is not None
    stall_config = stall.StallConfig.from_env({**os.environ, **rank_env}, in_task=in_task)
    submitted_at = time.time()
    deadline = time.monotonic() + spec.start_timeout
    backend.wait_for_slots(num_proc, deadline, spec.start_timeout)
    secret = new_secret()
    max_attempts = backend.stage_attempts()
    # Names the stage's jobs in Spark's UI and logs, which many can read: nothing of the secret.
    tag = f"flyte-hvd-{uuid.uuid4().hex[:12]}"

    server = DriverServer(
        backend.link_host(),
        secret,
        num_proc,
        stdout=spec.stdout,
        stderr=spec.stderr,
        prefix_output_with_timestamp=spec.prefix_output_with_timestamp,
        on_failure=on_rank_failure(max_attempts, lambda: backend.cancel(tag), num_proc=num_proc),
        watch=stall.StallWatch(num_proc, stall_config),
        on_stuck=lambda: backend.cancel(tag),
        max_result_bytes=spec.max_result_bytes,
    )
    level = verbosity_level(spec.verbose)
    logger.log(level, "running %d ranks in a Spark barrier stage%s", num_proc, backend.label)
    task = rank_task.barrier_task(
        spec.job,
        num_proc,
        secret,
        driver_address=server.address,
        env=rank_env,
        start_timeout=deadline - time.monotonic(),
        single_host=is_local(backend.master),
        preload=spec.preload,
    )

    def stop() -> None:  # the stage's tasks are killed; the link's end stops their ranks now
        try:
            backend.cancel(tag)
        except Exception as error:  # the session is going away too: the link still ends
            logger.debug("cancelling the stage: %s", error)
        finally:
            server.close()

    settle = False
    try:
        with stopped_by_signals(stop) as received:
            try:
                collected = backend.run_stage(task, num_proc, max_attempts > 1, tag, data)
            except Exception as error:
                if received:
                    raise interrupted(received[0]) from None
                failure = stage_failure(server, num_proc, error)
                settle = True
                raise failure from (None if isinstance(failure, RanksFailedError) else error)
        if received:
            raise interrupted(received[0])
        # A failed run's last attempt ends its tasks with RUN_FAILED instead of failing.
        if any(payload == rank_task.RUN_FAILED for _, payload in collected):
            settle = True
            raise stage_failure(server, num_proc)
        results = [rank_task.load_result(server, payload) for _, payload in collected]
    finally:
        server.close()  # the tasks stop their ranks when their link ends
        if settle:  # then their Spark tasks end: wait for that before raising
            backend.settle(tag)
    logger.log(level, "%d ranks finished", num_proc)
    return RunReport(results=results, submitted_at=submitted_at, events=dict(server.events))


# -- Ctrl-C and SIGTERM ----------------------------------------------------------------------


class RunTerminated(SystemExit):
    """SIGTERM stopped a run on Spark: its stage was cancelled, every rank stopped; the
    process exits with status 143 (128 + SIGTERM), as it would have without flyte_hvd, but
    after cleaning up."""

    def __init__(self) -> None:
        super().__init__(128 + signal.SIGTERM)


@contextlib.contextmanager
def stopped_by_signals(stop: Callable[[], None]) -> Iterator[list[int]]:
    """While the block runs in the main thread, SIGINT and SIGTERM call ``stop`` (in a thread
    of its own: the main thread is inside a py4j or gRPC call that a handler must not
    re-enter, which is what pyspark's own SIGINT handler does) and are recorded in the list
    the block gets; the block then ends as the cancelled stage returns. A second signal
    raises at once. Signals the process ignores stay ignored; the previous handlers come
    back after the block."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        if received:  # asked again while the stage winds down: stop waiting for it
            raise interrupted(signum)
        received.append(signum)
        threading.Thread(target=stop, name="flyte-hvd-stop", daemon=True).start()

    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        current = signal.getsignal(sig)
        if current is not signal.SIG_IGN:
            previous[sig] = current
            signal.signal(sig, handler)
    try:
        yield received
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)


def interrupted(signum: int) -> BaseException:
    """The exception that ends a run stopped by ``signum``, its one line logged."""
    name = "interrupted (Ctrl-C)" if signum == signal.SIGINT else "terminated (SIGTERM)"
    line = f"{name}: the Spark stage was cancelled and every rank stopped"
    logger.warning(line)
    if signum != signal.SIGINT:
        return RunTerminated()
    # A plain KeyboardInterrupt: a notebook's cell stops and the kernel stays; a script that
    # does not catch it ends as Ctrl-C ends Python (status 130), which Python does only for
    # that exact type. Its line is logged: left uncaught, it prints no traceback.
    error = KeyboardInterrupt(line)
    error.flyte_hvd_logged = True  # type: ignore[attr-defined]
    _quiet_uncaught()
    return error


def logged_interrupt(error: BaseException) -> bool:
    """Whether ``error`` is the ``KeyboardInterrupt`` of a run that Ctrl-C stopped, its line
    already logged."""
    return getattr(error, "flyte_hvd_logged", False) is True


def _quiet_uncaught() -> None:
    previous = sys.excepthook
    if getattr(previous, "flyte_hvd", False):
        return

    def hook(exc_type: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if not logged_interrupt(value):
            previous(exc_type, value, tb)

    hook.flyte_hvd = True  # type: ignore[attr-defined]
    sys.excepthook = hook
