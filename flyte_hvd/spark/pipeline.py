"""The one launch pipeline: a ``LaunchSpec`` checked once, run by ``launch(spec, backend)`` on a
``StageBackend``.

Every step that does not depend on the kind of session is here: the ranks' environment, the
start deadline, the driver link (output, rendezvous, failures, stall watch), the barrier
task each rank's Spark task runs, the error when the stage fails, the results. A backend
says only how its kind of session finds task slots, submits the barrier stage and collects
what its tasks return, and cancels it: ``runner.ClassicBackend`` (a ``SparkContext``: an RDD
barrier stage) and ``dataframe_stage.ConnectBackend`` (Spark Connect: a DataFrame barrier
stage).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import FrameType, TracebackType
from typing import IO, Any, Protocol

import flyte_hvd
from flyte_hvd.core.errors import RanksFailedError
from flyte_hvd.core.log import get_logger, verbosity_level
from flyte_hvd.core.types import UserValue
from flyte_hvd.launch import stall, task_identity
from flyte_hvd.launch.environment import DRIVER_VERSION_ENV
from flyte_hvd.launch.job import DEFAULT_MAX_RESULT_BYTES, MAX_RESULT_ENV, result_limit
from flyte_hvd.launch.supervisor import check_start_timeout, new_secret, start_timeout_from_env
from flyte_hvd.spark import runner

logger = get_logger(__name__)

START_TIMEOUT_ENV = "HOROVOD_SPARK_START_TIMEOUT"
DEFAULT_START_TIMEOUT = 600.0


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
        self, task: runner.BarrierTask, num_proc: int, retried: bool, tag: str
    ) -> list[tuple[int, bytes]]:
        """Runs ``task`` in a barrier stage of ``num_proc`` tasks, tagged ``tag`` (so that
        ``cancel`` reaches it), retried as a whole when ``retried``; returns each task's
        ``(rank, payload)`` in rank order."""

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
    env: dict[str, str] | None  # None: the driver's environment (``runner.ranks_env``)
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
            job=runner.pickle_job(fn, args, kwargs),
            num_proc=runner.check_num_proc(num_proc),
            start_timeout=timeout,
            env=None if env is None else runner.check_env(env),
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


def launch(spec: LaunchSpec, backend: StageBackend) -> runner.RunReport:
    """Runs ``spec`` on ``backend``'s cluster: one barrier stage, one rank per task."""
    from flyte_hvd.spark.driver_link import DriverServer

    num_proc = spec.num_proc
    rank_env = runner.ranks_env(backend.master, num_proc, spec.env)
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
        on_failure=runner.on_rank_failure(max_attempts, lambda: backend.cancel(tag)),
        watch=stall.StallWatch(num_proc, stall_config),
        on_stuck=lambda: backend.cancel(tag),
        max_result_bytes=spec.max_result_bytes,
    )
    level = verbosity_level(spec.verbose)
    logger.log(level, "running %d ranks in a Spark barrier stage%s", num_proc, backend.label)
    task = runner.barrier_task(
        spec.job,
        num_proc,
        secret,
        driver_address=server.address,
        env=rank_env,
        start_timeout=deadline - time.monotonic(),
        single_host=runner.is_local(backend.master),
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
                collected = backend.run_stage(task, num_proc, max_attempts > 1, tag)
            except Exception as error:
                if received:
                    raise interrupted(received[0]) from None
                failure = runner.stage_failure(server, num_proc, error)
                settle = True
                raise failure from (None if isinstance(failure, RanksFailedError) else error)
        if received:
            raise interrupted(received[0])
        # A failed run's last attempt ends its tasks with RUN_FAILED instead of failing.
        if any(payload == runner.RUN_FAILED for _, payload in collected):
            settle = True
            raise runner.stage_failure(server, num_proc)
        results = [runner.load_result(server, payload) for _, payload in collected]
    finally:
        server.close()  # the tasks stop their ranks when their link ends
        if settle:  # then their Spark tasks end: wait for that before raising
            backend.settle(tag)
    logger.log(level, "%d ranks finished", num_proc)
    return runner.RunReport(results=results, submitted_at=submitted_at, events=dict(server.events))


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
