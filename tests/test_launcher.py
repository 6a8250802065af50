"""The rank bootstrap and its launchers outside Spark: ``flyte-hvd-run`` and ``launch_local``."""

from __future__ import annotations

import os
import threading
import time

import pytest

from flyte_hvd.core.errors import RanksFailedError, RendezvousTimeoutError
from flyte_hvd.launch.job import FunctionJob, ProgramJob
from flyte_hvd.launch.supervisor import LocalExchange, RankSupervisor, launch_local

pytestmark = pytest.mark.mpi

ALLREDUCE_PROGRAM = (
    "import flyte_hvd.core as hvd, numpy as np; hvd.init(); "
    "print('rank', hvd.rank(), 'of', hvd.size(), hvd.allreduce(np.ones(2) * hvd.rank(), "
    "op=hvd.Sum).tolist())"
)


def test_cli_runs_program_on_ranks_with_prefixed_output(cli, no_leftover_ranks):
    result = cli("-np", "3", "python", "-c", ALLREDUCE_PROGRAM)
    assert result.returncode == 0, result.stderr
    for r in range(3):
        assert f"[{r}]<stdout>:rank {r} of 3 [3.0, 3.0]" in result.stdout


def test_cli_accepts_double_dash_and_scripts(cli, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import sys, flyte_hvd.core as hvd\nhvd.init()\nprint(hvd.rank(), sys.argv[1:])\n"
    )
    result = cli("-np", "2", "--", "python", str(script), "--epochs", "3")
    assert result.returncode == 0, result.stderr
    assert "[1]<stdout>:1 ['--epochs', '3']" in result.stdout


def test_cli_failure_names_rank_and_stops_others(cli, no_leftover_ranks):
    program = (
        "import time, flyte_hvd.core as hvd, numpy as np; hvd.init()\n"
        "if hvd.rank() == 1: raise ValueError('bad batch on rank one')\n"
        "hvd.allreduce(np.ones(3))  # the others block here until stopped\n"
        "time.sleep(600)\n"
    )
    started = time.monotonic()
    result = cli("-np", "3", "python", "-c", program, timeout=60)
    assert time.monotonic() - started < 30
    assert result.returncode == 1
    assert "rank 1 failed" in result.stderr
    assert "ValueError: bad batch on rank one" in result.stderr
    assert "--- rank 0 ---" not in result.stderr  # stopped ranks are not blamed


def test_cli_reports_rank_killed_by_signal(cli, no_leftover_ranks):
    program = (
        "import os, signal, time, flyte_hvd.core as hvd; hvd.init()\n"
        "if hvd.rank() == 0: os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(600)\n"
    )
    result = cli("-np", "2", "python", "-c", program, timeout=60)
    assert result.returncode == 1
    assert "rank 0 died: Killed (signal 9)" in result.stderr


def test_cli_rejects_non_python_command(cli):
    result = cli("-np", "2", "bash", "train.sh")
    assert result.returncode == 2
    assert "expected a Python program" in result.stderr


def test_cli_rejects_bad_np(cli):
    result = cli("-np", "0", "python", "-c", "pass")
    assert result.returncode == 2
    assert "-np must be >= 1" in result.stderr


def test_cli_refuses_a_start_timeout_that_is_not_seconds(cli, monkeypatch):
    monkeypatch.setenv("HOROVOD_START_TIMEOUT", "soon")
    result = cli("-np", "2", "python", "-c", "pass")
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "flyte-hvd-run: HOROVOD_START_TIMEOUT='soon': expected seconds > 0, e.g. 120."
    )


def test_launch_local_returns_values_in_rank_order(no_leftover_ranks):
    def fn(offset):
        import flyte_hvd.core as hvd

        hvd.init()
        return hvd.rank() + offset, hvd.size(), os.environ["HOROVOD_RANK"]

    assert launch_local(FunctionJob(fn, (10,)), 3) == [(10, 3, "0"), (11, 3, "1"), (12, 3, "2")]


@pytest.mark.parametrize("first", ["broadcast", "broadcast_object", "allgather", "alltoall"])
def test_any_collective_may_come_first(first):
    def fn():
        import numpy as np

        import flyte_hvd.core as hvd

        hvd.init()
        call = {
            "broadcast": lambda: hvd.broadcast(np.arange(2), root_rank=1).tolist(),
            "broadcast_object": lambda: hvd.broadcast_object("hi", root_rank=0),
            "allgather": lambda: hvd.allgather(np.array([hvd.rank()])).tolist(),
            "alltoall": lambda: hvd.alltoall(np.arange(2) + 10 * hvd.rank())[0].tolist(),
        }[first]
        return call()

    results = launch_local(FunctionJob(fn), 2)
    assert (
        results[0]
        == {
            "broadcast": [0, 1],
            "broadcast_object": "hi",
            "allgather": [0, 1],
            "alltoall": [0, 10],
        }[first]
    )


def test_five_ranks_join_in_order(no_leftover_ranks):
    def fn():
        import flyte_hvd.core as hvd

        hvd.init()
        return hvd.rank(), hvd.allgather_object(hvd.rank())

    assert launch_local(FunctionJob(fn), 5) == [(r, [0, 1, 2, 3, 4]) for r in range(5)]


@pytest.mark.parametrize("bad", [0, -1, 2.0, "2", True])
def test_launch_local_rejects_bad_num_proc(bad):
    with pytest.raises(ValueError, match="num_proc"):
        launch_local(FunctionJob(print), bad)


def test_secret_is_in_no_environment_or_command_line(no_leftover_ranks):
    secret = "s3cr3t-" + os.urandom(8).hex()

    def fn():
        def read(pid, what):
            with open(f"/proc/{pid}/{what}", "rb") as f:
                return f.read().decode(errors="replace")

        chain, pid = [], os.getpid()
        for _ in range(3):  # the rank, hydra's proxy, mpiexec
            chain.append((read(pid, "cmdline"), read(pid, "environ")))
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        # (FLYTE_HVD_TEST_SESSION marks this test session's processes: tests/conftest.py)
        own = {k: v for k, v in os.environ.items() if k.startswith("FLYTE_HVD")}
        return chain, {k: v for k, v in own.items() if k != "FLYTE_HVD_TEST_SESSION"}

    supervisor = RankSupervisor(
        FunctionJob(fn), ranks=[0, 1], size=2, exchange=LocalExchange(2), secret=secret
    )
    for chain, env in supervisor.run().values():
        assert any("mpiexec" in cmdline for cmdline, _ in chain), chain
        for cmdline, environ in chain:
            assert secret not in cmdline
            assert secret not in environ
        assert env == {}


def test_rank_with_wrong_secret_is_rejected(no_leftover_ranks):
    exchange = LocalExchange(2)
    errors: dict[int, BaseException] = {}

    def supervise(rank, secret):
        supervisor = RankSupervisor(
            FunctionJob(print), [rank], 2, exchange, secret=secret, start_timeout=30
        )
        try:
            supervisor.run()
        except BaseException as e:
            errors[rank] = e

    threads = [
        threading.Thread(target=supervise, args=(0, "right")),
        threading.Thread(target=supervise, args=(1, "wrong")),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert set(errors) == {0, 1}
    for error in errors.values():
        assert isinstance(error, RanksFailedError)
        assert "do not hold this run's secret" in str(error)


def test_missing_rank_times_out_with_clear_message(no_leftover_ranks):
    supervisor = RankSupervisor(
        FunctionJob(print), [0], 2, LocalExchange(2), secret="x", start_timeout=3
    )
    started = time.monotonic()
    with pytest.raises(RendezvousTimeoutError, match=r"did not join within start_timeout=3s"):
        supervisor.run()
    assert time.monotonic() - started < 15


def test_cancel_stops_the_ranks_and_run_raises_the_reason(no_leftover_ranks):
    def fn():
        import time

        import flyte_hvd.core as hvd

        hvd.init()
        time.sleep(300)

    supervisor = RankSupervisor(FunctionJob(fn), [0, 1], 2, LocalExchange(2), secret="x")
    # Cancelled once both ranks run the job (the driver ending a run does this any time).
    cancel = threading.Thread(
        target=lambda: (
            _until(lambda: all("joined" in t for t in supervisor.timings().values())),
            supervisor.cancel("the Spark driver ended the run"),
        )
    )
    cancel.start()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^the Spark driver ended the run$"):
        supervisor.run()
    cancel.join()
    assert time.monotonic() - started < 30


def _until(condition, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_failure_error_pickles_with_ranks():
    import pickle

    error = RanksFailedError({2: "Traceback ...\nKeyError: 'x'"}, summary="rank 2 failed")
    copy = pickle.loads(pickle.dumps(error))
    assert copy.failures == {2: "Traceback ...\nKeyError: 'x'"}
    assert "rank 2 failed" in str(copy) and "KeyError" in str(copy)


@pytest.mark.parametrize(
    ("command", "argv"),
    [
        (["python", "train.py", "--lr", "1"], ["train.py", "--lr", "1"]),
        (["/usr/bin/python3.11", "-m", "pkg.mod"], ["-m", "pkg.mod"]),
        (["python", "-c", "print(1)"], ["-c", "print(1)"]),
        (["train.py"], ["train.py"]),
    ],
)
def test_program_job_parses_python_commands(command, argv):
    assert ProgramJob.from_command(command).argv == argv


@pytest.mark.parametrize("command", [[], ["bash", "x.sh"], ["python"], ["python", "-m"]])
def test_program_job_rejects_other_commands(command):
    with pytest.raises(ValueError):
        ProgramJob.from_command(command)


def test_rank_with_another_flyte_hvd_than_the_drivers_fails_before_it_joins(
    cli, monkeypatch, no_leftover_ranks
):
    """A rank given the Spark driver's version (``flyte_hvd.spark`` sets it) compares its own
    flyte_hvd with it before it joins the others or loads the job."""
    from flyte_hvd.launch.environment import DRIVER_VERSION_ENV

    monkeypatch.setenv(DRIVER_VERSION_ENV, "0.0.1.dev0")
    started = time.monotonic()
    result = cli("-np", "2", "python", "-c", "print('ran')")
    elapsed = time.monotonic() - started
    assert result.returncode != 0
    assert "ran" not in result.stdout
    assert "but flyte_hvd 0.0.1.dev0 on the Spark driver" in result.stderr, result.stderr
    assert "in rank 0 (imported from" in result.stderr or "in rank 1 (" in result.stderr
    assert elapsed < 30, f"{elapsed:.1f}s to the error"


def test_a_rank_whose_supervisor_is_gone_removes_its_folder(tmp_path):
    """A supervisor killed while its rank started (its Spark task cancelled) leaves a control
    socket nobody listens on: the rank, refused, removes the folder, since nobody else will."""
    import socket

    from flyte_hvd.launch.rendezvous import ControlClient
    from flyte_hvd.launch.supervisor import CONTROL_SOCKET, WORKDIR_PREFIX

    folder = tmp_path / f"{WORKDIR_PREFIX}gone"
    (folder / "tmp").mkdir(parents=True)
    path = str(folder / CONTROL_SOCKET)
    bound = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    bound.bind(path)  # the socket file stays; without listen() a connect is refused
    bound.close()
    with pytest.raises(ConnectionRefusedError):
        ControlClient(path, 0)
    assert not folder.exists()


def _lingering_launcher(rank_code: str):
    """A launcher like ``mpiexec.gforker`` when it lags: it starts the "rank" (a Python child
    that prints its pid and runs ``rank_code``), and lingers for a minute after the rank is
    gone before it exits 0."""
    import subprocess
    import sys

    from flyte_hvd.launch.rank_process import RankProcess

    state = RankProcess(0)
    state.launcher_lingers = True
    rank = f"import os; print(os.getpid(), flush=True); {rank_code}"
    launcher = ["sh", "-c", f'"{sys.executable}" -c "$0"; sleep 60', rank]
    state.proc = subprocess.Popen(launcher, stdout=subprocess.PIPE, start_new_session=True)
    assert state.proc.stdout is not None
    state.pid = int(state.proc.stdout.readline())
    return state


def test_a_launcher_lingering_after_its_rank_returned_and_exited_is_ended():
    """The rank has reported its result and its own process is gone: its launcher is ended at
    once (``mpiexec.gforker`` can sleep a second before it exits, a second added to every
    run), with its session, and the rank counts as having exited 0."""
    state = _lingering_launcher("pass")
    state.done = True
    deadline = time.monotonic() + 10
    while state.exit_code() is None and time.monotonic() < deadline:
        state.end_launcher_if_rank_gone()
        time.sleep(0.02)
    assert state.launcher_ended and state.exit_code() == 0 and not state.failed()
    assert time.monotonic() < deadline


@pytest.mark.parametrize("done", [False, True], ids=["not returned", "still running"])
def test_a_launcher_is_left_alone_until_its_rank_returned_and_exited(done):
    """No result yet (the rank is gone without one: its launcher says how it ended), or the
    rank's process still runs (MPI_Finalize, say): the launcher stays."""
    state = _lingering_launcher("pass" if not done else "import time; time.sleep(60)")
    state.done = done
    try:
        time.sleep(0.3)  # the rank without a result is gone by now
        state.end_launcher_if_rank_gone()
        assert state.proc.poll() is None and not state.launcher_ended
    finally:
        os.killpg(state.proc.pid, 9)
        state.proc.wait()


def test_a_run_ends_as_its_ranks_exit(no_leftover_ranks):
    """Two ranks that return at once end the run in well under the second that
    ``mpiexec.gforker`` can take to exit after each of them (``launch_local`` measured 2.0 s
    for two ranks before, 0.4 s after; the bound leaves room for a busy machine)."""
    launch_local(FunctionJob(lambda: None), 2)  # the bytecode and page cache warm
    started = time.monotonic()
    for _ in range(3):
        assert launch_local(FunctionJob(lambda: 1), 2) == [1, 1]
    assert (time.monotonic() - started) / 3 < 1.5


def test_a_failed_run_stops_the_other_ranks_at_once(no_leftover_ranks):
    """The supervisor stops the ranks still running with their launchers' whole sessions: asked
    to stop, ``mpiexec.gforker`` often slept a second after its rank was gone, a second added
    to every failed run (``launch_local`` measured 2.0 s from the call to the error before,
    0.75 s after; the bound leaves room for a busy machine)."""

    def fails_on_rank_one():  # defined here: it travels by value
        import flyte_hvd.core as hvd

        hvd.init()
        if hvd.rank() == 1:
            raise ValueError("bad batch on rank one")
        time.sleep(600)  # rank 0 runs on until the supervisor stops it

    launch_local(FunctionJob(lambda: None), 2)  # the bytecode and page cache warm
    started = time.monotonic()
    for _ in range(3):
        with pytest.raises(RanksFailedError, match="bad batch on rank one"):
            launch_local(FunctionJob(fails_on_rank_one), 2)
    assert (time.monotonic() - started) / 3 < 1.5


def test_a_launcher_that_exits_by_itself_is_left_to_end():
    """Hydra's ``mpiexec`` (ranks across hosts) exits as soon as its rank has, and removes its
    temporary files only when it ends by itself or on SIGTERM: it is never ended early."""
    state = _lingering_launcher("pass")
    state.launcher_lingers = False
    state.done = True
    try:
        time.sleep(0.3)  # the rank is gone by now
        state.end_launcher_if_rank_gone()
        assert state.proc.poll() is None and not state.launcher_ended
    finally:
        os.killpg(state.proc.pid, 9)
        state.proc.wait()
