"""``flyte_hvd.spark.run`` and ``HorovodRunner`` on a local[2] SparkSession, classic and Spark
Connect (the ``spark`` fixture runs a test on both)."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import threading
import time

import pytest

from flyte_hvd.core.errors import RanksFailedError
from flyte_hvd.spark import HorovodRunner, get_available_devices, run
from flyte_hvd.stage.dispatch import is_connect_session

pytestmark = [pytest.mark.spark, pytest.mark.mpi]


def test_results_in_rank_order_and_allgather_agrees(spark, no_leftover_ranks):
    scale = 7  # captured: travels with the function

    def fn(offset):
        import numpy as np

        import flyte_hvd.core as hvd

        hvd.init()
        gathered = hvd.allgather(np.array([hvd.rank() * scale])).tolist()
        return hvd.rank() + offset, hvd.size(), hvd.local_rank(), gathered

    assert run(fn, args=(100,), num_proc=2) == [
        (100, 2, 0, [0, 7]),
        (101, 2, 1, [0, 7]),
    ]


def test_the_rendezvous_does_not_wait_for_sparks_barrier_poll(spark):
    """The ranks meet over the driver link. Spark's ``BarrierTaskContext.allGather`` answers
    no sooner than a second (its task polls the barrier's RPC once a second), so a
    rendezvous through it took at least 1 s from the ranks' hello to their join."""
    from flyte_hvd.stage.dispatch import launch

    report = launch(lambda: None, num_proc=2)
    assert sorted(report.events) == [0, 1]
    took = {r: e["joined"] - e["hello"] for r, e in report.events.items()}
    assert max(took.values()) < 1.0, took


def test_env_and_kwargs_reach_fn(spark):
    def fn(suffix=""):
        return os.environ["MY_SETTING"] + suffix

    assert run(fn, kwargs={"suffix": "!"}, num_proc=2, env={"MY_SETTING": "on"}) == ["on!"] * 2


def test_ranks_share_a_local_masters_cores(spark):
    """Spark gives its Python workers OMP_NUM_THREADS = spark.task.cpus (1); on local[2] the
    ranks divide the 2 cores instead, TensorFlow's intra-op pool takes the same share, and
    `env` still has the last word."""

    def threads():
        return os.environ["OMP_NUM_THREADS"], os.environ.get("TF_NUM_INTRAOP_THREADS")

    assert run(threads, num_proc=1) == [("2", "2")]
    assert run(threads, num_proc=2) == [("1", "1")] * 2
    assert run(threads, num_proc=1, env={"OMP_NUM_THREADS": "3"}) == [("3", "3")]
    assert run(threads, num_proc=1, env={"TF_NUM_INTRAOP_THREADS": "4"}) == [("2", "4")]


def test_tensorflow_threads_follow_omp_num_threads_unless_set():
    from flyte_hvd.launch.environment import rank_threads_env

    assert rank_threads_env({"OMP_NUM_THREADS": "3"}) == {"TF_NUM_INTRAOP_THREADS": "3"}
    assert rank_threads_env({"OMP_NUM_THREADS": "3", "TF_NUM_INTRAOP_THREADS": "8"}) == {}
    for omp in (None, "0", "4,2", ""):
        unusable = {} if omp is None else {"OMP_NUM_THREADS": omp}
        assert rank_threads_env(unusable) == {}, unusable


def test_local_thread_shares_by_master():
    from flyte_hvd.launch.environment import local_threads_env

    share = {
        ("local", 1): "1",
        ("local[4]", 1): "4",
        ("local[4]", 3): "1",
        ("local[8, 2]", 2): "4",  # with task retries
        ("local[*]", 1): str(os.cpu_count()),
        ("local[2]", 4): "1",  # never 0
    }
    for (master, ranks), threads in share.items():
        assert local_threads_env(master, ranks) == {"OMP_NUM_THREADS": threads}, master
    for master in ("local-cluster[2,1,1024]", "spark://host:7077", "k8s://https://api:443"):
        assert local_threads_env(master, 1) == {}, master


def test_local_masters_pass_on_every_stores_settings(monkeypatch):
    """What the driver set for S3, Google Cloud Storage, Azure and fsspec reaches a local
    master's workers and ranks (as the next test shows for one of them); nothing else does,
    and nothing crosses to another host."""
    from flyte_hvd.launch.environment import local_storage_env

    storage = {
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9000", "FSSPEC_S3_ANON": "false",
        "GOOGLE_APPLICATION_CREDENTIALS": "/keys/sa.json", "GCSFS_DEBUG": "1",
        "STORAGE_EMULATOR_HOST": "http://127.0.0.1:9023",
        "AZURE_STORAGE_CONNECTION_STRING": "AccountName=a;AccountKey=k",
    }  # fmt: skip
    for name, value in storage.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("FLYTE_HVD_UNRELATED", "x")
    passed = local_storage_env("local[2]")
    assert {k: v for k, v in passed.items() if k in storage} == storage
    assert "FLYTE_HVD_UNRELATED" not in passed
    assert local_storage_env("spark://host:7077") == {}


def test_ranks_import_code_added_with_add_py_file(spark, tmp_path):
    """Code shipped with SparkContext.addPyFile (how Flyte ships fast-registered code) is
    importable in the rank processes, not only in Spark's Python workers; and AWS_* settings
    the driver made after Spark started reach a local master's ranks."""
    import zipfile

    bundle = tmp_path / "bundle.zip"
    with zipfile.ZipFile(bundle, "w") as zf:
        zf.writestr("flyte_hvd_shipped_code.py", "VALUE = 7\n")
    if is_connect_session(spark):
        spark.addArtifacts(str(bundle), pyfile=True)  # Connect's addPyFile
    else:
        spark.sparkContext.addPyFile(str(bundle))
    os.environ["AWS_FLYTE_HVD_PROBE"] = "set-after-start"
    try:
        results = run(
            lambda: (__import__("flyte_hvd_shipped_code").VALUE, os.environ["AWS_FLYTE_HVD_PROBE"]),
            num_proc=2,
        )
    finally:
        del os.environ["AWS_FLYTE_HVD_PROBE"]
    assert results == [(7, "set-after-start"), (7, "set-after-start")]


def test_num_proc_defaults_to_default_parallelism(spark):
    def fn():
        import flyte_hvd.core as hvd

        hvd.init()
        return hvd.size()

    assert run(fn) == [2, 2]  # local[2]


def test_rank_output_reaches_driver_with_prefix(spark, caplog):
    out, err = io.StringIO(), io.StringIO()

    def fn():
        import flyte_hvd.core as hvd

        hvd.init()
        print(f"epoch done on {hvd.rank()}")
        print("careful", file=sys.stderr)

    caplog.set_level(logging.INFO, logger="flyte_hvd")
    run(fn, num_proc=2, stdout=out, stderr=err, verbose=0)
    assert "[0]<stdout>:epoch done on 0" in out.getvalue()
    assert "[1]<stdout>:epoch done on 1" in out.getvalue()
    assert "[1]<stderr>:careful" in err.getvalue()
    assert "flyte-hvd:" not in err.getvalue()
    # verbose=0: the launcher's own messages drop to DEBUG, below the logger's level
    assert not [r for r in caplog.records if r.name.startswith("flyte_hvd.spark")]

    out, err = io.StringIO(), io.StringIO()
    run(fn, num_proc=1, stdout=out, stderr=err, verbose=1, prefix_output_with_timestamp=True)
    connect = is_connect_session(spark)
    launcher = [r for r in caplog.records if r.name == "flyte_hvd.stage.pipeline"]
    assert [r.levelno for r in launcher] == [logging.INFO, logging.INFO]
    assert launcher[0].getMessage() == "running 1 ranks in a Spark barrier stage" + (
        " (DataFrame API)" if connect else ""
    )
    line = out.getvalue().splitlines()[0]
    assert line.endswith("[0]<stdout>:epoch done on 0") and line[:4].isdigit()


def test_too_many_ranks_fail_fast_with_slot_count(spark):
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"`num_proc`=3 but the cluster has 2 free task slot"):
        run(print, num_proc=3, start_timeout=120)
    assert time.monotonic() - started < 10


def test_dynamic_allocation_is_refused(spark_local2):
    conf = spark_local2.sparkContext._conf
    conf.set("spark.dynamicAllocation.enabled", "true")
    try:
        with pytest.raises(RuntimeError, match=r"spark\.dynamicAllocation\.enabled=false"):
            run(print, num_proc=1)
    finally:
        conf.set("spark.dynamicAllocation.enabled", "false")


def test_failing_rank_is_named_with_its_traceback(spark, no_leftover_ranks):
    def fn():
        import time

        import flyte_hvd.core as hvd

        hvd.init()
        if hvd.rank() == 1:
            raise KeyError("missing feature column on rank one")
        time.sleep(300)  # rank 0 would wait forever without the launcher stopping it

    started = time.monotonic()
    with pytest.raises(RanksFailedError) as info:
        run(fn, num_proc=2, verbose=0, stderr=io.StringIO())
    assert time.monotonic() - started < 60
    assert info.value.ranks == [1]
    message = str(info.value)
    assert "rank 1 failed" in message
    assert "KeyError: 'missing feature column on rank one'" in message
    assert "in fn\n    raise KeyError" in message


def test_killed_rank_reports_the_signal(spark, no_leftover_ranks):
    def fn():
        import os
        import signal
        import time

        import flyte_hvd.core as hvd

        hvd.init()
        if hvd.rank() == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(300)

    with pytest.raises(RanksFailedError, match=r"rank 0 died: Killed \(signal 9\)"):
        run(fn, num_proc=2, verbose=0, stderr=io.StringIO())


def test_a_failed_run_raises_once_its_ranks_are_gone(spark):
    """Spark stops a cancelled Python task only by killing its worker, seconds later; the
    driver ends the link instead and waits for the tasks to stop their ranks."""
    from conftest import rank_processes

    def fn():
        import time

        import flyte_hvd.core as hvd

        hvd.init()
        if hvd.rank() == 0:
            raise ValueError("boom")
        time.sleep(300)  # rank 1 would run on in its task

    before = set(rank_processes())
    with pytest.raises(RanksFailedError, match="boom"):
        run(fn, num_proc=2, verbose=0, stderr=io.StringIO())
    assert set(rank_processes()) - before == set()


def test_the_last_attempt_stops_at_once_for_a_killed_rank_and_waits_for_one_that_raised():
    """A peer's "connection closed" can reach the driver before the task of the rank the
    kernel killed reports the death: the stage is stopped only after a grace period then, so
    the killed rank's report still arrives and the error names it."""
    from flyte_hvd.stage.pipeline import on_rank_failure

    cancels = []
    handle = on_rank_failure(
        max_attempts=2, cancel=lambda: cancels.append(time.monotonic()), grace=0.3
    )
    # Spark retries what a retry can fix: nothing is cancelled
    assert handle(1, 0, "StoreTimeoutError: uploading x did not finish within 50s") is False
    assert cancels == []

    started = time.monotonic()
    assert handle(2, 0, "RuntimeError: Connection closed by peer") is True
    assert cancels == []  # not yet: the rank that died may still report
    assert handle(2, 1, "rank 1 died: Killed (signal 9)") is True
    assert len(cancels) == 1 and cancels[0] - started < 0.3  # the cause is known: at once
    time.sleep(0.6)
    assert len(cancels) == 1  # and the grace timer was stopped

    cancels.clear()
    started = time.monotonic()
    handle = on_rank_failure(
        max_attempts=1, cancel=lambda: cancels.append(time.monotonic()), grace=0.3
    )
    assert handle(1, 1, "ValueError: bad input") is True
    assert handle(1, 0, "RuntimeError: Connection closed by peer") is True  # one timer only
    time.sleep(0.6)
    assert len(cancels) == 1 and 0.3 <= cancels[0] - started < 0.6

    # Every rank has reported: nothing is left to wait for.
    cancels.clear()
    started = time.monotonic()
    handle = on_rank_failure(
        max_attempts=1, cancel=lambda: cancels.append(time.monotonic()), grace=0.3, num_proc=2
    )
    assert handle(1, 1, "ValueError: bad input") is True
    assert cancels == []
    assert handle(1, 0, "RuntimeError: Connection closed by peer") is True
    assert len(cancels) == 1 and cancels[0] - started < 0.3
    time.sleep(0.6)
    assert len(cancels) == 1  # the grace timer was stopped


def _driver_old_gen(spark):
    """The driver JVM's old generation, where G1 puts any array too large for a young region
    (a task result of a few MB is one)."""
    beans = spark.sparkContext._jvm.java.lang.management.ManagementFactory
    return next(p for p in beans.getMemoryPoolMXBeans() if "Old Gen" in p.getName())


def _rank_bytes(size):
    import flyte_hvd.core as hvd

    hvd.init()
    return bytes([hvd.rank() + 1]) * size


def test_a_large_result_never_passes_through_the_driver_jvm(spark_local2, no_leftover_ranks):
    size = 48 << 20
    old_gen = _driver_old_gen(spark_local2)
    before = old_gen.getUsage().getUsed()
    old_gen.resetPeakUsage()
    started = time.monotonic()
    first, second = run(_rank_bytes, args=(size,), num_proc=2, verbose=0)
    took = time.monotonic() - started
    growth = old_gen.getPeakUsage().getUsed() - before
    print(f"\n2 x {size >> 20} MiB results in {took:.1f}s; driver JVM old gen peak "
          f"+{growth >> 20} MiB")  # fmt: skip
    assert first == b"\1" * size and second == b"\2" * size
    # Through the stage, each result was in the driver's heap several times over (+592 MiB
    # for 2 x 64 MiB; 2 x 400 MiB killed the JVM of a 1 GiB driver).
    assert growth < size // 2
    assert spark_local2.sparkContext.parallelize(range(10), 2).sum() == 45


def test_a_result_above_the_limit_fails_naming_rank_and_size_and_the_session_survives(
    spark_local2, no_leftover_ranks
):
    def fn():
        import flyte_hvd.core as hvd

        hvd.init()
        return b"x" * ((8 << 20) if hvd.rank() == 1 else 10)

    started = time.monotonic()
    with pytest.raises(RanksFailedError) as info:
        run(fn, num_proc=2, verbose=0, stderr=io.StringIO(), max_result_bytes=4 << 20)
    took = time.monotonic() - started
    print(f"\nresult above the limit: error after {took:.1f}s")
    assert info.value.ranks == [1]
    assert (
        "rank 1's return value is 8.0 MiB pickled, above the limit of 4.0 MiB "
        "(FLYTE_HVD_MAX_RESULT_BYTES). Write large results to a file or the Store and return "
        "the path instead" in str(info.value)
    )
    assert "Traceback" not in str(info.value)
    assert took < 30
    assert spark_local2.sparkContext.parallelize(range(10), 2).sum() == 45
    assert run(_rank_bytes, args=(3,), num_proc=2, verbose=0) == [b"\1" * 3, b"\2" * 3]


def test_an_unpicklable_result_names_the_rank_and_its_type(spark_local2, no_leftover_ranks):
    def fn():
        import threading

        import flyte_hvd.core as hvd

        hvd.init()
        return threading.Lock() if hvd.rank() == 1 else 0

    with pytest.raises(RanksFailedError) as info:
        run(fn, num_proc=2, verbose=0, stderr=io.StringIO())
    assert info.value.ranks == [1]
    assert (
        "rank 1's return value (type lock) cannot be pickled: TypeError: cannot pickle "
        "'_thread.lock' object. Return something picklable (or write it to a file and return "
        "the path)." in str(info.value)
    )
    assert "cloudpickle.py" not in str(info.value)


def test_the_link_is_on_loopback_and_no_secret_is_in_job_tags_or_logs(
    spark_local2, monkeypatch, caplog
):
    from flyte_hvd.stage import pipeline, rdd_stage

    sc = spark_local2.sparkContext
    # Loopback on a local master, whatever `spark.driver.host` says (a session a user builds
    # has the host's outward address there).
    assert rdd_stage.ClassicBackend(sc).link_host() == "127.0.0.1"
    secrets_, tags, hosts = [], [], []
    new_secret, run_stage = pipeline.new_secret, rdd_stage.ClassicBackend.run_stage

    def recording_secret():
        secrets_.append(new_secret())
        return secrets_[-1]

    def recording_stage(self, task, num_proc, retried, tag, data=None):
        tags.append(tag)
        hosts.append(self.link_host())
        return run_stage(self, task, num_proc, retried, tag, data)

    monkeypatch.setattr(pipeline, "new_secret", recording_secret)
    monkeypatch.setattr(rdd_stage.ClassicBackend, "run_stage", recording_stage)
    with caplog.at_level(logging.DEBUG, logger="flyte_hvd"):
        assert run(_rank_bytes, args=(1,), num_proc=2) == [b"\1", b"\2"]
    [secret], [tag] = secrets_, tags
    assert tag.startswith("flyte-hvd-") and hosts == ["127.0.0.1"]
    run_id = tag[len("flyte-hvd-") :]
    assert not any(run_id[i : i + 4] in secret for i in range(len(run_id) - 3)), (tag, secret)
    assert not any(secret[i : i + 8] in caplog.text for i in range(len(secret) - 7))


def test_horovod_runner_returns_rank_zero_value(spark, no_leftover_ranks):
    def main(word="x"):
        import flyte_hvd.core as hvd

        hvd.init()
        return f"{word}-{hvd.rank()}-{hvd.size()}"

    assert HorovodRunner(np=2).run(main, word="spark") == "spark-0-2"
    assert HorovodRunner(np=-2).run(main, word="local") == "local-0-2"
    assert HorovodRunner(np=0).run(main) == "x-0-2"  # one rank per free slot of local[2]


@pytest.mark.parametrize("bad", [0, -1, "2", 1.5, True])
def test_bad_num_proc(spark_local2, bad):
    with pytest.raises(ValueError, match="num_proc"):
        run(print, num_proc=bad)


def test_unpicklable_fn_is_refused_before_launch(spark_local2):
    lock = threading.Lock()

    def fn():
        return lock.locked()

    with pytest.raises(ValueError, match="cannot be pickled"):
        run(fn, num_proc=1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"start_timeout": 0}, "start_timeout"),
        ({"env": {"A": 1}}, "`env` must map str to str"),
        ({"kwargs": [1]}, "`kwargs` must be a dict"),
    ],
)
def test_bad_arguments(spark_local2, kwargs, match):
    with pytest.raises(ValueError, match=match):
        run(print, num_proc=1, **kwargs)


def test_bad_horovod_runner_arguments():
    with pytest.raises(ValueError, match="`np` must be an int"):
        HorovodRunner(np="2")
    with pytest.raises(ValueError, match="driver_log_verbosity"):
        HorovodRunner(np=2, driver_log_verbosity="some")


def test_no_active_session_is_a_clear_error():
    code = "import flyte_hvd.spark as s; s.run(print, num_proc=1)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode != 0
    assert "no active SparkSession" in result.stderr


def test_no_devices_outside_spark():
    assert get_available_devices() == []


SPARES_AHEAD_SCRIPT = """
import json, os, sys, time
from pyspark.sql import SparkSession
from flyte_hvd.stage.dispatch import launch, start_spares

spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
         .config("spark.ui.showConsoleProgress", "false").getOrCreate())
module = "colorsys"  # any module: a spare imports it, then waits
start_spares(2, None, (module,)).join(180)
ahead = []
for pid in os.listdir("/proc"):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\\0")
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\\0")
    except OSError:
        continue
    is_rank = b"flyte_hvd.launch.bootstrap" in argv and b"mpiexec" not in argv[0]
    if is_rank and b"FLYTE_HVD_SPARE_PRELOAD=" + module.encode() in env:
        ahead.append(int(pid))
report = launch(os.getpid, num_proc=2, preload=(module,))
claimed = sorted(r for r, e in report.events.items() if "spare_claimed" in e)
print("RESULT " + json.dumps({"ahead": sorted(ahead), "ran_on": report.results,
                              "claimed": claimed}))
spark.stop()
"""


def test_spares_started_ahead_take_the_ranks_of_a_new_sessions_first_run(tmp_path):
    """Estimators call ``start_spares`` before ``prepare_data``: a short job starts a spare
    rank process (its modules imported) in each Python worker it lands in, and the run's
    barrier tasks in those workers hand their ranks to them. In a new session those are the
    only workers, so both ranks of the first run run in the spares started ahead."""
    import json

    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    result = subprocess.run(
        [sys.executable, "-c", SPARES_AHEAD_SCRIPT],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=280,
    )  # fmt: skip
    lines = [x for x in result.stdout.splitlines() if x.startswith("RESULT ")]
    assert result.returncode == 0 and lines, result.stderr[-3000:]
    found = json.loads(lines[0][len("RESULT ") :])
    assert len(found["ahead"]) == 2, found
    assert found["claimed"] == [0, 1], found
    assert sorted(found["ran_on"]) == found["ahead"], found


def test_executors_with_another_flyte_hvd_than_the_drivers_fail_naming_both(
    spark_local2, monkeypatch, no_leftover_ranks
):
    """A stale image on the executors, or a code bundle that ships a flyte_hvd of its own,
    stops the run as its tasks start, before any rank: the error names both versions and
    what to do. (The executors here are this checkout; the driver claims another version.)"""
    import flyte_hvd

    theirs = flyte_hvd.__version__
    monkeypatch.setattr(flyte_hvd, "__version__", "0.0.1.dev0")
    started = time.monotonic()
    with pytest.raises(RanksFailedError) as raised:
        run(print, num_proc=2, start_timeout=60)
    elapsed = time.monotonic() - started
    message = str(raised.value)
    assert f"flyte_hvd {theirs} in the executor of rank " in message
    assert "but flyte_hvd 0.0.1.dev0 on the Spark driver" in message
    assert "run both from one image" in message and "--copy all" in message
    assert elapsed < 20, f"{elapsed:.1f}s to the error"


# -- a DataFrame's rows shared by the ranks (`data=`) -------------------------------------------


def _own_partition():
    """On a rank: its rank, its partition's columns and rows, and where its file was."""
    import flyte_hvd.core as hvd
    from flyte_hvd.spark import get_partition
    from flyte_hvd.stage.partition import PARTITION_ENV

    hvd.init()
    table = get_partition()
    return hvd.rank(), table.column_names, table.to_pylist(), os.environ[PARTITION_ENV]


def test_each_rank_reads_its_own_share_of_the_data(spark, no_leftover_ranks):
    rows = [(i, i / 2, [float(i), -float(i)]) for i in range(11)]
    df = spark.createDataFrame(rows, ["id", "x", "pair"])
    results = run(_own_partition, num_proc=2, data=df)
    assert [rank for rank, *_ in results] == [0, 1]
    shares = [[(r["id"], r["x"], r["pair"]) for r in table] for _, _, table, _ in results]
    assert sorted(shares[0] + shares[1]) == rows  # every row once, values as given
    assert sorted(len(share) for share in shares) == [5, 6]  # balanced by rows
    assert all(columns == ["id", "x", "pair"] for _, columns, _, _ in results)
    for *_, path in results:  # each task's file went with its rank
        assert not os.path.exists(os.path.dirname(path)), path


def test_a_rank_without_rows_gets_the_columns(spark, no_leftover_ranks):
    df = spark.createDataFrame([(7, "only")], ["id", "name"])
    results = run(_own_partition, num_proc=2, data=df)
    assert sorted(len(table) for _, _, table, _ in results) == [0, 1]
    assert all(columns == ["id", "name"] for _, columns, _, _ in results)


def test_a_failing_rank_leaves_no_partition_file(spark, tmp_path, no_leftover_ranks):
    seen = tmp_path / "seen"
    seen.mkdir()

    def fails():
        from flyte_hvd.stage.partition import PARTITION_ENV

        path = os.environ[PARTITION_ENV]
        (seen / os.path.basename(os.path.dirname(path))).write_text(path)
        raise ValueError("the rank fails after reading nothing")

    df = spark.createDataFrame([(i,) for i in range(4)], ["id"])
    with pytest.raises(RanksFailedError, match="the rank fails after reading nothing"):
        run(fails, num_proc=2, data=df)
    paths = [p.read_text() for p in seen.iterdir()]
    assert len(paths) == 2 and not any(os.path.exists(os.path.dirname(p)) for p in paths)


def test_data_of_another_kind_is_refused_before_any_rank_starts(spark):
    import pandas as pd

    kind = "Spark Connect" if is_connect_session(spark) else "classic"
    with pytest.raises(ValueError) as caught:
        run(_own_partition, num_proc=2, data=pd.DataFrame({"id": [1, 2]}))
    assert str(caught.value).startswith(
        f"`data` must be a Spark DataFrame of the active {kind} session, whose rows the "
        "ranks share; found pandas.DataFrame."
    )


@pytest.mark.spark
@pytest.mark.mpi
def test_spares_serve_the_next_run_though_pytest_names_another_test(spark_local2, monkeypatch):
    """pytest renames the test phase in ``PYTEST_CURRENT_TEST`` at every phase; the ranks do
    not take it from the driver, so the spares one run leaves serve the next (with it, a
    test suite's every fit started two spares that no run could use)."""
    from conftest import idle_spares

    from flyte_hvd.stage.dispatch import launch

    module = "fractions"  # any module no other test preloads: the spares import it
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/a.py::test_one (call)")
    launch(os.getpid, num_proc=2, preload=(module,), verbose=0)
    deadline = time.monotonic() + 60
    while len(idle_spares(module)) < 2:
        assert time.monotonic() < deadline, "the run left no spare rank processes"
        time.sleep(0.1)
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/a.py::test_two (call)")
    report = launch(os.getpid, num_proc=2, preload=(module,), verbose=0)
    assert all("spare_claimed" in report.events[r] for r in (0, 1)), report.events
