"""Start rank processes, supervise them, and turn their failures into one clear error.

A ``RankSupervisor`` owns some ranks of a run (all of them for ``flyte-hvd-run``; one per
Spark task for ``flyte_hvd.spark.run``). For each it starts ``mpiexec -n 1 python -m
flyte_hvd.launch.bootstrap``, serves the rank's control socket, prefixes its output with
``[rank]``, and watches it: if a rank fails, the others are stopped at once and the error
names the rank and carries its traceback. No rank process outlives ``run()``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Protocol

import cloudpickle

from flyte_hvd.core.errors import RanksFailedError, RendezvousTimeoutError
from flyte_hvd.core.types import UserValue
from flyte_hvd.launch import failures as failure_kinds
from flyte_hvd.launch import messages, rendezvous, spare, stall
from flyte_hvd.launch.job import MAX_RESULT_ENV, Job
from flyte_hvd.launch.messages import RankOp
from flyte_hvd.launch.output import (
    ByteSink,
    OutputLog,
    OutputSink,
    RankOutput,
    console_sink,
)
from flyte_hvd.launch.rank_process import RankProcess

__all__ = ["ByteSink", "OutputLog", "OutputSink", "RankOutput", "console_sink"]

# Variables of an enclosing MPI launch: a rank inheriting them would join the wrong job.
_MPI_ENV_PREFIXES = ("PMI_", "PMIX_", "HYDRA_", "MPIR_", "OMPI_", "I_MPI_", "MPI_LOCALNRANKS")
# MPICH's settings (its netmod, shared memory off, ...) are the user's, not a launch's: kept.
_MPICH_SETTINGS_PREFIX = "MPIR_CVAR_"
_FAILURE_GRACE_S = 0.5


class Exchange(Protocol):
    """How a supervisor's ranks learn every rank's value in a rendezvous round."""

    def all_gather(self, rank: int, value: str) -> list[str]: ...

    def abort(self) -> None: ...


class LocalExchange:
    """Every rank of the run is supervised here: gather among them."""

    def __init__(self, size: int):
        self._size = size
        self._cond = threading.Condition()
        self._pending: dict[int, str] = {}
        self._rounds: list[list[str]] = []
        self._seen: dict[int, int] = {}
        self._aborted = False

    def all_gather(self, rank: int, value: str) -> list[str]:
        with self._cond:
            round_ = self._seen.get(rank, 0)
            self._seen[rank] = round_ + 1
            self._pending[rank] = value
            if len(self._pending) == self._size:
                self._rounds.append([self._pending[r] for r in range(self._size)])
                self._pending = {}
                self._cond.notify_all()
            while len(self._rounds) <= round_ and not self._aborted:
                self._cond.wait()
            if self._aborted:
                raise RuntimeError("rendezvous aborted")
            return self._rounds[round_]

    def abort(self) -> None:
        with self._cond:
            self._aborted = True
            self._cond.notify_all()


def find_mpiexec(single_host: bool = False) -> str:
    """The ``mpiexec`` of the ``mpich`` wheel beside this interpreter, else on ``PATH``.

    With ``single_host``, MPICH's ``mpiexec.gforker`` where there is one: it starts the rank
    with no network listener, where hydra's ``mpiexec`` listens on every interface."""
    names = ("mpiexec.gforker", "mpiexec") if single_host else ("mpiexec",)
    found = None
    for name in names:
        found = shutil.which(name, path=os.path.dirname(sys.executable)) or shutil.which(name)
        if found:
            break
    if not found:
        raise RuntimeError(
            f"`mpiexec` not found beside the Python interpreter ({sys.executable}) or on PATH: "
            f"install the MPICH wheel (`pip install mpich`) into the Python that runs the ranks "
            f"(for Spark executors, the one spark.pyspark.python / PYSPARK_PYTHON names)."
        )
    return found


def rank_start(extra_env: dict[str, str], single_host: bool) -> tuple[dict[str, str], list[str]]:
    """The environment (without the run's own entries) and command a rank process of this
    process starts with."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(_MPI_ENV_PREFIXES) or k.startswith(_MPICH_SETTINGS_PREFIX)
    }
    env.update(extra_env)
    env["PYTHONUNBUFFERED"] = "1"
    if single_host:
        # Every rank is on this machine: UCX needs no interface but loopback.
        env.setdefault("UCX_NET_DEVICES", "lo")
    mpiexec = find_mpiexec(single_host)
    return env, [mpiexec, "-n", "1", sys.executable, "-m", "flyte_hvd.launch.bootstrap"]


def start_spare_ahead(
    extra_env: dict[str, str], preload: tuple[str, ...], single_host: bool
) -> bool:
    """Starts a spare rank process for a run about to start here (``flyte_hvd.launch.spare``),
    unless spares are off or one started the same way is already idle; whether it started."""
    if not preload or not spare.enabled():
        return False
    env, command = rank_start(extra_env, single_host)
    if spare.has_idle(spare.key_of(env, tuple(preload), command)):
        return False
    spare.start(env, tuple(preload), command, work_base())
    return True


class RankSupervisor:
    """Runs ``job`` on ``ranks`` (of ``size``) and returns ``{rank: return value}``.

    Args:
        job: a ``FunctionJob`` or ``ProgramJob``, or its cloudpickle bytes.
        ranks: the ranks this supervisor starts; the rest are started by peers that take part
            in the same ``exchange``.
        exchange: backs the rendezvous rounds.
        secret: the run's secret; every supervisor of a run must pass the same one.
        start_timeout: seconds for every rank to start and join; the run fails after that.
        env: extra environment for the ranks.
        output: where the ranks' output bytes go as they are read (a ``ByteSink``: it must
            not block; by default a ``RankOutput`` on this process's console).
        single_host: every rank of the run is on this machine: start them with nothing
            listening on a network interface (``mpiexec.gforker``, UCX on loopback).
        watch: decides from the ranks' probe reports whether the run is stuck (see
            ``flyte_hvd.launch.stall``); by default one over this supervisor's ranks.
        preload: modules the ranks import first (e.g. ``("tensorflow",)``): after a run that
            ends well, this process keeps a spare rank process per rank with them imported,
            for the next run that starts its ranks the same way (``flyte_hvd.launch.spare``).
        address: this host's address as the run's other hosts reach it (a Spark task's
            executor address); rank 0's is ``MASTER_ADDR`` when the ranks span hosts
            (``flyte_hvd.launch.torch_env``).
        read_result: what ``run`` returns for a rank, from the rank and the file holding its
            pickled return value (by default the value, unpickled); the file is removed after.
    """

    def __init__(
        self,
        job: Job | bytes,
        ranks: list[int],
        size: int,
        exchange: Exchange,
        secret: str,
        start_timeout: float = 600.0,
        env: dict[str, str] | None = None,
        output: ByteSink | None = None,
        watch: stall.StallWatch | stall.ForwardWatch | None = None,
        output_log: OutputLog | None = None,
        timeout_hint: str = "`start_timeout` (or HOROVOD_SPARK_START_TIMEOUT)",
        single_host: bool = False,
        preload: tuple[str, ...] = (),
        address: str | None = None,
        read_result: Callable[[int, str], UserValue] | None = None,
    ):
        self.address = address
        self.read_result = read_result
        self.timeout_hint = timeout_hint
        self.preload = tuple(preload) if spare.enabled() else ()
        self.single_host = single_host
        self.job = job
        self.output_log = output_log
        self.ranks = {r: RankProcess(r) for r in ranks}
        self.size = size
        self.exchange = exchange
        self.secret = secret
        self.start_timeout = start_timeout
        self.env = dict(env or {})
        self._own_output = RankOutput() if output is None else None
        self.output: ByteSink = output or self._own_output.write  # type: ignore[union-attr]
        if watch is None and len(ranks) == size:
            watch = stall.StallWatch(size, stall.StallConfig.from_env({**os.environ, **self.env}))
        self.watch = watch or stall.ForwardWatch(lambda kind, rank, message: None)
        self._changed = threading.Condition()
        self._stopping = False
        self._cancelled: str | None = None
        self.started_at = 0.0
        self._stopping_for_failure = False
        self._oom_kills = failure_kinds.oom_kills()  # a SIGKILL with more of them later: OOM

    def run(self) -> dict[int, UserValue]:
        workdir = _private_dir()
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            control = os.path.join(workdir, CONTROL_SOCKET)
            server.bind(control)
            server.listen(len(self.ranks))
            job_path = os.path.join(workdir, "job.pkl")
            with open(job_path, "wb") as f:
                # Spark tasks pass the job already pickled on the driver.
                f.write(self.job if isinstance(self.job, bytes) else cloudpickle.dumps(self.job))
            threading.Thread(target=self._accept, args=(server,), daemon=True).start()
            self.started_at = time.monotonic()
            for state in self.ranks.values():
                self._spawn(state, control, job_path, workdir)
            self._wait()
            results = {r: self._load_result(workdir, r) for r in self.ranks}
        except BaseException:
            self._stopping_for_failure = True
            spare.stop_all()  # the run after a failure starts fresh
            raise
        finally:
            self._stop_all()
            server.close()
            shutil.rmtree(workdir, ignore_errors=True)
            for state in self.ranks.values():  # gone already, unless a rank died as MPI started
                rendezvous.remove_shm_segments(state.shm)
            if self._own_output is not None:
                self._own_output.close(keep=False)
        for state in self.ranks.values():  # the next run's ranks, if no rank asked earlier
            self._start_spare(state)
        return results

    def _start_spare(self, state: RankProcess) -> None:
        if self.preload and not state.spare_started and not self._stopping_for_failure:
            state.spare_started = True
            spare.start(
                state.spare_env, self.preload, state.command, work_base(), keep=len(self.ranks)
            )

    def cancel(self, reason: str) -> None:
        """Stop the ranks now, from any thread (e.g. the driver ended the run); a ``run`` still
        waiting raises ``RuntimeError(reason)``."""
        self._cancelled = reason
        self._notify()

    def timings(self) -> dict[int, dict[str, float]]:
        """Wall-clock times of each rank's start-up events (spawned, hello, joined, ...)."""
        return {r: dict(s.times) for r, s in self.ranks.items()}

    # -- starting ----------------------------------------------------------------------------

    def _spawn(self, state: RankProcess, control: str, job_path: str, workdir: str) -> None:
        env, state.command = rank_start(self.env, self.single_host)
        state.launcher_lingers = os.path.basename(state.command[0]) == "mpiexec.gforker"
        # The result limit is the run's, not the process's: it travels with the rank's
        # assignment, so a spare started before the run can take the rank.
        result_limit = env.pop(MAX_RESULT_ENV, "")
        # So is the rank's partition of the run's data (``run(fn, data=df)``).
        partition = env.pop(rendezvous.PARTITION_ENV, "")
        state.spare_env = dict(env)
        # The rank's own entries. Its temporary files live in the supervisor's folder, which
        # is removed on every path (see `_private_dir`).
        assignment = {
            "control": control,
            "rank": state.rank,
            "size": self.size,
            "job": job_path,
            "result": os.path.join(workdir, f"result.{state.rank}.pkl"),
            "tmpdir": os.path.join(workdir, "tmp"),
            "address": self.address or "",
            "result_limit": result_limit,
            "partition": partition,
        }
        if self.preload:
            key = spare.key_of(env, self.preload, state.command)
            left = self.started_at + self.start_timeout - time.monotonic()
            claimed = spare.claim(key, assignment, max(left, 1.0))
            if claimed is not None:
                state.proc, state.outputs = claimed
                state.times["spare_claimed"] = time.time()
        if state.proc is None:
            env.update(spare.rank_environment(assignment))
            state.start(env)
        state.times["spawned"] = time.time()
        state.start_pumps(self.output)

    # -- control socket ----------------------------------------------------------------------

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        state: RankProcess | None = None
        try:
            for line in conn.makefile("rb"):
                message = json.loads(line)
                op = message["op"]
                if op == RankOp.HELLO:
                    state = self.ranks.get(message["rank"])
                    if state is None:
                        return
                    state.conn, state.pid = conn, message["pid"]
                    state.times["hello"] = time.time()
                    # The secret travels only here, never in an environment or command line.
                    conn.sendall(rendezvous.encode(messages.secret_reply(self.secret)))
                elif state is None:
                    return
                elif op == RankOp.ALLGATHER:
                    values = self.exchange.all_gather(state.rank, message["value"])
                    conn.sendall(rendezvous.encode(messages.values_reply(values)))
                elif op == RankOp.JOINED:
                    state.times["joined"] = time.time()
                elif op == RankOp.WARM:
                    self._start_spare(state)
                elif op == RankOp.FAILED:
                    state.traceback = message["traceback"]
                    if self.output_log is not None:
                        for text in state.traceback.rstrip().splitlines():
                            self.output_log.write(state.rank, "stderr", text)
                    state.times["failed"] = time.time()
                elif op == RankOp.PROBE:
                    self.watch.probe(state.rank, message)
                elif op == RankOp.SHM:
                    state.shm = [str(n) for n in message["names"]]
                elif op == RankOp.DONE:
                    state.done = True
                    self.watch.ended(state.rank, "returned normally")
                self._notify()
        except (OSError, RuntimeError, ValueError):
            pass
        finally:
            self._notify()

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    # -- watching ----------------------------------------------------------------------------

    def _wait(self) -> None:
        deadline = self.started_at + self.start_timeout
        first_failure_at: float | None = None
        while True:
            if self._cancelled is not None:
                self._stop_all()
                raise RuntimeError(self._cancelled)
            failed = [s for s in self.ranks.values() if s.failed()]
            for s in failed:
                s.times.setdefault("failed", time.time())
            if failed and first_failure_at is None:
                first_failure_at = time.monotonic()
            if (
                first_failure_at is not None
                and time.monotonic() - first_failure_at >= _FAILURE_GRACE_S
            ):
                self._raise_failures()
            if not failed:
                for s in self.ranks.values():
                    s.end_launcher_if_rank_gone()
            if not failed and all(s.proc and s.exit_code() == 0 for s in self.ranks.values()):
                for s in self.ranks.values():
                    for pump in s.pumps:
                        pump.join(timeout=5)
                if not any(s.exit_string for s in self.ranks.values()):
                    return
                continue  # a rank was killed, though its launcher exited 0 (gforker)
            for s in self.ranks.values():
                if s.exit_code() == 0 and not s.done:
                    self.watch.ended(s.rank, "exited with status 0 without returning a result")
            verdict = None if failed else self.watch.check()
            if verdict is not None:
                self._raise_stuck(*verdict)
            joined = all("joined" in s.times for s in self.ranks.values())
            if not joined and not failed and time.monotonic() > deadline:
                self._raise_timeout()
            with self._changed:
                self._changed.wait(timeout=0.05)

    def _raise_failures(self) -> None:
        self._stop_all()
        failures: dict[int, str] = {}
        orphans = []
        for state in self.ranks.values():
            if state.traceback is not None:
                failures[state.rank] = state.traceback
                continue
            code = state.exit_code()
            if code in (None, 0) or "killed_by_us" in state.times:
                continue
            if code == rendezvous.ORPHANED_EXIT:
                orphans.append(state.rank)
                continue
            failures[state.rank] = state.death_text(code, self._oom_kills)
        if not failures:
            failures = {r: "lost its supervisor connection" for r in orphans}
        first = first_failure(failures, lambda r: self.ranks[r].times.get("failed", float("inf")))
        raise RanksFailedError(failures, summary=f"rank {first} failed; the run was stopped")

    def _raise_stuck(self, rank: int, message: str) -> None:
        self._stop_all()
        raise RanksFailedError({rank: message}, summary=f"rank {rank} failed; the run was stopped")

    def _raise_timeout(self) -> None:
        waiting = sorted(r for r, s in self.ranks.items() if "joined" not in s.times)
        unconnected = sorted(r for r, s in self.ranks.items() if "hello" not in s.times)
        self._stop_all()
        detail = (
            f"ranks {unconnected} never started"
            if unconnected
            else f"ranks {waiting} started but did not complete the rendezvous (are all "
            f"{self.size} ranks running?)"
        )
        raise RendezvousTimeoutError(
            f"ranks did not join within start_timeout={self.start_timeout:g}s: {detail}. "
            f"Raise {self.timeout_hint} if the machines are slow."
        )

    def _stop_all(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        self.exchange.abort()
        for state in self.ranks.values():
            if state.proc is None or state.proc.poll() is not None:
                continue
            state.times["killed_by_us"] = time.time()
            if state.pid is not None:
                _kill(state.pid, signal.SIGKILL)
            if state.launcher_lingers:
                # Asked to stop, mpiexec.gforker often sleeps a second after its rank is gone,
                # and a failed run waits for every stopped rank.
                state.kill_launcher_session()
            else:  # hydra's mpiexec ends its proxy and removes its files itself
                _kill(state.proc.pid, signal.SIGTERM)
        for state in self.ranks.values():
            if state.conn is not None:
                _close(state.conn)
            if state.proc is None:
                continue
            try:
                state.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                state.proc.kill()
                state.proc.wait()
            for pump in state.pumps:
                pump.join(timeout=5)

    def _load_result(self, workdir: str, rank: int) -> UserValue:
        path = os.path.join(workdir, f"result.{rank}.pkl")
        if not os.path.exists(path):
            raise RanksFailedError(
                {rank: "exited with status 0 but reported no result (did it call os._exit?)"}
            )
        if self.read_result is not None:
            return self.read_result(rank, path)
        with open(path, "rb") as f:
            return cloudpickle.load(f)


_SIGNALLED_TEXT = re.compile(r"^rank \d+ died: .*\(signal (\d+)\)")


def first_failure(failures: dict[int, str], order: Callable[[int], float] = float) -> int:
    """The rank a failed run's error names first: one that a signal killed, else the first
    by ``order`` (the time its failure was seen; by default the rank itself).

    A signal that ended a rank is never a peer's doing (the launcher's own kills are not
    failures), while a peer's error often is its consequence: gloo raises "Connection closed
    by peer" in every rank that was talking to the one the kernel killed, as soon as it dies
    and before its launcher has seen it go. SIGABRT is the exception: NCCL's watchdog and
    other libraries abort a process when a peer fails."""

    return min(failures, key=lambda r: (not killed_by_signal(failures[r]), order(r)))


def killed_by_signal(failure: str) -> bool:
    """Whether a rank's failure text says a signal other than SIGABRT ended it: the cause of
    a failed run, never a consequence (see ``first_failure``)."""
    match = _SIGNALLED_TEXT.match(failure)
    return match is not None and int(match.group(1)) != signal.SIGABRT


def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _close(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)
    conn.close()


WORKDIR_PREFIX = "flyte-hvd-run-"
CONTROL_SOCKET = "ctl"  # short: AF_UNIX paths are at most 107 bytes
_STALE_AFTER_S = 60.0


def work_base() -> str:
    """Where a supervisor's private folder goes: inside a Spark task, Spark's own scratch
    folder of this application (``SPARK_LOCAL_DIRS``, removed by Spark when the executor
    stops, even if this task's process is killed); elsewhere the temp folder."""
    for path in os.environ.get("SPARK_LOCAL_DIRS", "").split(","):
        if path and os.path.isdir(path) and os.access(path, os.W_OK):
            return path
    return tempfile.gettempdir()


def _private_dir() -> str:
    """A 0700 folder for the control socket, the job, the results and the ranks' ``TMPDIR``.

    Whoever outlives the supervisor removes it: the supervisor itself, else its orphaned
    ranks or one that starts too late to connect (``rendezvous.ControlClient``), else the
    next supervisor that starts in the same folder (``sweep_stale``), else Spark with its
    scratch folder.
    """
    base = work_base()
    sweep_stale(base)
    path = tempfile.mkdtemp(prefix=WORKDIR_PREFIX, dir=base)
    if len(os.path.join(path, CONTROL_SOCKET)) > 100:
        os.rmdir(path)
        path = tempfile.mkdtemp(prefix=WORKDIR_PREFIX, dir="/tmp")
    os.mkdir(os.path.join(path, "tmp"), 0o700)
    return path


def sweep_stale(base: str) -> list[str]:
    """Remove supervisors' folders in ``base`` whose supervisor is gone (its control socket
    refuses connections); returns what was removed."""
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(base):
            path = os.path.join(base, name)
            if not name.startswith(WORKDIR_PREFIX) or not _abandoned(path):
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _abandoned(path: str) -> bool:
    try:
        info = os.stat(path)
    except OSError:
        return False
    if info.st_uid != os.getuid() or time.time() - info.st_mtime < _STALE_AFTER_S:
        return False
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(os.path.join(path, CONTROL_SOCKET))
    except OSError:
        return True  # no socket, or nobody listens on it
    finally:
        probe.close()
    return False


def new_secret() -> str:
    return secrets.token_hex(32)


def launch_local(
    job: Job,
    num_proc: int,
    start_timeout: float = 60.0,
    env: dict[str, str] | None = None,
    output: OutputSink | None = None,
    timeout_hint: str = "`start_timeout`",
) -> list[UserValue]:
    """Run ``job`` on ``num_proc`` rank processes on this machine; results in rank order.

    If a rank fails, the error keeps every rank's output in a file it names."""
    if not isinstance(num_proc, int) or isinstance(num_proc, bool) or num_proc < 1:
        raise ValueError(f"`num_proc` must be an int >= 1; found {num_proc!r}.")
    check_start_timeout(start_timeout)
    shown = RankOutput(display=output)
    supervisor = RankSupervisor(
        job,
        ranks=list(range(num_proc)),
        size=num_proc,
        exchange=LocalExchange(num_proc),
        secret=new_secret(),
        start_timeout=start_timeout,
        env=env,
        output=shown.write,
        output_log=shown.log,
        timeout_hint=timeout_hint,
        single_host=True,
    )
    try:
        results = supervisor.run()
    except RanksFailedError as error:
        raise RanksFailedError(error.failures, error.summary, shown.close(keep=True)) from None
    finally:
        shown.close(keep=False)
    return [results[r] for r in range(num_proc)]


def check_start_timeout(start_timeout: object) -> float:
    """The one check of a ``start_timeout`` (every launcher's): seconds > 0."""
    if isinstance(start_timeout, bool) or not isinstance(start_timeout, int | float):
        raise ValueError(f"`start_timeout` must be seconds > 0; found {start_timeout!r}.")
    if not start_timeout > 0:
        raise ValueError(f"`start_timeout` must be seconds > 0; found {start_timeout}.")
    return float(start_timeout)


def start_timeout_from_env(name: str, default: float) -> float:
    """A launcher's default ``start_timeout``: the environment variable ``name``, else
    ``default``."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise ValueError(f"{name}={raw!r}: expected seconds > 0, e.g. 120.")
    return value
