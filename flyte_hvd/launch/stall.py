"""Stall detection and liveness: which rank waits in which collective, and for how long.

Horovod's stall inspector, rebuilt for rank processes that a supervisor watches. Each rank
runs a ``Probe`` thread that looks, a few times a second, at the Python frames of the rank's
threads: a thread whose frames are inside ``flyte_hvd.core.collectives`` (or
``torch.distributed``'s collectives) is waiting in that collective. So the collectives carry
no hook at all and pay nothing on the hot path. The probe reports only changes (started
waiting more than a second ago, stopped waiting, moved) to its supervisor, and a
``StallWatch`` where all ranks' reports meet (the ``flyte-hvd-run`` supervisor, or the driver
of a Spark run) decides:

- a rank that ended while others wait in a collective can never join them: the run fails
  within seconds, naming the rank and how it ended;
- ranks that waited longer than ``HOROVOD_STALL_CHECK_TIME_SECONDS`` (60) while others are
  elsewhere, or every rank but in different collectives, called from different places or
  given different arrays (calls that no longer match, which only the argument check would
  have refused; the probe reads a waiting call's arguments once it has waited), get one
  warning line naming the collective, the waiting ranks and the missing ones and where they
  are (or what they are doing, when an ``activity`` says so: the Store names each of its
  operations); after ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`` (0: never;
  in a Flyte task 5 check times by default) the run fails with that line as its error.
  ``HOROVOD_STALL_CHECK_DISABLE=1`` turns both off.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import FrameType

from flyte_hvd.core.log import get_logger
from flyte_hvd.launch import messages

CHECK_TIME_ENV = "HOROVOD_STALL_CHECK_TIME_SECONDS"
SHUTDOWN_TIME_ENV = "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"
CHECK_DISABLE_ENV = "HOROVOD_STALL_CHECK_DISABLE"
DEFAULT_CHECK_TIME = 60.0
# In a Flyte task, a stall ends the run after this many check times (5 minutes by default)
# unless HOROVOD_STALL_SHUTDOWN_TIME_SECONDS says otherwise (0: never).
TASK_SHUTDOWN_CHECKS = 5

# A rank reports a wait once it has lasted this long (shorter waits are ordinary).
REPORT_AFTER_S = 1.0
PROBE_INTERVAL_S = 0.25
# How long a rank may still be seen waiting after a peer ended before the run fails: covers
# the probe's delay in reporting that the wait is over.
ENDED_GRACE_S = 2.0

logger = get_logger(__name__)

# The collective core's files, found by path: importing them here would start MPI in every
# process that watches ranks (the Spark driver).
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # flyte_hvd/
_CORE = os.path.join(_PACKAGE, "core")
_COLLECTIVE_FILES = (os.path.join(_CORE, "collectives.py"),)
_INIT_FILE = os.path.join(_CORE, "state.py")
# torch.distributed's collectives (``all_reduce``, ``barrier``, ``init_process_group``, ...):
# their Python frame stays on the stack while gloo or NCCL waits (the GIL released), so a
# rank waiting in one is seen the same way, found by the file's path (torch is not imported).
_TORCH_DISTRIBUTED = os.sep + os.path.join("torch", "distributed", "")
_TORCH_C10D = os.path.join(_TORCH_DISTRIBUTED, "distributed_c10d.py")
_THREADING = threading.__file__
# What a waiting collective was given, by the names the collectives (ours, torch's) give it.
_ARRAY_ARGUMENTS = ("array", "tensor", "arrays", "tensors")
# Our collectives whose arrays may differ in their first dimension between ranks (torch's
# all_gather takes equal shapes).
_RAGGED = ("allgather", "alltoall")


@dataclass(frozen=True)
class StallConfig:
    """The stall knobs, read with Horovod's variable names."""

    check_s: float = DEFAULT_CHECK_TIME
    shutdown_s: float = 0.0
    enabled: bool = True

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, in_task: bool = False) -> StallConfig:
        """``in_task``: the run is a Flyte task's, whose stuck collective must end (its pods
        are held, and a retry can resume it): the shutdown defaults to
        ``TASK_SHUTDOWN_CHECKS`` check times instead of never."""
        env = os.environ if env is None else env
        check = _seconds(env, CHECK_TIME_ENV, DEFAULT_CHECK_TIME, allow_zero=False)
        default_shutdown = TASK_SHUTDOWN_CHECKS * check if in_task else 0.0
        shutdown = _seconds(env, SHUTDOWN_TIME_ENV, default_shutdown, allow_zero=True)
        if shutdown and shutdown < check:
            raise ValueError(
                f"{SHUTDOWN_TIME_ENV}={shutdown:g} is less than {CHECK_TIME_ENV}={check:g}: a "
                f"stall is only known after the check time. Set {CHECK_TIME_ENV} to at most "
                f"{shutdown:g}, or raise {SHUTDOWN_TIME_ENV}."
            )
        enabled = env.get(CHECK_DISABLE_ENV, "0").strip().lower() in ("", "0", "false")
        return cls(check, shutdown, enabled)


def _seconds(env: Mapping[str, str], name: str, default: float, allow_zero: bool) -> float:
    raw = env.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= 0 or (value == 0 and not allow_zero):
        least = ">= 0 (0 turns it off)" if allow_zero else "> 0"
        raise ValueError(f"{name}={raw!r}: expected seconds {least}, e.g. 60.")
    return value


# -- the rank's side -------------------------------------------------------------------------

_activities: list[str] = []  # what this process is busy with, innermost last


@contextlib.contextmanager
def activity(text: str) -> Iterator[None]:
    """Says what this rank is doing during the block (e.g. "uploading runs/x/checkpoint.keras
    to s3://bucket/exp"): when peers wait for it in a collective, the stall line names it. A
    frame cannot tell that a thread waiting on a socket is talking to a store; the Store
    says so around each of its operations."""
    _activities.append(text)
    try:
        yield
    finally:
        _activities.remove(text)


def current_activity() -> str | None:
    return _activities[-1] if _activities else None


def _collective_of(frame: FrameType | None) -> tuple[FrameType, str] | None:
    """The outermost frame of a collective the thread at ``frame`` is in, and its name."""
    found = None
    while frame is not None:
        path = frame.f_code.co_filename
        if _in_collective(path) or (path == _INIT_FILE and frame.f_code.co_name == "init"):
            found = frame
        elif found is not None:
            break
        frame = frame.f_back
    if found is None:
        return None
    name = found.f_code.co_name.lstrip("_")
    if found.f_code.co_filename.endswith(_TORCH_C10D):
        name = f"torch.distributed.{name}"
    return found, name


def _arguments(frame: FrameType, name: str) -> str | None:
    """The dtype and shape of the array a waiting collective was given (``(*, ...)`` where
    the first dimension may differ between ranks), and its root: what every rank's call must
    match. None where it cannot tell, or the call runs on a subset of the ranks (process set,
    torch group), whose peers are not all ranks."""
    try:
        values = dict(frame.f_locals)
    except Exception:  # a frame that ended meanwhile
        return None
    if getattr(values.get("process_set"), "process_set_id", 0) != 0 or values.get("group"):
        return None
    given = next((values[n] for n in _ARRAY_ARGUMENTS if values.get(n) is not None), None)
    if isinstance(given, list | tuple):
        shapes: list[Iterable[int | None] | None] = [getattr(g, "shape", None) for g in given]
        if not shapes or None in shapes:
            return None
        elements = sum(_count(shape) for shape in shapes if shape is not None)
        text = f"{len(shapes)} arrays of {elements} elements"
    else:
        shape, dtype = getattr(given, "shape", None), getattr(given, "dtype", None)
        if shape is None or dtype is None:
            return None
        dims = tuple(shape)
        if any(name.startswith(r) for r in _RAGGED):
            dims = ("*", *dims[1:])
        dtype_name = str(getattr(dtype, "name", dtype)).removeprefix("torch.")
        text = f"{dtype_name} shape ({', '.join(map(str, dims))}{',' if len(dims) == 1 else ''})"
    root = values.get("root_rank", values.get("src"))
    return text if root is None else f"{text}, root {root}"


def _count(shape: Iterable[int | None]) -> int:
    count = 1
    for dim in shape:
        count *= int(dim or 0)
    return count


def _in_collective(path: str) -> bool:
    return path in _COLLECTIVE_FILES or path.endswith(_TORCH_C10D)


def _where(frame: FrameType | None) -> str:
    """``file:line in function`` of the innermost frame outside flyte_hvd, torch.distributed
    and ``threading`` (a thread waiting for another, as the Store's operations wait, is where
    it waits from)."""
    innermost = frame
    while frame is not None:
        path = frame.f_code.co_filename
        if (
            not path.startswith((_PACKAGE, "<frozen", _THREADING))
            and _TORCH_DISTRIBUTED not in path
        ):
            break
        frame = frame.f_back
    frame = frame or innermost
    if frame is None:
        return "?"
    name = os.path.basename(frame.f_code.co_filename)
    return f"{name}:{frame.f_lineno} in {frame.f_code.co_name}"


class Probe:
    """Samples where this rank's threads are and sends changes with ``send(report)``.

    A report is ``{"op": "probe", "coll": name or None, "age": seconds, "where": text,
    "doing": text or None, "given": text or None}`` (``doing``: an ``activity`` that has
    lasted a second; ``given``: what the waiting collective was given).
    """

    def __init__(self, send: Callable[[messages.Message], None], main: int | None = None):
        self._send = send
        self._main = threading.main_thread().ident if main is None else main
        self._frame_id = 0  # id() of the collective's frame seen last (see `sample`)
        self._since = 0.0
        self._reported = False
        self._where = ""
        self._where_sent_at = 0.0
        self._where_seen = ""  # where the main thread was at the last sample, and since when
        self._where_seen_since = 0.0
        self._doing: str | None = None  # the activity reported last
        self._seen: str | None = None  # the activity seen last, and since when
        self._seen_since = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="flyte-hvd-probe", daemon=True)

    def start(self) -> Probe:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(PROBE_INTERVAL_S):
            try:
                self.sample()
            except Exception:  # a probe must never fail the rank
                return

    def sample(self) -> None:
        now = time.monotonic()
        frames = sys._current_frames()
        # This thread's own entry is the frame running this method, which holds `frames`: a
        # reference cycle that would keep every sampled frame, and the locals of the calls
        # they belong to (pooled collective buffers), alive until the cyclic GC runs.
        del frames[threading.get_ident()]
        hit = None
        # The main thread first: it is where user code and its collectives usually run.
        for ident in sorted(frames, key=lambda i: i != self._main):
            hit = _collective_of(frames[ident])
            if hit is not None:
                break
        main = frames.get(self._main) if self._main is not None else None
        where = _where(main) if main is not None else "?"
        seen = current_activity()
        if seen != self._seen:
            self._seen, self._seen_since = seen, now
        # Reported once it lasts (most store operations take milliseconds), and at once when
        # it ends.
        doing = seen if seen is not None and now - self._seen_since >= REPORT_AFTER_S else None
        # Same call as last time? Holding its frame would tell, but would keep the call's
        # locals (pooled result buffers) alive after it returns. Instead the frame is marked:
        # the running call owns its frame object, so a frame with the same id that carries
        # the mark is that call still; a new call's frame is a new object, unmarked. (The
        # mark, ``f_trace_lines = False``, only matters to a tracer stepping through
        # flyte_hvd's collectives.)
        if hit is not None and id(hit[0]) == self._frame_id and not hit[0].f_trace_lines:
            if not self._reported and now - self._since >= REPORT_AFTER_S:
                self._reported = True
                self._report(hit[1], now - self._since, where, now, None, _arguments(*hit))
            return
        if self._reported:
            self._reported = False
            self._report(None, 0.0, where, now, doing)
        if hit is not None:
            hit[0].f_trace_lines = False
            self._frame_id, self._since = id(hit[0]), now
        else:
            self._frame_id, self._since = 0, 0.0
        if where != self._where_seen:
            self._where_seen, self._where_seen_since = where, now
        # A place the rank stays at is sent once it lasts; one that keeps changing (code
        # running) at most every 5 s.
        steady = now - self._where_seen_since >= REPORT_AFTER_S
        if hit is None and (
            doing != self._doing
            or (where != self._where and (steady or now - self._where_sent_at >= 5.0))
        ):
            self._report(None, 0.0, where, now, doing)

    def _report(
        self,
        coll: str | None,
        age: float,
        where: str,
        now: float,
        doing: str | None = None,
        given: str | None = None,
    ) -> None:
        self._where, self._where_sent_at, self._doing = where, now, doing
        self._send(messages.probe(coll, age, where, doing, given))


# -- where the ranks' reports meet -----------------------------------------------------------


@dataclass
class _RankView:
    coll: str | None = None
    since: float = 0.0
    where: str = ""
    doing: str | None = None  # the rank's ``activity`` (a store operation...), if any
    given: str | None = None  # what its waiting collective was given (``_arguments``)
    ended: str | None = None  # how the rank ended: "returned (exit status 0)" ...
    ended_at: float = 0.0


class StallWatch:
    """Decides, from the ranks' probe reports and endings, whether the run is stuck.

    ``check()`` is called periodically; it logs stall warnings and returns ``(rank, error
    message)`` when the run must stop, naming the rank to blame (None otherwise).
    Thread-safe.
    """

    def __init__(
        self,
        size: int,
        config: StallConfig | None = None,
        warn: Callable[[str], None] | None = None,
    ):
        self.size = size
        self.config = config or StallConfig()
        self._warn = warn or logger.warning
        self._lock = threading.Lock()
        self._ranks = {r: _RankView() for r in range(size)}
        self._warned_at: float | None = None

    def reset(self, rank: int) -> None:
        """The rank started again (a retried Spark stage): forget what it reported."""
        with self._lock:
            self._ranks[rank] = _RankView()
            self._warned_at = None

    def probe(self, rank: int, report: messages.Message) -> None:
        with self._lock:
            view = self._ranks.get(rank)
            if view is None:
                return
            view.coll = report.get("coll")
            view.since = time.monotonic() - float(report.get("age", 0.0))
            view.where = str(report.get("where", ""))
            doing = report.get("doing")
            view.doing = str(doing) if doing else None
            given = report.get("given")
            view.given = str(given) if given else None

    def ended(self, rank: int, how: str) -> None:
        """The rank's job is over (``how`` says how, e.g. "returned (exit status 0)")."""
        with self._lock:
            view = self._ranks.get(rank)
            if view is not None and view.ended is None:
                view.ended, view.ended_at, view.coll = how, time.monotonic(), None

    def check(self) -> tuple[int, str] | None:
        with self._lock:
            now = time.monotonic()
            views = self._ranks
            waiting = {r: v for r, v in views.items() if v.coll and not v.ended}
            ended = {r: v for r, v in views.items() if v.ended}
            if ended and waiting:
                first = min(ended, key=lambda r: ended[r].ended_at)
                if now - ended[first].ended_at >= ENDED_GRACE_S:
                    return first, self._stranded(first, ended[first], waiting)
            if not self.config.enabled:
                return None
            line, lag, blame = self._stall_line(now, waiting, ended)
            if line is None:
                self._warned_at = None
                return None
            if self.config.shutdown_s and lag >= self.config.shutdown_s:
                return blame, (
                    f"{line} The run was stopped after {self.config.shutdown_s:g}s "
                    f"({SHUTDOWN_TIME_ENV})."
                )
            if self._warned_at is None or now - self._warned_at >= self.config.check_s:
                self._warned_at = now
                self._warn(line)
            return None

    def _stranded(self, rank: int, view: _RankView, waiting: dict[int, _RankView]) -> str:
        colls = sorted({v.coll for v in waiting.values() if v.coll})
        where = "; ".join(f"rank {r} at {v.where}" for r, v in sorted(waiting.items()))
        return (
            f"rank {rank} ended ({view.ended}) while ranks {sorted(waiting)} wait for it in "
            f"{_names(colls)} ({where}). Every rank must make the same collective calls: "
            f"rank {rank} made fewer, or left early."
        )

    def _stall_line(
        self, now: float, waiting: dict[int, _RankView], ended: dict[int, _RankView]
    ) -> tuple[str | None, float, int]:
        check = self.config.check_s
        others = sorted(r for r in self._ranks if r not in waiting)
        if waiting:
            lag = now - min(v.since for v in waiting.values())
            colls = sorted({v.coll for v in waiting.values() if v.coll})
            # Every rank in the same collective from one place, given the same, is a slow
            # call, not a stall; from several places or given different arrays (unchecked
            # calls that no longer match) it never ends.
            called_from = {v.where for v in waiting.values()}
            given = {v.given for v in waiting.values()}
            differ = len(given) > 1 and None not in given
            if lag < check or (
                not others and len(colls) <= 1 and len(called_from) <= 1 and not differ
            ):
                return None, 0.0, 0
            detail = "; ".join(
                f"rank {r} at {v.where}" + (f" with {v.given}" if differ else "")
                for r, v in sorted(waiting.items())
            )
            line = (
                f"stall: ranks {sorted(waiting)} have waited {lag:.0f}s in {_names(colls)} "
                f"({detail}); "
            )
            if others:
                places = "; ".join(self._place(r) for r in others)
                line += f"ranks {others} are not there ({places})."
            elif len(colls) > 1:
                line += "every rank waits, but in different collectives: they must match."
            elif len(called_from) > 1:
                line += "every rank waits there, but called from different places: they must match."
            else:
                line += "every rank waits there, but given different arrays: they must match."
            return line, lag, (others or sorted(waiting))[0]
        if ended and len(ended) < self.size:
            lag = now - min(v.ended_at for v in ended.values())
            if lag < check:
                return None, 0.0, 0
            running = sorted(r for r in self._ranks if r not in ended)
            return (
                f"stall: ranks {sorted(ended)} finished {lag:.0f}s ago; ranks {running} are "
                f"still running ({'; '.join(self._place(r) for r in running)}).",
                lag,
                running[0],
            )
        return None, 0.0, 0

    def _place(self, rank: int) -> str:
        view = self._ranks[rank]
        if view.ended:
            return f"rank {rank} ended: {view.ended}"
        if view.doing:
            return f"rank {rank} is {view.doing}" + (f" (at {view.where})" if view.where else "")
        return f"rank {rank} at {view.where}" if view.where else f"rank {rank}: not known"


class ForwardWatch:
    """A supervisor's watch when the decisions are made elsewhere (a Spark run's driver):
    passes each report on with ``forward(kind, rank, message)`` and never stops the run."""

    def __init__(self, forward: Callable[[str, int, messages.Message], None]):
        self._forward = forward

    def probe(self, rank: int, report: messages.Message) -> None:
        self._forward(messages.LinkKind.PROBE, rank, dict(report))

    def ended(self, rank: int, how: str) -> None:
        self._forward(messages.LinkKind.ENDED, rank, {"how": how})

    def check(self) -> None:
        return None


def _names(colls: list[str]) -> str:
    return " and ".join(f"`{c}`" for c in colls) or "a collective"
