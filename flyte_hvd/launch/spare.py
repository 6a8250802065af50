"""Spare rank processes: a rank process started ahead of its run, its framework imported.

A rank process spends seconds importing TensorFlow or torch before it trains, on every
``fit``. A run that names modules to preload has its supervisor start one spare per rank it
runs, as the supervisor's own child (a Spark task's Python worker, which Spark keeps for the
next task): once that rank calls ``rank_is_warm`` (the estimators do as training starts), or
else when the run ends well. The spare is an ordinary rank process (``mpiexec -n 1 python -m
flyte_hvd.launch.bootstrap``) that imports those modules and waits on a socket in its own
0700 folder. The next supervisor in that process whose ranks would start with the same
command, environment and modules hands it a rank instead of starting a new process; the
spare then joins as any rank does (a new communicator, the run's secret over the control
socket), runs that one job and exits. So a process never serves two runs, and nothing of
one run reaches the next.

A spare exits by itself once the process that keeps it is gone (Spark stopped the worker or
the session) or after ``FLYTE_HVD_SPARE_IDLE_S`` seconds (default 300) unclaimed; a failed
run stops its process's spares, so the run after a failure starts fresh.
``FLYTE_HVD_SPARE_RANKS=0`` turns spares off.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from flyte_hvd.launch import messages, rendezvous, torch_env
from flyte_hvd.launch.environment import DRIVER_VERSION_ENV
from flyte_hvd.launch.job import MAX_RESULT_ENV, collector_paused
from flyte_hvd.launch.output import open_rank_pipes

SPARE_ENV = "FLYTE_HVD_SPARE"  # in a spare: the socket it waits on for its rank
_OWNER_ENV = "FLYTE_HVD_SPARE_OWNER"  # "pid:start time" of the process that keeps it
_PRELOAD_ENV = "FLYTE_HVD_SPARE_PRELOAD"
ENABLED_ENV = "FLYTE_HVD_SPARE_RANKS"
IDLE_ENV = "FLYTE_HVD_SPARE_IDLE_S"
DEFAULT_IDLE_S = 300.0
DIR_PREFIX = "flyte-hvd-spare-"
SOCKET_NAME = "ctl"  # as a supervisor's: the stale-folder sweep sees a live spare as live
_ASSIGNMENT_KEYS = ("control", "rank", "size", "job", "result", "tmpdir")


def enabled() -> bool:
    return os.environ.get(ENABLED_ENV, "1").strip() not in ("0", "false", "no", "")


@dataclass
class Spare:
    proc: subprocess.Popen
    folder: str
    key: tuple
    outputs: tuple[int, int]  # read ends of its stdout and stderr pipes (``core.output``)


_SPARES: list[Spare] = []  # this process's idle spares


def key_of(env: dict[str, str], preload: tuple[str, ...], command: list[str]) -> tuple:
    """What a rank started now would be: a spare started the same way can stand in for it.
    The driver's version is not part of it: spares started ahead of a run have none, and the
    executor that claims them has checked it against its own (the spares' package)."""
    same = {k: v for k, v in env.items() if k != DRIVER_VERSION_ENV}
    return (tuple(command), preload, tuple(sorted(same.items())))


def start(
    env: dict[str, str], preload: tuple[str, ...], command: list[str], base: str, keep: int = 1
) -> None:
    """Starts one spare that imports ``preload`` and waits; ``env`` is the rank environment
    without the run's own entries (control socket, rank, job, result, ``TMPDIR``). Of this
    process's idle spares the newest ``keep`` stay: older ones were made for runs started
    differently (another environment), and each holds a framework in memory."""
    folder = tempfile.mkdtemp(prefix=DIR_PREFIX, dir=base)
    os.mkdir(os.path.join(folder, "tmp"), 0o700)
    spare_env = {
        **env,
        SPARE_ENV: os.path.join(folder, SOCKET_NAME),
        _OWNER_ENV: _identity(os.getpid()),
        _PRELOAD_ENV: ",".join(preload),
        "TMPDIR": os.path.join(folder, "tmp"),
    }
    outputs, write_ends, pipes_env = open_rank_pipes()
    try:
        proc = subprocess.Popen(
            command,
            env={**spare_env, **pipes_env},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            pass_fds=write_ends,
        )
    except BaseException:
        for fd in outputs:
            os.close(fd)
        raise
    finally:
        for fd in write_ends:
            os.close(fd)
    _SPARES.append(Spare(proc, folder, key_of(env, preload, command), outputs))
    while len(_SPARES) > keep:
        _stop(_SPARES[0])


def claim(
    key: tuple, assignment: messages.Message, timeout: float
) -> tuple[subprocess.Popen, tuple[int, int]] | None:
    """Hands the rank in ``assignment`` to an idle spare started as ``key`` says; returns its
    process and the read ends of its output pipes (the caller's from now on), or None when
    there is none (the caller starts a new one)."""
    for spare in list(_SPARES):
        if spare.proc.poll() is not None:  # it timed out, or its imports failed
            _forget(spare)
            continue
        if spare.key != key:
            continue
        _SPARES.remove(spare)
        if _hand_over(spare, assignment, timeout):
            return spare.proc, spare.outputs
        _stop(spare)
    return None


def has_idle(key: tuple) -> bool:
    """Whether an idle spare started as ``key`` says is waiting in this process."""
    return any(s.key == key and s.proc.poll() is None for s in _SPARES)


def stop_all() -> None:
    """Stops this process's spares (after a failed run: the next run starts fresh)."""
    while _SPARES:
        _stop(_SPARES.pop())


def _hand_over(spare: Spare, assignment: messages.Message, timeout: float) -> bool:
    """Sends the rank; the spare acknowledges once its imports are done and it took it."""
    path = os.path.join(spare.folder, SOCKET_NAME)
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):  # a spare started moments ago is still starting Python
        if spare.proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(max(deadline - time.monotonic(), 0.1))
        conn.connect(path)
        conn.sendall((json.dumps(assignment) + "\n").encode())
        return conn.makefile("rb").readline().strip() == b"ok"
    except OSError:
        return False
    finally:
        conn.close()


def _stop(spare: Spare) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(spare.proc.pid, signal.SIGKILL)  # mpiexec and the spare: its own session
    spare.proc.wait()
    _forget(spare)


def _forget(spare: Spare) -> None:
    with contextlib.suppress(ValueError):
        _SPARES.remove(spare)
    for pipe in (spare.proc.stdout, spare.proc.stderr):
        if pipe is not None:
            pipe.close()
    for fd in spare.outputs:
        with contextlib.suppress(OSError):
            os.close(fd)
    shutil.rmtree(spare.folder, ignore_errors=True)


# -- in a rank ---------------------------------------------------------------------------------

_to_supervisor: list[
    Callable[[messages.Message], None]
] = []  # the rank's control channel, set by the bootstrap


def set_channel(send: Callable[[messages.Message], None]) -> None:
    _to_supervisor[:] = [send]


def rank_is_warm() -> None:
    """Called by a rank once it has imported what it needs (the estimators do as training
    starts): its supervisor starts the spare for the next run now, so that the spare's
    imports run during this run, not at the next one's start. Without the call the spare
    starts when the run ends. Outside a launched rank: nothing."""
    if _to_supervisor:
        send = _to_supervisor.pop()
        with contextlib.suppress(OSError):
            send(messages.rank_event(messages.RankOp.WARM))


# -- in the spare ------------------------------------------------------------------------------


def import_ahead(modules: Iterable[str]) -> None:
    """What a spare imports before it waits: ``modules`` in order, with the collector paused;
    optional ones (an fsspec backend) may be missing: the job imports what it needs."""
    with collector_paused():
        for name in modules:
            with contextlib.suppress(ImportError):
                importlib.import_module(name)


def wait_for_rank() -> dict[str, str]:
    """In a spare: import the modules, wait for a rank, and return it as the environment a
    freshly started rank would have had. Exits the process when its keeper is gone or it
    waited ``FLYTE_HVD_SPARE_IDLE_S`` seconds."""
    env = os.environ
    path = env.pop(SPARE_ENV)
    owner = env.pop(_OWNER_ENV)
    idle = float(env.get(IDLE_ENV) or DEFAULT_IDLE_S)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # Listening before the imports: a supervisor may hand over a rank while they run. The
    # socket appears at its path only once it listens (a supervisor waits for the path).
    server.bind(f"{path}.new")
    server.listen(4)
    os.rename(f"{path}.new", path)
    import_ahead(filter(None, env.pop(_PRELOAD_ENV, "").split(",")))
    server.settimeout(1.0)
    deadline = time.monotonic() + idle
    try:
        while time.monotonic() < deadline and _identity(int(owner.split(":")[0])) == owner:
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(5)
                try:
                    assignment = json.loads(conn.makefile("rb").readline())
                    if not all(k in assignment for k in _ASSIGNMENT_KEYS):
                        continue
                    conn.sendall(b"ok\n")
                except (OSError, ValueError):
                    continue  # a liveness probe (the stale-folder sweep), or a stranger
            tempfile.tempdir = None  # the run's folder from now on, not the spare's
            return rank_environment(assignment)
    finally:
        server.close()
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    os._exit(0)


def rank_environment(assignment: messages.Message) -> dict[str, str]:
    """A rank's own environment entries: where its run is (a new rank gets them at start, a
    spare with its rank)."""
    limit = str(assignment.get("result_limit") or "")
    partition = str(assignment.get("partition") or "")
    return {
        rendezvous.CONTROL_ENV: str(assignment["control"]),
        rendezvous.RANK_ENV: str(assignment["rank"]),
        rendezvous.SIZE_ENV: str(assignment["size"]),
        rendezvous.JOB_ENV: str(assignment["job"]),
        rendezvous.RESULT_ENV: str(assignment["result"]),
        "TMPDIR": str(assignment["tmpdir"]),
        torch_env.ADDRESS_ENV: str(assignment.get("address") or ""),
        **({MAX_RESULT_ENV: limit} if limit else {}),
        **({rendezvous.PARTITION_ENV: partition} if partition else {}),
    }


def _identity(pid: int) -> str:
    """``pid:start time``: a pid that the system reused for another process reads as gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            start = f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except OSError:
            return ""
        start = "?"  # no /proc: the pid alone
    return f"{pid}:{start}"
