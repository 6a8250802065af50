"""Spare rank processes (``flyte_hvd.launch.spare``): started after a run that ends well, with
their modules imported, handed the next run's ranks; never two runs in one process."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import cloudpickle
import pytest

from flyte_hvd.core.errors import RanksFailedError
from flyte_hvd.launch import spare
from flyte_hvd.launch.job import FunctionJob
from flyte_hvd.launch.supervisor import LocalExchange, RankSupervisor

pytestmark = pytest.mark.mpi

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks cannot import tests/
PRELOAD = ("json",)  # cheap to import; the estimators name their framework


def _whoami():
    import os
    import sys

    import numpy as np

    import flyte_hvd.core as hvd

    hvd.init()  # a new communicator: the ranks of this run only
    total = hvd.allreduce(np.array([1.0]), op=hvd.Sum).tolist()
    return os.getpid(), hvd.rank(), hvd.size(), total, "json" in sys.modules


def _run(job=_whoami, size: int = 2, env: dict | None = None, preload=PRELOAD):
    supervisor = RankSupervisor(
        FunctionJob(job), list(range(size)), size, LocalExchange(size), secret="x",
        start_timeout=60, env=env, preload=preload,
    )  # fmt: skip
    results = supervisor.run()
    return results, supervisor.timings()


def _pids_alive(pids) -> list[int]:
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    alive.append(pid)
        except OSError:
            pass
    return alive


def _until(condition, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture(autouse=True)
def _no_spares_before_or_after():
    spare.stop_all()
    yield
    spare.stop_all()
    assert spare._SPARES == []


def test_the_next_run_gets_spares_that_run_one_job_each(no_leftover_ranks):
    first, times = _run()
    assert not any("spare_claimed" in t for t in times.values())
    spares = [s.proc.pid for s in spare._SPARES]
    assert len(spares) == 2
    second, times = _run()
    assert all("spare_claimed" in t for t in times.values())
    # Each rank of the second run is a spare (mpiexec's child), with its module imported,
    # in a communicator of this run's two ranks.
    assert [r[1:] for r in second.values()] == [(0, 2, [2.0], True), (1, 2, [2.0], True)]
    assert {r[0] for r in second.values()}.isdisjoint(r[0] for r in first.values())
    # They ran their one job and exited; two new spares wait for the run after.
    _until(lambda: not _pids_alive(spares))
    assert len(spare._SPARES) == 2
    assert {s.proc.pid for s in spare._SPARES}.isdisjoint(spares)


def test_a_preload_module_that_is_missing_does_not_stop_the_spare(no_leftover_ranks):
    """Optional modules (an fsspec backend Lightning checks its saves against) may be absent
    where the spare runs: it imports the others and still takes the next run's rank."""
    preload = ("no_such_module_for_a_spare", "json")
    _run(preload=preload)
    second, times = _run(preload=preload)
    assert all("spare_claimed" in t for t in times.values())
    assert [r[1:] for r in second.values()] == [(0, 2, [2.0], True), (1, 2, [2.0], True)]


def _partition_path():
    import os

    from flyte_hvd.launch.rendezvous import PARTITION_ENV

    return os.getpid(), os.environ.get(PARTITION_ENV)


def test_a_spare_takes_a_rank_of_a_data_run_with_the_ranks_own_partition(no_leftover_ranks):
    """A run given data (``run(fn, data=df)``) names each rank's partition file in the rank's
    environment: the path travels with the rank's assignment, not in the spare's key, so
    spares started before the run (with no path) stand in for its ranks."""
    from flyte_hvd.launch.rendezvous import PARTITION_ENV

    _run(size=1)  # leaves a spare
    results, times = _run(_partition_path, size=1, env={PARTITION_ENV: "/scratch/p0.arrow"})
    assert "spare_claimed" in times[0]
    assert results[0][1] == "/scratch/p0.arrow"


def _collector():
    import gc

    return gc.isenabled(), gc.get_freeze_count()


def test_ranks_import_with_the_collector_paused_and_run_with_it_on(no_leftover_ranks):
    """A new rank loads its job, a spare its modules, with the garbage collector paused; what
    they imported is frozen, and the job runs with the collector on."""
    for _ in ("new ranks", "spares"):
        results, _ = _run(_collector)
        assert [(on, frozen > 1000) for on, frozen in results.values()] == [(True, True)] * 2


def test_collector_paused_restores_the_collectors_state():
    import gc

    from flyte_hvd.launch.job import collector_paused

    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # it was off before
    finally:
        gc.enable()
        gc.unfreeze()
    with pytest.raises(ValueError), collector_paused():
        raise ValueError("an import that fails")
    assert gc.isenabled()
    gc.unfreeze()


def test_a_spare_stands_in_only_for_a_rank_started_the_same_way():
    _run(env={"SETTING": "a"})
    _, times = _run(env={"SETTING": "b"})
    assert not any("spare_claimed" in t for t in times.values())
    _, times = _run(env={"SETTING": "b"}, preload=("json", "csv"))
    assert not any("spare_claimed" in t for t in times.values())


def test_a_process_keeps_one_idle_spare_per_rank_it_runs():
    _run(size=1, env={"SETTING": "a"})
    (older,) = spare._SPARES
    _run(size=1, env={"SETTING": "b"})  # its spare replaces the one no run would take
    (newer,) = spare._SPARES
    assert older.proc.poll() is not None and not os.path.exists(older.folder)
    _, times = _run(size=1, env={"SETTING": "b"})
    assert "spare_claimed" in times[0] and newer.proc.poll() is not None


def test_a_failed_run_stops_the_spares_and_the_next_run_starts_fresh(no_leftover_ranks):
    def fails():
        import flyte_hvd.core as hvd

        hvd.init()
        raise ValueError("boom")

    _run()
    spares = [s.proc.pid for s in spare._SPARES]
    with pytest.raises(RanksFailedError, match="boom"):
        _run(job=fails)
    assert spare._SPARES == [] and _pids_alive(spares) == []
    _, times = _run()
    assert not any("spare_claimed" in t for t in times.values())


def test_an_idle_spare_exits_after_its_idle_time(monkeypatch):
    monkeypatch.setenv(spare.IDLE_ENV, "1")
    _run(size=1)
    (only,) = spare._SPARES
    folder = only.folder
    _until(lambda: only.proc.poll() is not None)
    assert only.proc.returncode == 0
    assert not os.path.exists(folder)
    _, times = _run(size=1)  # the dead spare is passed over
    assert "spare_claimed" not in times[0]


def test_a_spare_exits_when_the_process_that_keeps_it_is_gone():
    keeper = subprocess.run(
        [sys.executable, "-c", (
            "from flyte_hvd.launch.job import FunctionJob\n"
            "from flyte_hvd.launch.supervisor import LocalExchange, RankSupervisor\n"
            "from flyte_hvd.launch import spare\n"
            "RankSupervisor(FunctionJob(print), [0], 1, LocalExchange(1), secret='x',"
            " preload=('json',)).run()\n"
            "print(spare._SPARES[0].folder, flush=True)\n"
            "import os; os._exit(0)  # as a Spark worker killed with its session\n"
        )],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    folder = keeper.stdout.split()[-1]
    _until(lambda: not os.path.exists(folder), timeout=15)


def test_spares_can_be_turned_off(monkeypatch):
    monkeypatch.setenv(spare.ENABLED_ENV, "0")
    _run(size=1)
    assert spare._SPARES == []


def test_a_supervisor_probing_the_folder_does_not_take_the_spare():
    """The stale-folder sweep connects to a folder's socket to see whether anyone is home."""
    import socket

    _run(size=1)
    (only,) = spare._SPARES
    path = os.path.join(only.folder, spare.SOCKET_NAME)
    _until(lambda: os.path.exists(path))
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.connect(path)
    probe.close()
    _, times = _run(size=1)
    assert "spare_claimed" in times[0]


def _age_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


def test_a_rank_that_is_warm_has_its_spare_started_during_the_run():
    def warm_then_work():
        import time

        import flyte_hvd.core as hvd
        from flyte_hvd.launch import spare

        hvd.init()
        spare.rank_is_warm()
        spare.rank_is_warm()  # once is enough: a second call does nothing
        time.sleep(2)  # the run's work, while the spare imports

    _run(job=warm_then_work, size=1)
    (early,) = spare._SPARES
    assert _age_s(early.proc.pid) > 1.5  # started at the call, not when the run ended
    spare.stop_all()
    _run(job=lambda: None, size=1)
    (late,) = spare._SPARES
    assert _age_s(late.proc.pid) < 1.5


# What rank 0's first epoch-end log imports, by estimator: a spare imports it ahead (about a
# second of the first epoch on two busy cores otherwise). A PyTorch spare must not import
# TensorFlow for it (TensorBoard would, about 10 s a rank, without the marker module).
@pytest.mark.parametrize(
    "estimator, writer, with_tensorflow",
    [
        ("torch.TorchEstimator", "torch.utils.tensorboard", False),
        ("keras.KerasEstimator", "tensorboard.summary.v2", True),
    ],
)
def test_an_estimators_spares_import_what_rank_0s_epoch_log_needs(
    estimator, writer, with_tensorflow
):
    module, name = estimator.split(".")
    # What a spare of that estimator imports before it waits, in a new process.
    program = (
        "import sys\n"
        "from flyte_hvd.launch.spare import import_ahead\n"
        f"from flyte_hvd.estimators.{module} import {name}\n"
        f"import_ahead({name}._preload)\n"
        f"print({writer!r} in sys.modules, 'tensorflow' in sys.modules)\n"
    )
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["True", str(with_tensorflow)], out.stdout
