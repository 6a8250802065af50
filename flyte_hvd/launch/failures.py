"""What a failed run is: one a retry can fix, or one no retry can fix. One classification for
Spark's stage retry inside a task attempt, flytekit's and Flyte 2's retries of the task.

- ``SYSTEM`` (a retry can fix it): a rank killed by a signal (other than SIGABRT, which NCCL's
  watchdog sends itself), an executor or pod lost, a Store that timed out or cannot be reached,
  a collective stopped by the stall shutdown, a rank that lost its peers or the driver.
- ``OOM``: a rank that ran out of memory (``MemoryError``, or a SIGKILL while the OOM killer's
  count of its cgroup grew: the supervisor says so in the rank's failure). Retried like
  ``SYSTEM``; Flyte 2 gets ``flyte.errors.OOMError``.
- ``USER`` (no retry can fix it): bad parameters, any other exception raised by the user's code
  on a rank, a model that does not fit the data. Fails fast: no second Spark stage attempt,
  non-recoverable for Flyte.

A failed run's kind is its cause's: a rank killed by a signal is the cause whatever its peers
then raised (their errors are consequences); otherwise any rank's own user error makes the run
a user error; otherwise the run is a system failure.
"""

from __future__ import annotations

import contextlib
import enum
import os
import re
from collections.abc import Iterator

from flyte_hvd.core.errors import RanksFailedError

# A rank's failure text when a signal ended it (the supervisor's words).
_SIGNALLED = re.compile(r"^rank \d+ died: .*\(signal (\d+)\)", re.MULTILINE)
_SIGABRT = 6
# The exception a traceback (or a one-line ``Name: message``) ends with.
_EXCEPTION_LINE = re.compile(
    r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Failure|Timeout)):?(?:\s|$)"
)

# Exceptions a retry can fix: the store, the network, a peer or the driver gone, a collective
# that could not complete because of them (by class name; the Store's errors are a layer up).
RECOVERABLE_EXCEPTIONS = frozenset(
    {
        "StoreTimeoutError",
        "StoreUnreachableError",
        "PeerExitedError",
        "HorovodInternalError",
        "RendezvousTimeoutError",
        "ConnectionError",
        "ConnectionResetError",
        "ConnectionRefusedError",
        "ConnectionAbortedError",
        "BrokenPipeError",
        "TimeoutError",
        "DistBackendError",
        "DistNetworkError",
        "DistStoreError",
        "ExecutorLostFailure",
    }
)
OOM_EXCEPTIONS = frozenset({"MemoryError", "OutOfMemoryError", "ResourceExhaustedError"})
# Words of a failure text that name a cause a retry can fix, where no exception names it.
_RECOVERABLE_TEXT = (
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",  # the stall shutdown's error
    "an executor was lost",  # the stage failed before any rank reported
    "ExecutorLostFailure",
    "lost the connection to the Spark driver",
    "the Spark driver ended the run",
    "mpi4py.MPI.Exception",
    "Connection closed by peer",  # gloo, when the peer died
    "Connection reset by peer",
    "Broken pipe",
)
_OOM_TEXT = ("OOMKilled", "Out of memory: Killed process", "oom-kill:")


# What the supervisor adds to a rank's death when the kernel's OOM killer ended it.
OOM_KILLED_NOTE = "the kernel's OOM killer ended it (oom-kill: the memory limit was reached)"


def oom_kills(root: str = "/sys/fs/cgroup", own: str = "/proc/self/cgroup") -> int | None:
    """How many processes the kernel's OOM killer has ended in this process's memory cgroup (a
    pod's container): ``oom_kill`` of cgroup v2's ``memory.events`` or v1's
    ``memory.oom_control``; None where neither can be read."""
    for path in _memory_cgroup_files(root, own):
        try:
            with open(path) as f:
                for line in f:
                    name, _, value = line.partition(" ")
                    if name == "oom_kill" and value.strip().isdigit():
                        return int(value)
        except OSError:
            continue
    return None


def _memory_cgroup_files(root: str, own: str) -> list[str]:
    """The files that may hold this process's OOM kill count, nearest first. ``own`` names
    the cgroup from the host's root; inside a container ``root`` shows it from the container's,
    so the path is tried with its leading parts removed in turn."""
    candidates: list[str] = []
    try:
        with open(own) as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, path = line.split(":", 2) if line.count(":") >= 2 else ("", "", "")
        if controllers == "":  # v2
            base, name = root, "memory.events"
        elif "memory" in controllers.split(","):
            base, name = os.path.join(root, "memory"), "memory.oom_control"
        else:
            continue
        parts = [p for p in path.split("/") if p]
        candidates += [os.path.join(base, *parts[i:], name) for i in range(len(parts))]
    candidates += [
        os.path.join(root, "memory.events"),
        os.path.join(root, "memory", "memory.oom_control"),
    ]
    return candidates


class FailureKind(enum.Enum):
    USER = "user"  # no retry can fix it
    SYSTEM = "system"  # a retry can fix it
    OOM = "oom"  # out of memory: retried, and named so

    @property
    def recoverable(self) -> bool:
        return self is not FailureKind.USER


def killed_by_signal(text: str) -> bool:
    """Whether a rank's failure text says a signal other than SIGABRT ended it."""
    match = _SIGNALLED.search(text)
    return match is not None and int(match.group(1)) != _SIGABRT


def _exception_line(text: str) -> tuple[str, str] | None:
    """The qualified class name of the exception a failure text ends with, and its line."""
    for line in reversed(text.strip().splitlines()):
        match = _EXCEPTION_LINE.match(line.strip())
        if match:
            return match.group(1), line
    return None


def exception_name(text: str) -> str | None:
    """The class name (without its module) of the exception a failure text ends with."""
    found = _exception_line(text)
    return found[0].rpartition(".")[2] if found else None


def classify_text(text: str) -> FailureKind:
    """The kind of one rank's failure, from its text (a traceback, or the supervisor's line)."""
    if any(words in text for words in _OOM_TEXT):
        return FailureKind.OOM
    if killed_by_signal(text):
        return FailureKind.SYSTEM
    found = _exception_line(text)
    if found is None:  # the supervisor's or the driver's own words
        recoverable = any(words in text for words in _RECOVERABLE_TEXT)
        return FailureKind.SYSTEM if recoverable else FailureKind.USER
    qualified, line = found
    name = qualified.rpartition(".")[2]
    if name in OOM_EXCEPTIONS:
        return FailureKind.OOM
    # A framework's wrapper (TensorFlow's UnknownError: ... PeerExitedError: ...) names it.
    named = (*RECOVERABLE_EXCEPTIONS, *_RECOVERABLE_TEXT)
    if name in RECOVERABLE_EXCEPTIONS or any(words in line for words in named):
        return FailureKind.SYSTEM
    return FailureKind.USER


def classify_failures(failures: dict[int, str]) -> FailureKind:
    """The kind of a run whose ranks failed with ``failures`` (``{rank: text}``)."""
    kinds = {rank: classify_text(text) for rank, text in failures.items()}
    if any(killed_by_signal(text) for text in failures.values()):
        return FailureKind.OOM if FailureKind.OOM in kinds.values() else FailureKind.SYSTEM
    if FailureKind.USER in kinds.values() or not kinds:
        return FailureKind.USER
    return FailureKind.OOM if FailureKind.OOM in kinds.values() else FailureKind.SYSTEM


def classify(error: BaseException) -> FailureKind:
    """The kind of a failed run's error, as the driver (or a task's body) raised it."""
    if isinstance(error, RanksFailedError):
        return classify_failures(error.failures)
    names = {cls.__name__ for cls in type(error).__mro__}
    if names & OOM_EXCEPTIONS:
        return FailureKind.OOM
    if names & RECOVERABLE_EXCEPTIONS:
        return FailureKind.SYSTEM
    cause = error.__cause__
    if isinstance(cause, BaseException) and cause is not error and classify(cause).recoverable:
        return classify(cause)
    # A stage that failed before any rank reported: Spark's own error says whether a Python
    # worker raised (its code or its environment: the same in every attempt) or an executor
    # was lost.
    told = str(cause) if cause is not None else ""
    if "PythonException" in told and "ExecutorLostFailure" not in told:
        return FailureKind.USER
    return classify_text(f"{type(error).__name__}: {error}")


# -- for the Flyte SDKs ----------------------------------------------------------------------


def for_flytekit(error: BaseException) -> BaseException:
    """The exception flytekit's entrypoint reports as ``error``'s kind: a
    ``FlyteRecoverableException`` with the same message for a failure a retry can fix (flytekit
    retries only those), else ``error`` itself (non-recoverable)."""
    kind = classify(error)
    if not kind.recoverable:
        return error
    from flytekit.exceptions.user import FlyteRecoverableException

    if isinstance(error, FlyteRecoverableException):
        return error
    return FlyteRecoverableException(f"{_label(kind)}{error}")


def for_flyte2(error: BaseException) -> BaseException:
    """The exception Flyte 2's runtime reports as ``error``'s kind: ``NonRecoverableError`` for
    a user error (no retry), ``OOMError`` for a rank out of memory, ``RuntimeSystemError``
    otherwise (both retried), each with the same message."""
    import flyte.errors

    if isinstance(error, flyte.errors.BaseRuntimeError):
        return error
    kind = classify(error)
    message = f"{_label(kind)}{error}"
    if kind is FailureKind.USER:
        return flyte.errors.NonRecoverableError(message, code=type(error).__name__)
    if kind is FailureKind.OOM:
        return flyte.errors.OOMError("OOMError", message)
    return flyte.errors.RuntimeSystemError(type(error).__name__, message)


def _label(kind: FailureKind) -> str:
    return {
        FailureKind.USER: "",
        FailureKind.SYSTEM: "(recoverable: a retry resumes from the last checkpoint) ",
        FailureKind.OOM: "(out of memory: a retry resumes from the last checkpoint) ",
    }[kind]


@contextlib.contextmanager
def as_flyte_errors() -> Iterator[None]:
    """In a Flyte task, a failure leaves the block as the exception its SDK retries (or
    does not); elsewhere it leaves unchanged."""
    from flyte_hvd.launch import task_identity

    try:
        yield
    except Exception as error:
        sdk = task_identity.current_sdk()
        if sdk == "flytekit":
            converted = for_flytekit(error)
        elif sdk == "flyte2":
            converted = for_flyte2(error)
        else:
            raise
        if converted is error:
            raise
        raise converted from error
