"""The fault matrix: each fault under each launcher where it applies, asserting the time until
the user sees the error, what the error says, and that no process, temporary file or folder
is left. Every case prints ``FAULT <launcher> <case>: <seconds>s`` (run with ``-s`` to see
the matrix).

Processes and folders are told apart from other runs on the machine by a mark in the
environment (processes) and a private ``TMPDIR`` (the ``flyte-hvd-run`` cases).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from types import SimpleNamespace

import cloudpickle
import numpy as np
import pytest
from conftest import REPO, idle_spares, rank_processes
from needs import require

from flyte_hvd.core.errors import RanksFailedError
from flyte_hvd.core.state import CHECK_ENV, SHM_ENV
from flyte_hvd.launch import messages, stall
from flyte_hvd.launch.supervisor import WORKDIR_PREFIX, sweep_stale

# The rank functions below travel by value: the ranks cannot import this test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

MARK = "FLYTE_HVD_FAULT_MARK"
CLI = os.path.join(os.path.dirname(sys.executable), "flyte-hvd-run")

EARLY_RETURN = (
    "import sys, numpy as np, flyte_hvd.core as hvd\n"
    "hvd.init()\n"
    "if hvd.rank() == 1: sys.exit(0)\n"
    "hvd.allreduce(np.ones(3))\n"
)
ONE_COLLECTIVE_FEWER = (
    "import numpy as np, flyte_hvd.core as hvd\n"
    "hvd.init()\n"
    "hvd.allreduce(np.ones(3))\n"
    "if hvd.rank() == 0: hvd.allreduce(np.ones(3))\n"
)
HANGS_BEFORE_COLLECTIVE = (
    "import time, numpy as np, flyte_hvd.core as hvd\n"
    "hvd.init()\n"
    "if hvd.rank() == 1: time.sleep(300)\n"
    "hvd.allreduce(np.ones(3))\n"
)
HANGS_AFTER_OTHERS_RETURN = (
    "import time, numpy as np, flyte_hvd.core as hvd\n"
    "hvd.init()\n"
    "hvd.allreduce(np.ones(3))\n"
    "if hvd.rank() == 1: time.sleep(300)\n"
)
BARRIER_VS_ALLREDUCE = (
    "import numpy as np, flyte_hvd.core as hvd\n"
    "hvd.init()\n"
    "hvd.allreduce(np.ones(3)) if hvd.rank() == 0 else hvd.barrier()\n"
)
RAISES = (
    "import time, flyte_hvd.core as hvd\n"
    "hvd.init()\n"
    "print('step output of rank', hvd.rank())\n"
    "if hvd.rank() == 1: raise ValueError('bad batch on rank one')\n"
    "time.sleep(300)\n"
)
SLEEPS = (
    "import time, flyte_hvd.core as hvd\nhvd.init()\nprint('ready', flush=True)\ntime.sleep(300)\n"
)
FAST_STALL = {stall.CHECK_TIME_ENV: "1", stall.SHUTDOWN_TIME_ENV: "3"}


def marked_processes(mark: str) -> list[str]:
    """Live processes (rank, mpiexec, hydra proxy) whose environment carries ``mark``."""
    found = []
    needle = f"{MARK}={mark}".encode()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{pid} {args}")
        except OSError:
            continue
    return found


def assert_nothing_left(mark: str, folder: str | None = None, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while True:
        procs = marked_processes(mark)
        files = sorted(os.listdir(folder)) if folder else []
        if not procs and not files:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"left behind: processes {procs}, files {files} in {folder}")
        time.sleep(0.2)


def output_log_of(text: str) -> str | None:
    for line in text.splitlines():
        if line.startswith("full output of every rank: "):
            return line.split(": ", 1)[1].strip()
    return None


class Cli:
    """``flyte-hvd-run`` with a private TMPDIR and a process mark."""

    def __init__(self, tmp_path):
        self.mark = uuid.uuid4().hex
        # Short, so the run's socket path fits AF_UNIX's limit and its folder goes here.
        self.tmp = tempfile.mkdtemp(prefix="fx-", dir="/tmp")

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return {**os.environ, MARK: self.mark, "TMPDIR": self.tmp, **(extra or {})}

    def run(self, program: str, np_: int = 2, extra_env=None, args=(), timeout: float = 60):
        started = time.monotonic()
        result = subprocess.run(
            [CLI, "-np", str(np_), *args, "python", "-c", program],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=REPO,
            env=self.env(extra_env),
        )
        return result, time.monotonic() - started

    def clean(self, stderr: str) -> None:
        """Remove the output file a failure kept (it is meant for the user), then check."""
        log = output_log_of(stderr)
        if log:
            assert os.path.dirname(log) == self.tmp
            os.remove(log)
        assert_nothing_left(self.mark, self.tmp)
        os.rmdir(self.tmp)


def report(launcher: str, case: str, seconds: float) -> None:
    print(f"\nFAULT {launcher} {case}: {seconds:.1f}s")


# -- flyte-hvd-run ---------------------------------------------------------------------------


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "case, program",
    [("rank returns early", EARLY_RETURN), ("one collective fewer", ONE_COLLECTIVE_FEWER)],
)
def test_cli_rank_ending_while_others_wait_fails_within_seconds(tmp_path, case, program):
    cli = Cli(tmp_path)
    result, took = cli.run(program)
    report("flyte-hvd-run", case, took)
    assert result.returncode == 1, result.stderr
    assert "rank 1 ended (returned normally) while ranks [0] wait for it in `allreduce`" in (
        result.stderr
    )
    assert took < 20
    cli.clean(result.stderr)


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_cli_stall_warns_then_stops_after_shutdown_time(tmp_path):
    cli = Cli(tmp_path)
    result, took = cli.run(HANGS_BEFORE_COLLECTIVE, np_=3, extra_env=FAST_STALL)
    report("flyte-hvd-run", "rank hangs before a collective (stall 1s/3s)", took)
    assert result.returncode == 1, result.stderr
    assert "stall: ranks [" in result.stderr  # the warning, before the error
    assert "stall: ranks [0, 2] have waited 3s in `allreduce`" in result.stderr
    assert "ranks [1] are not there (rank 1 at <string>:3 in <module>)" in result.stderr
    assert "The run was stopped after 3s (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS)" in result.stderr
    assert "flyte-hvd-run: rank 1 failed" in result.stderr
    assert took < 25
    cli.clean(result.stderr)


def test_every_rank_waiting_in_one_collective_is_a_stall_only_when_called_from_different_places():
    """All ranks in the same collective from one place are a slow call; from several places
    (calls that no longer match, which only the argument check refuses) they never end."""
    lines = []
    watch = stall.StallWatch(2, stall.StallConfig(check_s=1.0, shutdown_s=2.0), lines.append)
    for rank in (0, 1):
        watch.probe(rank, messages.probe("allreduce", 3.0, "train.py:10 in step"))
    assert watch.check() is None and lines == []
    watch.probe(1, messages.probe("allreduce", 3.0, "train.py:12 in step"))
    blame, error = watch.check()
    assert blame == 0
    assert error.startswith(
        "stall: ranks [0, 1] have waited 3s in `allreduce` (rank 0 at train.py:10 in step; "
        "rank 1 at train.py:12 in step); every rank waits there, but called from different "
        "places: they must match. The run was stopped after 2s"
    ), error


def test_every_rank_waiting_at_one_place_is_a_stall_only_when_given_different_arrays():
    lines = []
    watch = stall.StallWatch(2, stall.StallConfig(check_s=1.0, shutdown_s=2.0), lines.append)
    for rank, given in ((0, "float64 shape (3,)"), (1, None)):  # rank 1's: not known
        watch.probe(rank, messages.probe("allreduce", 3.0, "train.py:10 in step", None, given))
    assert watch.check() is None and lines == []
    watch.probe(
        1, messages.probe("allreduce", 3.0, "train.py:10 in step", None, "float64 shape (3,)")
    )
    assert watch.check() is None and lines == []
    watch.probe(
        1, messages.probe("allreduce", 3.0, "train.py:10 in step", None, "float64 shape (4,)")
    )
    blame, error = watch.check()
    assert blame == 0
    assert error.startswith(
        "stall: ranks [0, 1] have waited 3s in `allreduce` (rank 0 at train.py:10 in step with "
        "float64 shape (3,); rank 1 at train.py:10 in step with float64 shape (4,)); every rank "
        "waits there, but given different arrays: they must match. The run was stopped after 2s"
    ), error


def test_what_a_waiting_collective_was_given_reads_as_the_ranks_must_match_it():
    def collective(array=None, arrays=None, root_rank=None, process_set=None, obj=None):
        return sys._getframe()  # a frame with a collective's arguments

    def waiting_in(name, **arguments):
        return stall._arguments(collective(**arguments), name)

    ones = np.ones((5, 3), np.float32)
    assert waiting_in("allreduce", array=ones) == "float32 shape (5, 3)"
    assert waiting_in("allgather_on", array=ones) == "float32 shape (*, 3)"  # ragged rows
    assert waiting_in("broadcast", array=np.ones(2), root_rank=1) == "float64 shape (2,), root 1"
    assert waiting_in("grouped_allreduce", arrays=[ones, ones]) == "2 arrays of 30 elements"
    assert (
        waiting_in("allreduce", array=ones, process_set=SimpleNamespace(process_set_id=3)) is None
    )
    assert waiting_in("broadcast_object", obj={"a": 1}) is None
    assert waiting_in("barrier") is None


# Without the argument check, a 3-element allreduce against a 256 Ki-element one waits forever
# in MPI on both ranks, called from one line or from two.
_UNMATCHED_CALLS = {
    "at one place, other shapes": (
        "hvd.allreduce(np.ones(3 if hvd.rank() == 0 else 1 << 18))\n",
        "rank 0 at <string>:3 in <module> with float64 shape (3,); rank 1 at <string>:3 in "
        "<module> with float64 shape (262144,)); every rank waits there, but given different "
        "arrays: they must match.",
    ),
    "from different places": (
        "if hvd.rank() == 0: hvd.allreduce(np.ones(3))\nelse: hvd.allreduce(np.ones(1 << 18))\n",
        "rank 0 at <string>:3 in <module> with float64 shape (3,); rank 1 at <string>:4 in "
        "<module> with float64 shape (262144,)); every rank waits there, but called from "
        "different places: they must match.",
    ),
}


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(_UNMATCHED_CALLS))
def test_cli_unchecked_calls_that_no_longer_match_end_by_the_stall_bound(tmp_path, case):
    calls, expected = _UNMATCHED_CALLS[case]
    cli = Cli(tmp_path)
    program = "import numpy as np, flyte_hvd.core as hvd\nhvd.init()\n" + calls
    unchecked = {**FAST_STALL, CHECK_ENV: "0", SHM_ENV: "off"}
    result, took = cli.run(program, extra_env=unchecked)
    report("flyte-hvd-run", f"unchecked calls {case} (stall 1s/3s)", took)
    assert result.returncode == 1, result.stderr
    assert (
        f"stall: ranks [0, 1] have waited 3s in `allreduce` ({expected} The run was stopped "
        "after 3s"
    ) in result.stderr, result.stderr
    assert took < 25
    cli.clean(result.stderr)


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_cli_rank_hanging_after_others_returned_is_bounded(tmp_path):
    cli = Cli(tmp_path)
    result, took = cli.run(HANGS_AFTER_OTHERS_RETURN, extra_env=FAST_STALL)
    report("flyte-hvd-run", "rank hangs after the others returned (stall 1s/3s)", took)
    assert result.returncode == 1, result.stderr
    assert "stall: ranks [0] finished" in result.stderr
    assert "ranks [1] are still running (rank 1 at <string>:4 in <module>)" in result.stderr
    assert took < 25
    cli.clean(result.stderr)


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_cli_barrier_against_allreduce_raises_mismatch(tmp_path):
    cli = Cli(tmp_path)
    result, took = cli.run(BARRIER_VS_ALLREDUCE)
    report("flyte-hvd-run", "barrier against allreduce", took)
    assert result.returncode == 1, result.stderr
    assert "CollectiveMismatchError" in result.stderr
    assert "rank 1: barrier()" in result.stderr
    assert took < 20
    cli.clean(result.stderr)


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_cli_failure_is_a_short_summary_with_the_output_in_a_file(tmp_path):
    cli = Cli(tmp_path)
    result, took = cli.run(RAISES)
    report("flyte-hvd-run", "rank raises", took)
    assert result.returncode == 1
    summary = result.stderr[result.stderr.index("flyte-hvd-run: ") :]
    assert summary.startswith("flyte-hvd-run: rank 1 failed; the run was stopped")
    assert "ValueError: bad batch on rank one" in summary
    assert len(summary.splitlines()) < 12, summary
    assert result.stderr.count("ValueError: bad batch") == 1  # not once streamed, once summed
    log = output_log_of(result.stderr)
    assert log is not None
    with open(log) as f:
        full = f.read()
    assert "[1]<stdout>:step output of rank 1" in full
    assert "[1]<stderr>:ValueError: bad batch on rank one" in full
    assert took < 20
    cli.clean(result.stderr)


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "sig, code, line",
    [
        (signal.SIGINT, 130, "flyte-hvd-run: interrupted (Ctrl-C); every rank was stopped."),
        (signal.SIGTERM, 143, "flyte-hvd-run: terminated (SIGTERM); every rank was stopped."),
    ],
)
def test_cli_signal_ends_quietly_and_leaves_nothing(tmp_path, sig, code, line):
    cli = Cli(tmp_path)
    proc = subprocess.Popen(
        [CLI, "-np", "2", "python", "-c", SLEEPS],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=cli.env(),
    )
    try:
        for _ in range(2):  # both ranks started
            assert "ready" in proc.stdout.readline()
        assert os.listdir(cli.tmp), "the run's folder should exist while it runs"
        sent = time.monotonic()
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    took = time.monotonic() - sent
    report("flyte-hvd-run", f"{signal.Signals(sig).name} to the launcher", took)
    assert proc.returncode == code
    assert stderr.strip() == line
    assert took < 15
    cli.clean(stderr)


def private_shm(command: str) -> list[str]:
    """``sh -c command`` in a private mount namespace with its own empty ``/dev/shm`` (so
    that other runs on the machine do not count), as the argv to run; the command's last
    output line lists what is left in ``/dev/shm``."""
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode != 0:
        require("`unshare -m` (root) for a private /dev/shm")
    script = f"mount -t tmpfs tmpfs /dev/shm && {{ {command}; }}; echo LEFT: $(ls /dev/shm)"
    return ["unshare", "-m", "sh", "-c", script]


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_cli_runs_leave_no_shared_memory(tmp_path):
    """MPICH's segments in /dev/shm (1 MiB per rank) go with a failed run as with a good one:
    the supervisor removes what its ranks mapped (MPI_Finalize does it only on success)."""
    cli = Cli(tmp_path)
    good = "import numpy as np, flyte_hvd.core as hvd\nhvd.init()\nhvd.allreduce(np.ones(3))\n"
    scripts = []
    for name, program in (("fails.py", RAISES), ("good.py", good)):
        (tmp_path / name).write_text(program)
        scripts.append(str(tmp_path / name))
    runs = " ; ".join(f"{CLI} -np 2 python {script}; echo EXIT=$?" for script in scripts)
    result = subprocess.run(
        private_shm(runs), capture_output=True, text=True, timeout=100, cwd=REPO, env=cli.env()
    )
    assert result.stdout.count("EXIT=") == 2, result.stdout + result.stderr
    assert "EXIT=1" in result.stdout and "EXIT=0" in result.stdout  # it failed, then it ran
    assert "ValueError: bad batch on rank one" in result.stderr
    assert result.stdout.strip().splitlines()[-1] == "LEFT:", result.stdout
    cli.clean(result.stderr)


# Rank 1 is killed while both ranks loop over 64 MB allreduces (64 chunks of the segment each).
KILLED_IN_SHARED_MEMORY_ALLREDUCE = (
    "import os, signal, sys, threading, time, numpy as np, flyte_hvd.core as hvd\n"
    "from flyte_hvd.core import shm, state\n"
    "hvd.init()\n"
    "x = np.ones(16 << 20, np.float32)\n"
    "hvd.allreduce(x)\n"
    "assert shm.channel(state.comm()) is not None, 'not on the shared-memory path'\n"
    "if hvd.rank() == 1:\n"
    "    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()\n"
    "print('KILL AT', time.time(), file=sys.stderr, flush=True)\n"
    "while True: hvd.allreduce(x)\n"
)


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_cli_rank_killed_inside_a_shared_memory_allreduce(tmp_path):
    """The rank left waiting on the shared segment sees its peer gone (it does not spin on),
    the run names the killed rank within seconds, and /dev/shm is left empty."""
    cli = Cli(tmp_path)
    (tmp_path / "killed.py").write_text(KILLED_IN_SHARED_MEMORY_ALLREDUCE)
    command = f"{CLI} -np 2 python {tmp_path / 'killed.py'}; echo EXIT=$?"
    result = subprocess.run(
        private_shm(command),
        capture_output=True,
        text=True,
        timeout=100,
        cwd=REPO,
        env=cli.env({"FLYTE_HVD_SHM_COLLECTIVES": "on"}),
    )
    ended = time.time()
    starts = [float(line.split()[-1]) for line in result.stderr.splitlines() if "KILL AT" in line]
    assert starts, result.stdout + result.stderr
    took = ended - (max(starts) + 0.3)
    report("flyte-hvd-run", "rank killed inside a shared-memory allreduce", took)
    assert "EXIT=1" in result.stdout, result.stdout + result.stderr
    assert "flyte-hvd-run: rank 1 failed; the run was stopped" in result.stderr, result.stderr
    assert "rank 1 died: Killed (signal 9)" in result.stderr
    # Rank 0 either was stopped by the launcher or saw its peer gone itself (never spun on).
    assert "PeerExitedError" not in result.stderr or (
        "PeerExitedError: rank 1 (pid " in result.stderr
    )
    assert result.stdout.strip().splitlines()[-1] == "LEFT:", result.stdout
    assert took < 10
    cli.clean(result.stderr)


@pytest.mark.timeout(60)
def test_waiting_on_the_shared_segment_for_a_dead_rank_raises_naming_it(monkeypatch):
    """Without a launcher to stop it, a rank waiting on the segment for a rank that died
    raises within the liveness interval and the grace; the segment's file was gone from
    /dev/shm from the start."""
    from mpi4py import MPI

    from flyte_hvd.core import shm

    before = set(os.listdir(shm.SHM_DIR))
    channel = shm.Channel(MPI.COMM_SELF, [5], [(os.getpid(), shm._start_time(os.getpid()))])
    assert not [n for n in set(os.listdir(shm.SHM_DIR)) - before if n.startswith("flyte-hvd-")]
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    started = shm._start_time(dead.pid)
    dead.wait()
    channel._peers[0] = (dead.pid, started)  # the rank it waits for is that process
    monkeypatch.setattr(shm, "DEAD_PEER_GRACE_S", 0.1)
    assert channel.exchange((7, -7), lambda: "allreduce(x)") == (7, -7)  # its own step
    begun = time.monotonic()
    with pytest.raises(shm.PeerExitedError) as raised:
        # A step the dead rank never reaches.
        channel._wait(channel._epoch + 1, lambda: "allreduce(x)")
    took = time.monotonic() - begun
    report("core", "rank waiting on the shared segment for a dead rank", took)
    assert str(raised.value).startswith(
        f"rank 5 (pid {dead.pid}) exited while rank 5 waited for it in `allreduce` on the "
        f"shared-memory path; the run cannot go on."
    )
    assert took < 1.0


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_cli_killed_launcher_leaves_nothing(tmp_path):
    """SIGKILL gives the launcher no chance: its orphaned ranks stop and remove its folder."""
    cli = Cli(tmp_path)
    proc = subprocess.Popen(
        [CLI, "-np", "2", "python", "-c", SLEEPS + "import tempfile\n"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=REPO,
        env=cli.env(),
    )
    for _ in range(2):
        assert "ready" in proc.stdout.readline()
    assert os.listdir(cli.tmp), "the run's folder should exist while it runs"
    sent = time.monotonic()
    proc.kill()
    proc.wait(30)
    assert_nothing_left(cli.mark, cli.tmp, within=20)
    os.rmdir(cli.tmp)
    report("flyte-hvd-run", "SIGKILL to the launcher (until all is gone)", time.monotonic() - sent)


@pytest.mark.timeout(60)
def test_stale_folder_of_a_dead_supervisor_is_swept(tmp_path):
    dead = tmp_path / f"{WORKDIR_PREFIX}dead"
    (dead / "tmp").mkdir(parents=True)
    (dead / "job.pkl").write_bytes(b"x")
    live = tmp_path / f"{WORKDIR_PREFIX}young"
    live.mkdir()
    old = time.time() - 3600
    os.utime(dead, (old, old))
    assert sweep_stale(str(tmp_path)) == [str(dead)]
    assert sorted(os.listdir(tmp_path)) == [live.name]  # too young to be judged


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "value, match",
    [("-5", "expected seconds > 0"), ("soon", "expected seconds > 0"), ("0", "seconds > 0")],
)
def test_bad_stall_check_time_is_refused(value, match):
    with pytest.raises(ValueError, match=match):
        stall.StallConfig.from_env({stall.CHECK_TIME_ENV: value})


@pytest.mark.timeout(60)
def test_shutdown_time_below_check_time_is_refused():
    with pytest.raises(ValueError, match="is less than HOROVOD_STALL_CHECK_TIME_SECONDS=60"):
        stall.StallConfig.from_env({stall.SHUTDOWN_TIME_ENV: "10"})


@pytest.mark.timeout(60)
def test_the_stall_probe_keeps_no_sampled_call_alive():
    """A sample must not outlive itself: a sampled call's locals (a collective's pooled
    buffers) are freed when the call returns, not when the cyclic GC next runs; otherwise
    the pool allocates fresh buffers and every large collective pays for it."""
    import gc
    import weakref

    class Buffer:
        pass

    probe = stall.Probe(lambda report: None, main=threading.get_ident())
    refs = []

    def call():
        buffer = Buffer()
        refs.append(weakref.ref(buffer))
        sampler = threading.Thread(target=probe.sample)
        sampler.start()
        sampler.join()

    gc.disable()
    try:
        call()
        assert refs[0]() is None
    finally:
        gc.enable()


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_cli_refuses_bad_timeouts_before_starting(tmp_path):
    cli = Cli(tmp_path)
    result, _ = cli.run("pass", args=("--start-timeout", "-5"))
    assert result.returncode == 2
    assert "--start-timeout must be seconds > 0; found -5" in result.stderr
    result, took = cli.run("pass", extra_env={stall.SHUTDOWN_TIME_ENV: "-1"})
    assert result.returncode == 1
    assert "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS='-1'" in result.stderr
    assert took < 10
    cli.clean(result.stderr)


# -- flyte_hvd.spark.run ---------------------------------------------------------------------


def _spark_work_dirs(spark, before: frozenset[str] = frozenset()) -> list[str]:
    """The supervisors' folders in Spark's scratch folders (what its Python workers get as
    ``SPARK_LOCAL_DIRS``; Spark removes them when the executor stops), less ``before``: the
    session is shared, and a folder an earlier test left is that test's to answer for."""
    found = []
    for d in _spark_local_dirs(spark):
        found += [os.path.join(d, n) for n in os.listdir(d) if n.startswith(WORKDIR_PREFIX)]
    return [path for path in found if path not in before]


def _described(paths: list[str]) -> str:
    """Each leftover folder with its age and entries, for the assertion's message."""
    lines = []
    for path in paths:
        try:
            age = time.time() - os.stat(path).st_mtime
            lines.append(f"{path} ({age:.0f}s old): {sorted(os.listdir(path))}")
        except OSError as e:
            lines.append(f"{path}: {e}")
    return "; ".join(lines)


def _spark_local_dirs(spark) -> list[str]:
    if "dirs" not in _LOCAL_DIRS:
        rows = spark.sparkContext.parallelize([0], 1).map(
            lambda _: os.environ.get("SPARK_LOCAL_DIRS", "")
        )
        _LOCAL_DIRS["dirs"] = [d for d in rows.collect()[0].split(",") if d]
        assert _LOCAL_DIRS["dirs"], "Spark gave its Python workers no SPARK_LOCAL_DIRS"
    return _LOCAL_DIRS["dirs"]


_LOCAL_DIRS: dict[str, list[str]] = {}


def _spark_case(spark, fn, mark, env=None, **kwargs):
    from flyte_hvd.spark import run

    started = time.monotonic()
    err = io.StringIO()
    with pytest.raises(RanksFailedError) as info:
        run(fn, num_proc=2, env={MARK: mark, **(env or {})}, stderr=err, **kwargs)
    took = time.monotonic() - started
    log = info.value.output_log
    if log:
        os.remove(log)
    return info.value, err.getvalue(), took


def _assert_spark_clean(spark, mark, before: frozenset[str]):
    """No rank of ``mark`` is left, nor a supervisor's folder that ``before`` did not list."""
    assert_nothing_left(mark, within=20)
    deadline = time.monotonic() + 20
    while _spark_work_dirs(spark, before) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _spark_work_dirs(spark, before)
    assert left == [], _described(left)


def _early_return():
    import sys

    import numpy as np

    import flyte_hvd.core as hvd

    hvd.init()
    if hvd.rank() == 1:
        sys.exit(0)
    hvd.allreduce(np.ones(3))


def _exits_early():
    import sys

    import numpy as np

    import flyte_hvd.core as hvd

    hvd.init()
    if hvd.rank() == 1:
        sys.exit(0)
    return np.ones(3)  # rank 0 returns; no collective waits for rank 1


def _hangs_before_collective():
    import time

    import numpy as np

    import flyte_hvd.core as hvd

    hvd.init()
    if hvd.rank() == 1:
        time.sleep(300)
    hvd.allreduce(np.ones(3))


def _raises():
    import time

    import flyte_hvd.core as hvd

    hvd.init()
    print("step output of rank", hvd.rank())
    if hvd.rank() == 1:
        raise ValueError("bad batch on rank one")
    time.sleep(300)


def _sleeps_in_tmp():
    import tempfile
    import time

    import flyte_hvd.core as hvd

    hvd.init()
    tempfile.mkdtemp(prefix="flyte-hvd-train-")
    time.sleep(300)


QUIET_FAILURE_SCRIPT = """
import sys
from pyspark.sql import SparkSession
spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
from flyte_hvd.spark import run

def raises():
    import numpy as np
    import flyte_hvd.core as hvd
    hvd.init()
    if hvd.rank() == 1:
        raise ValueError("bad batch on rank one")
    hvd.allreduce(np.ones(3))

try:
    run(raises, num_proc=2, verbose=0)
except Exception as error:
    print(f"RAISED {type(error).__name__}: {error}", file=sys.stderr)
spark.stop()
"""


@pytest.mark.spark
@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_spark_failure_prints_one_summary_not_spark_stacks(tmp_path):
    """A failed run's console output: the rank's error once, in the raised error, and no
    Java stack from Spark (the failing task ends without failing; the driver stops the rest)."""
    script = tmp_path / "fails.py"
    script.write_text(QUIET_FAILURE_SCRIPT)
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=150, cwd=REPO,
        env={**os.environ, "PYSPARK_PYTHON": sys.executable},
    )  # fmt: skip
    err = result.stderr
    assert "RAISED RanksFailedError: rank 1 failed" in err, err[-3000:]
    assert "ValueError: bad batch on rank one" in err
    assert "\tat org.apache.spark" not in err and "Exception in task" not in err, err[-3000:]
    spark_lines = [line for line in err.splitlines() if " WARN " in line or " ERROR " in line]
    assert len(spark_lines) <= 6, spark_lines


@pytest.mark.spark
@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_spark_faults(spark_local2):
    """Early return, stall shutdown and a raising rank under ``spark.run``, on one session."""
    mark = uuid.uuid4().hex
    spark_local2.sparkContext.parallelize([0], 1).count()  # the session is warm
    before = frozenset(_spark_work_dirs(spark_local2))

    # `fn` that calls sys.exit(0) never returns its result: an error, whether or not its
    # peers wait for it in a collective (a program's exit 0, under flyte-hvd-run, is not).
    for fn, case in ((_early_return, "while rank 0 waits"), (_exits_early, "nobody waits")):
        error, _, took = _spark_case(spark_local2, fn, mark)
        report("spark.run", f"rank calls sys.exit(0) in fn, {case}", took)
        assert error.ranks == [1]
        line = fn.__code__.co_firstlineno + 9
        assert (
            f"rank 1 called sys.exit(0) at test_faults.py:{line} inside the function it runs, "
            f"so the function never returned its result" in str(error)
        )
        assert took < 40
        _assert_spark_clean(spark_local2, mark, before)

    error, err, took = _spark_case(spark_local2, _hangs_before_collective, mark, FAST_STALL)
    report("spark.run", "rank hangs before a collective (stall 1s/3s)", took)
    assert "ranks [1] are not there (rank 1 at test_faults.py" in str(error)
    assert "The run was stopped after 3s" in str(error)
    assert took < 40
    _assert_spark_clean(spark_local2, mark, before)

    error, err, took = _spark_case(spark_local2, _raises, mark)
    report("spark.run", "rank raises", took)
    assert error.ranks == [1]
    assert "ValueError: bad batch on rank one" in str(error)
    assert "full output of every rank: " in str(error)
    assert err.count("ValueError: bad batch") == 0  # the error carries it, not the stream
    assert took < 40
    _assert_spark_clean(spark_local2, mark, before)


@pytest.mark.spark
@pytest.mark.mpi
@pytest.mark.timeout(150)
def test_spark_cancelled_stage_leaves_nothing(spark_local2):
    """Spark kills the tasks' Python workers: the orphaned ranks stop and remove the folders
    (which are in Spark's own scratch folder, the ranks' TMPDIR inside them)."""
    from flyte_hvd.spark import run

    mark = uuid.uuid4().hex
    sc = spark_local2.sparkContext
    before = frozenset(_spark_work_dirs(spark_local2))  # a Spark job: before the stage
    errors = []

    def go():
        try:
            run(_sleeps_in_tmp, num_proc=2, env={MARK: mark}, stderr=io.StringIO())
        except Exception as e:
            errors.append(e)

    thread = threading.Thread(target=go)
    thread.start()
    deadline = time.monotonic() + 60
    while len(marked_processes(mark)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1)
    assert _spark_work_dirs(spark_local2, before)
    sent = time.monotonic()
    sc.cancelAllJobs()
    thread.join(60)
    assert errors and "cancelled" in str(errors[0])
    _assert_spark_clean(spark_local2, mark, before)
    report("spark.run", "Spark cancels the stage (until all is gone)", time.monotonic() - sent)


@pytest.mark.spark
@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_spark_run_from_a_worker_thread(spark_local2):
    from flyte_hvd.spark import run

    results = []

    def go():
        try:
            results.append(run(lambda: 7, num_proc=2, verbose=0))
        except Exception as e:
            results.append(e)

    thread = threading.Thread(target=go)
    thread.start()
    thread.join(150)
    assert results == [[7, 7]]


def _listening_addresses() -> list[str]:
    """Local addresses this rank process and its launcher listen on (TCP, v4 and v6)."""
    inodes, pid = set(), os.getpid()
    for _ in range(2):  # the rank, its mpiexec
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                cols = row.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    found.append(cols[1].split(":")[0])
    return found


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_single_host_run_listens_on_loopback_only(no_leftover_ranks):
    from flyte_hvd.launch.job import FunctionJob
    from flyte_hvd.launch.supervisor import launch_local

    def fn():
        import numpy as np

        import flyte_hvd.core as hvd

        hvd.init()
        hvd.allreduce(np.ones(3))  # the ranks' transports are up
        return _listening_addresses()

    loopback = {"0100007F", "00000000000000000000000001000000"}
    for addresses in launch_local(FunctionJob(fn), 2):
        assert set(addresses) <= loopback, addresses


# -- KerasEstimator.fit ----------------------------------------------------------------------


def _vector_df(spark, rows=64, bad=()):
    from pyspark.ml.linalg import Vectors

    data = []
    for i in range(rows):
        x = [float(i % 7), 1.0, -1.0]
        for row, col, value in bad:
            if row == i:
                x[col] = value
        data.append((Vectors.dense(x), float(i % 3)))
    return spark.createDataFrame(data, ["features", "label"])


@pytest.mark.spark
@pytest.mark.mpi
@pytest.mark.timeout(400)
def test_keras_estimator_faults(spark_local2, tmp_path):
    """Bad input is refused on the driver before any rank starts; a finished run says so."""
    keras = pytest.importorskip("keras")
    from flyte_hvd.data.prepare import prepare_data
    from flyte_hvd.data.store import Store
    from flyte_hvd.estimators.keras import KerasEstimator
    from flyte_hvd.estimators.runs import RunLease

    store = Store.create(str(tmp_path / "store"))
    spark_local2.sparkContext.parallelize([0], 1).count()
    keras_module = "flyte_hvd.estimators.keras"

    def estimator(inputs=3, outputs=1, **overrides):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((inputs,)), keras.layers.Dense(outputs)])
        params = dict(
            num_proc=2, store=store, model=model, optimizer=keras.optimizers.SGD(0.01),
            loss="mse", feature_cols=["features"], label_cols=["label"], batch_size=8,
            epochs=1, verbose=0,
        )  # fmt: skip
        params.update(overrides)
        return KerasEstimator(**params)

    def refused(case, est, df, match, error=ValueError, unprepared=False):
        listing, spares = set(os.listdir(store.prefix_path)), idle_spares(keras_module)
        started = time.monotonic()
        with pytest.raises(error, match=match):
            est.fit(df)
        took = time.monotonic() - started
        report("KerasEstimator.fit", case, took)
        assert rank_processes() == []  # no rank was started, none is left
        if unprepared:  # refused before prepare_data wrote anything or spares started
            assert set(os.listdir(store.prefix_path)) == listing
            assert idle_spares(keras_module) <= spares
        return took

    bad = _vector_df(spark_local2, bad=[(3, 1, float("nan")), (9, 2, float("inf"))])
    took = refused(
        "NaN and infinity in a vector feature",
        estimator(),
        bad,
        r"column `features` has 2 NaN or infinite values.*allow_non_finite_features=True",
    )
    assert took < 60
    with prepare_data(
        2, store, bad, ["label"], allow_non_finite_features=True
    ) as idx:  # the option lets them through
        assert idx
    good = _vector_df(spark_local2)
    assert refused("unknown loss name", estimator(loss="msee"), good, "`loss`='msee'") < 10
    assert refused("unknown metric", estimator(metrics=["maee"]), good, "'maee'") < 10
    took = refused(
        "model input width does not fit the features",
        estimator(inputs=5),
        good,
        r"takes 5 value\(s\) per row .* feature column `features` holds 3",
    )
    assert took < 60
    took = refused(
        "model output width does not fit the label",
        estimator(outputs=2),
        good,
        r"the model's output 0 gives 2 value\(s\) per row \(shape \(2,\)\) but label column "
        r"`label` holds 1 \(shape \(\)\), and the loss 'mse' compares them value by value",
    )
    assert took < 60
    for case, overrides, match in [
        ("negative learning rate", {"optimizer": keras.optimizers.SGD(-0.01)},
         r"`optimizer` \(SGD\) has learning rate -0.01; it must be a finite number >= 0"),
        ("NaN learning rate", {"optimizer": keras.optimizers.Adam(float("nan"))},
         r"`optimizer` \(Adam\) has learning rate nan"),
        ("label column among the features", {"feature_cols": ["features", "label"]},
         r"column `label` is listed in both `feature_cols` and `label_cols`"),
        ("sample weight column is the label", {"sample_weight_col": "label"},
         r"column `label` is listed in both `label_cols` and `sample_weight_col`"),
    ]:  # fmt: skip
        assert refused(case, estimator(**overrides), good, match, unprepared=True) < 10
    took = refused(
        "num_proc above the task slots",
        estimator(num_proc=3),
        good,
        r"`num_proc`=3 but the cluster has 2 free task slot\(s\) \(master local\[2\]",
        error=RuntimeError,
        unprepared=True,
    )
    assert took < 10

    first = estimator(run_id="finished").fit(good)
    # A refit of the finished run (a retried task) returns its model; no rank starts.
    started = time.monotonic()
    again = estimator(run_id="finished").fit(good)
    report("KerasEstimator.fit", "refit of a finished run_id (model returned)",
           time.monotonic() - started)  # fmt: skip
    assert rank_processes() == []
    assert again.getHistory() == first.getHistory() and again.getRunId() == "finished"
    weights = [w.numpy() for w in again.getModel().weights]
    np.testing.assert_array_equal(weights[0], first.getModel().weights[0].numpy())
    assert float(np.asarray(again.getModel().optimizer.learning_rate)) == pytest.approx(0.01)
    further = estimator(run_id="finished", epochs=2).fit(good)  # as the warning says
    assert len(further.getHistory()["loss"]) == 2

    # A damaged last model: the run resumes from its intact checkpoint (one warning).
    last = store.get_run_path("finished") + "/last.keras"
    with open(last, "r+b") as f:
        f.truncate(os.path.getsize(last) // 2)
    resumed = estimator(run_id="finished", epochs=3).fit(good)
    assert len(resumed.getHistory()["loss"]) == 3
    assert json.loads(store.read(store.get_state_path("finished")))["epoch"] == 3

    store.delete(last)
    open(store.get_checkpoint_path("finished", ".keras"), "wb").close()
    took = refused(
        "resume whose last model and checkpoint are lost",
        estimator(run_id="finished", epochs=4),
        good,
        r"run `finished` cannot resume: its state.json says 3 epoch\(s\) are done, but its "
        r"last model `.*/runs/finished/last.keras` is missing, and its checkpoint "
        r"`.*/runs/finished/checkpoint.keras` is damaged: it is not a complete model archive",
        unprepared=True,
    )
    assert took < 10
    state = json.loads(store.read(store.get_state_path("finished")))
    store.write_text(store.get_state_path("finished"), json.dumps({**state, "epoch": "3"}))
    took = refused(
        "resume whose state.json has a wrong type",
        estimator(run_id="finished", epochs=4),
        good,
        r"run `finished` cannot resume: its record `.*/runs/finished/state.json` is damaged: "
        r"`epoch` must be an int >= 0 \(epochs completed\); found '3'",
        unprepared=True,
    )
    assert took < 10

    lease = RunLease(store, "busy")  # another fit of this run, in progress
    lease.acquire()
    try:
        took = refused(
            "a second fit of a run in progress",
            estimator(run_id="busy"),
            good,
            rf"run `busy` is in use by another fit: its lease `.*/runs/busy/lease.json` is held "
            rf"by {lease.owner} \(renewed \d+s ago\)\. Wait for that fit to end",
            unprepared=True,
        )
    finally:
        lease.release()
    assert took < 10


# -- HorovodSpark tasks ----------------------------------------------------------------------


@pytest.mark.flyte
@pytest.mark.spark
@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_horovod_spark_task_rank_returning_early(spark_local2):
    from flytekit import task

    from flyte_hvd.flyte import HorovodSpark

    @task(task_config=HorovodSpark(num_proc=2))
    def one_collective_fewer() -> int:
        import numpy as np

        import flyte_hvd.core as hvd

        hvd.allreduce(np.ones(3))
        if hvd.rank() == 0:
            hvd.allreduce(np.ones(3))
        return 0

    spark_local2.sparkContext.parallelize([0], 1).count()
    before = frozenset(_spark_work_dirs(spark_local2))
    started = time.monotonic()
    with pytest.raises(RanksFailedError) as info:
        one_collective_fewer()
    took = time.monotonic() - started
    report("HorovodSpark task", "one collective fewer", took)
    message = str(info.value)
    assert "rank 1 ended (returned normally) while ranks [0] wait for it in `allreduce`" in message
    assert took < 60
    if info.value.output_log:
        os.remove(info.value.output_log)
    deadline = time.monotonic() + 20
    while (rank_processes() or _spark_work_dirs(spark_local2, before)) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.2)
    assert rank_processes() == []
    left = _spark_work_dirs(spark_local2, before)
    assert left == [], _described(left)


# -- the Store on the training path ----------------------------------------------------------


class _S3Process:
    """moto's S3 server in a process of its own (so that a test can stop or kill it), on a
    free loopback port, with one bucket."""

    def __init__(self):
        import socket

        import requests

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{port}"
        moto = os.path.join(os.path.dirname(sys.executable), "moto_server")
        self.proc = subprocess.Popen(
            [moto, "-H", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                requests.put(f"{self.endpoint}/bucket", timeout=2).raise_for_status()
                break
            except requests.RequestException:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def store(self, timeout: float, **config):
        from flyte_hvd.data.store import Store

        options = {"endpoint_url": self.endpoint, "key": "k", "secret": "s"}
        if config:
            options["config_kwargs"] = config
        return Store.create("s3://bucket/exp", storage_options=options, timeout=timeout)

    def close(self):
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGCONT)
        self.proc.kill()
        self.proc.wait()


def _checkpoint_after_store_stops(remote, stop_pid, sig):
    """Rank 0 writes the run's state, then the store gets ``sig`` and rank 0 uploads a
    checkpoint while rank 1 waits for it in an allreduce."""
    import os
    import tempfile

    import numpy as np

    import flyte_hvd.core as hvd

    hvd.init()
    if hvd.rank() == 0:
        remote.write_text(remote.state_path, '{"epoch": 1}')
        os.kill(stop_pid, sig)
        local = os.path.join(tempfile.mkdtemp(), "checkpoint.keras")
        with open(local, "wb") as f:
            f.write(b"model" * 100)
        remote.upload_file(local, remote.checkpoint_path(".keras"))
    hvd.allreduce(np.ones(3))


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_hung_and_dead_store_fail_the_run_naming_the_operation(caplog, monkeypatch):
    """A store that stops answering mid-run (SIGSTOP) fails the run after the Store's
    `timeout`, naming the operation, the store and the setting; meanwhile the stall line says
    what the missing rank is doing. A store that is gone gives one line of advice, not
    s3fs's traceback."""
    from flyte_hvd.launch.job import FunctionJob
    from flyte_hvd.launch.supervisor import launch_local

    monkeypatch.setenv(stall.CHECK_TIME_ENV, "1")
    server = _S3Process()
    try:
        remote = server.store(timeout=4).to_remote("r")
        started = time.monotonic()
        with (
            caplog.at_level("WARNING", logger="flyte_hvd"),
            pytest.raises(RanksFailedError) as info,
        ):
            launch_local(FunctionJob(_checkpoint_after_store_stops,
                                     (remote, server.proc.pid, signal.SIGSTOP)), 2)  # fmt: skip
        took = time.monotonic() - started
        report("launch_local", "store hangs (SIGSTOP) during a checkpoint upload (timeout 4s)",
               took)  # fmt: skip
        message = str(info.value)
        assert "rank 0 failed" in message
        assert (
            "StoreTimeoutError: uploading runs/r/checkpoint.keras to s3://bucket/exp did not "
            f"finish within 4s: the store does not answer (endpoint {server.endpoint}"
        ) in message, message
        assert "raise the Store's `timeout` or FLYTE_HVD_STORE_TIMEOUT_S (now 4s" in message
        assert len(message.splitlines()) < 6, message
        stalls = [r.getMessage() for r in caplog.records if "stall:" in r.getMessage()]
        assert any(
            "ranks [0] are not there (rank 0 is uploading runs/r/checkpoint.keras to "
            "s3://bucket/exp (at " in line
            for line in stalls
        ), stalls
        assert 4 <= took < 20
        if info.value.output_log:
            os.remove(info.value.output_log)

        server.proc.send_signal(signal.SIGCONT)  # answers again: the store works
        remote = server.store(timeout=30, retries={"max_attempts": 1}).to_remote("r")
        started = time.monotonic()
        with pytest.raises(RanksFailedError) as info:
            launch_local(FunctionJob(_checkpoint_after_store_stops,
                                     (remote, server.proc.pid, signal.SIGKILL)), 2)  # fmt: skip
        took = time.monotonic() - started
        report("launch_local", "store gone (SIGKILL) before a checkpoint upload", took)
        message = str(info.value)
        assert (
            "StoreUnreachableError: cannot reach the store at `s3://bucket/exp` while uploading "
            "runs/r/checkpoint.keras to s3://bucket/exp: EndpointConnectionError"
        ) in message, message
        assert f"reachable from every executor (endpoint {server.endpoint}" in message
        assert len(message.splitlines()) < 6, message
        assert took < 25
        if info.value.output_log:
            os.remove(info.value.output_log)
    finally:
        server.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", ["0", "-1", "soon", "inf"])
def test_bad_store_timeout_is_refused(monkeypatch, tmp_path, value):
    from flyte_hvd.data.store import TIMEOUT_ENV, Store

    monkeypatch.setenv(TIMEOUT_ENV, value)
    with pytest.raises(ValueError, match=f"{TIMEOUT_ENV}='{value}': expected the seconds"):
        Store.create(str(tmp_path))
    monkeypatch.delenv(TIMEOUT_ENV)
    with pytest.raises(ValueError, match=r"`timeout` must be the seconds .*; found -3"):
        Store.create(str(tmp_path), timeout=-3)
    assert Store.create(str(tmp_path)).timeout == 50


@pytest.mark.spark
@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_spark_run_signalled_cancels_the_stage_and_stops_every_rank(
    spark_local2, caplog, monkeypatch, sig
):
    """SIGINT or SIGTERM while ``spark.run`` waits for its stage: the stage is cancelled and
    every rank stops within seconds; one line is logged; Ctrl-C raises a KeyboardInterrupt
    that, uncaught, prints no traceback (Python then exits 130), SIGTERM exits 143; the
    process's own handlers come back."""
    from flyte_hvd.spark import run
    from flyte_hvd.stage.pipeline import logged_interrupt

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # restored after the test
    mark = uuid.uuid4().hex
    folders = frozenset(_spark_work_dirs(spark_local2))  # a Spark job: before the stage
    before = signal.getsignal(sig)
    sent: list[float] = []

    def signal_once_ranks_run():
        deadline = time.monotonic() + 60
        while len(marked_processes(mark)) < 4 and time.monotonic() < deadline:  # + mpiexec
            time.sleep(0.2)
        time.sleep(0.5)
        sent.append(time.monotonic())
        os.kill(os.getpid(), sig)

    threading.Thread(target=signal_once_ranks_run, daemon=True).start()
    expected = KeyboardInterrupt if sig == signal.SIGINT else SystemExit
    with caplog.at_level("WARNING", logger="flyte_hvd"), pytest.raises(expected) as info:
        run(_sleeps_in_tmp, num_proc=2, env={MARK: mark}, stderr=io.StringIO())
    took = time.monotonic() - sent[0]
    report("spark.run", f"{signal.Signals(sig).name} to the driver process", took)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("flyte_hvd")]
    name = "interrupted (Ctrl-C)" if sig == signal.SIGINT else "terminated (SIGTERM)"
    assert lines == [f"{name}: the Spark stage was cancelled and every rank stopped"], lines
    if sig == signal.SIGINT:
        assert type(info.value) is KeyboardInterrupt and logged_interrupt(info.value)
        shown = io.StringIO()
        monkeypatch.setattr(sys, "stderr", shown)
        sys.excepthook(KeyboardInterrupt, info.value, None)  # as Python does, uncaught
        monkeypatch.undo()
        assert shown.getvalue() == ""
    else:
        assert info.value.code == 143
    assert signal.getsignal(sig) is before
    assert took < 10
    assert_nothing_left(mark, within=5)
    _assert_spark_clean(spark_local2, mark, folders)


SIGNALLED_SCRIPT = """
import os
import sys

from flytekit import task
from pyspark.sql import SparkSession

spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
spark.sparkContext.setLogLevel("ERROR")

from flyte_hvd.flyte import HorovodSpark
from flyte_hvd.spark import run


def raises():
    import numpy as np
    import flyte_hvd.core as hvd
    hvd.init()
    hvd.allreduce(np.ones(3))
    if hvd.rank() == 1:
        raise ValueError("bad batch on rank one")
    hvd.allreduce(np.ones(3))


def good():
    import numpy as np
    import flyte_hvd.core as hvd
    hvd.init()
    return float(hvd.allreduce(np.ones(3))[0])


@task(task_config=HorovodSpark(num_proc=2))
def sleeps() -> int:
    import time
    print("ready", flush=True)
    time.sleep(300)
    return 0


try:
    run(raises, num_proc=2, verbose=0)
except Exception as error:
    print("RAISED", type(error).__name__, flush=True)
    if error.output_log:
        os.remove(error.output_log)
print("RESULT", run(good, num_proc=2, verbose=0), flush=True)
print("SHM LEFT:", sorted(os.listdir("/dev/shm")), flush=True)
sleeps()  # what `pyflyte run` executes, less its command line (click)
"""


@pytest.mark.flyte
@pytest.mark.spark
@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_interrupted_horovod_spark_task_ends_quietly_and_leaves_nothing(tmp_path):
    """In a private /dev/shm, a failing and a good ``spark.run`` leave no MPICH segment;
    then Ctrl-C to the process while a ``HorovodSpark`` task runs: one line, no py4j or Java
    stack, status 130 (a SystemExit: `pyflyte run`'s click would turn a KeyboardInterrupt
    into "Aborted!" and status 1), and every rank, mpiexec, Python worker and the JVM gone
    within seconds."""
    script = tmp_path / "signalled.py"
    script.write_text(SIGNALLED_SCRIPT)
    mark = uuid.uuid4().hex
    command = f"{sys.executable} {script}"
    env = {**os.environ, MARK: mark, "PYTHONPATH": REPO, "PYSPARK_PYTHON": sys.executable}
    argv = private_shm(f"{command}; echo EXIT=$?")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path, env=env, start_new_session=True)  # fmt: skip
    try:
        lines = []
        while sum("<stdout>:ready" in line for line in lines) < 2:
            lines.append(proc.stdout.readline())
            assert lines[-1], f"the script ended early: {lines}"
        assert "RAISED RanksFailedError\n" in lines and "RESULT [1.0, 1.0]\n" in lines, lines
        assert "SHM LEFT: []\n" in lines, lines
        pids = [p for p in marked_processes(mark) if p.split(" ", 1)[1].startswith(command)]
        assert len(pids) == 1, pids
        sent = time.monotonic()
        os.kill(int(pids[0].split()[0]), signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the script's tree, should the test fail
    report("HorovodSpark task", "SIGINT to the driver process", took)
    assert stdout.strip().splitlines()[-2:] == ["EXIT=130", "LEFT:"], stdout[-3000:]
    ours = [text for text in stderr.splitlines() if "flyte-hvd: " in text or "Traceback" in text]
    assert ours[-1].endswith(
        "flyte-hvd: interrupted (Ctrl-C): the Spark stage was cancelled and every rank stopped"
    ), stderr[-3000:]
    assert "Traceback" not in stderr and "\tat org.apache" not in stderr, stderr[-3000:]
    assert "py4j" not in stderr, stderr[-3000:]
    assert took < 10
    assert_nothing_left(mark, within=5)


@pytest.mark.spark
@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_keras_fit_fails_naming_a_store_that_hangs_mid_fit(spark_local2, caplog, monkeypatch):
    """The store stops answering (SIGSTOP) after the first epoch of a KerasEstimator fit:
    the fit fails after the Store's `timeout`, naming the upload and the store, while the
    stall line says that rank 0 is uploading; no rank is left."""
    keras = pytest.importorskip("keras")
    from flyte_hvd.estimators.keras import KerasEstimator

    class StopsTheStore(keras.callbacks.Callback):
        def __init__(self, pid):
            super().__init__()
            self.pid = pid

        def on_epoch_end(self, epoch, logs=None):
            import flyte_hvd.core as hvd

            if epoch == 0 and hvd.rank() == 0:
                os.kill(self.pid, signal.SIGSTOP)

    monkeypatch.setenv(stall.CHECK_TIME_ENV, "1")
    spark_local2.sparkContext.parallelize([0], 1).count()
    server = _S3Process()
    try:
        keras.utils.set_random_seed(0)
        estimator = KerasEstimator(
            num_proc=2, store=server.store(timeout=5), run_id="hung",
            model=keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]),
            optimizer=keras.optimizers.SGD(0.01), loss="mse", feature_cols=["features"],
            label_cols=["label"], batch_size=8, epochs=3, verbose=0,
            callbacks=[StopsTheStore(server.proc.pid)],
        )  # fmt: skip
        df = _vector_df(spark_local2)
        started = time.monotonic()
        with (
            caplog.at_level("WARNING", logger="flyte_hvd"),
            pytest.raises(RanksFailedError) as info,
        ):
            estimator.fit(df)
        took = time.monotonic() - started
    finally:
        server.close()
    report("KerasEstimator.fit", "store hangs (SIGSTOP) after epoch 1 (timeout 5s)", took)
    message = str(info.value)
    assert (
        "StoreTimeoutError: uploading runs/hung/checkpoint.keras to s3://bucket/exp did not "
        "finish within 5s"
    ) in message, message
    assert len(message.splitlines()) < 6, message
    stalls = [r.getMessage() for r in caplog.records if "stall:" in r.getMessage()]
    assert any("(rank 0 is uploading runs/hung/checkpoint.keras to s3://bucket/exp" in line
               for line in stalls), stalls  # fmt: skip
    if info.value.output_log:
        os.remove(info.value.output_log)
    deadline = time.monotonic() + 20
    while rank_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert rank_processes() == []


@pytest.mark.timeout(60)
def test_a_second_signal_stops_waiting_for_the_stage(monkeypatch, caplog):
    """The first SIGINT starts the stage's cancellation and lets the run wait for it; a
    second one raises at once (a stage that does not end must not trap the user). A signal
    the process ignores stays ignored."""
    from flyte_hvd.stage.pipeline import logged_interrupt, stopped_by_signals

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    stops = []
    previous_int = signal.getsignal(signal.SIGINT)
    previous_term = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        with (
            caplog.at_level("WARNING", logger="flyte_hvd"),
            pytest.raises(KeyboardInterrupt) as info,
            stopped_by_signals(lambda: stops.append(1)) as received,
        ):
            os.kill(os.getpid(), signal.SIGTERM)  # ignored: nothing happens
            os.kill(os.getpid(), signal.SIGINT)
            deadline = time.monotonic() + 5
            while not stops and time.monotonic() < deadline:
                time.sleep(0.01)
            assert received == [signal.SIGINT] and stops == [1]
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler raises before this ends
        assert logged_interrupt(info.value)
        assert [r.getMessage() for r in caplog.records] == [
            "interrupted (Ctrl-C): the Spark stage was cancelled and every rank stopped"
        ]
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGINT) is previous_int
    finally:
        signal.signal(signal.SIGTERM, previous_term)
