"""``flyte_hvd.spark.run`` across separate executor processes (local-cluster[2,1,1024])."""

from __future__ import annotations

import io
import os
import re
import shlex
from pathlib import Path

import pytest

from flyte_hvd.core.errors import RanksFailedError
from flyte_hvd.spark import run

pytestmark = [pytest.mark.spark, pytest.mark.mpi]


def test_ranks_in_executor_processes(spark_cluster, no_leftover_ranks):
    out = io.StringIO()

    def fn():
        import numpy as np

        import flyte_hvd.core as hvd

        hvd.init()
        print(f"rank {hvd.rank()} in pid {os.getpid()}")
        total = hvd.allreduce(np.array([hvd.rank() + 1.0]), op=hvd.Sum)
        return hvd.rank(), float(total[0]), os.getppid()

    results = run(fn, num_proc=2, stdout=out, verbose=0)
    assert [(r, t) for r, t, _ in results] == [(0, 3.0), (1, 3.0)]
    assert "[0]<stdout>:rank 0 in pid" in out.getvalue()
    assert "[1]<stdout>:rank 1 in pid" in out.getvalue()


def test_each_rank_gets_its_own_gpu(spark_cluster):
    def fn():
        import flyte_hvd.core as hvd
        from flyte_hvd.spark import get_available_devices

        hvd.init()
        return get_available_devices(), os.environ.get("CUDA_VISIBLE_DEVICES")

    results = run(fn, num_proc=2, verbose=0)
    devices = [d for d, _ in results]
    assert all(len(d) == 1 for d in devices), devices
    assert devices[0] != devices[1]
    assert [cuda for _, cuda in results] == [d[0] for d in devices]


def test_stage_failing_once_is_retried_with_fresh_ranks(spark_cluster, tmp_path):
    marker = str(tmp_path / "failed-once")

    def fn():
        import flyte_hvd.core as hvd

        hvd.init()
        if hvd.rank() == 1 and not os.path.exists(marker):
            open(marker, "w").close()
            # What a retry can fix (flyte_hvd.launch.failures); a user error is not retried.
            raise ConnectionResetError("transient failure: the store reset the connection")
        return hvd.allgather_object(hvd.rank())

    assert run(fn, num_proc=2, verbose=0, stderr=io.StringIO()) == [[0, 1], [0, 1]]
    assert os.path.exists(marker)


def test_failure_in_executor_names_rank(spark_cluster, no_leftover_ranks):
    def fn():
        import flyte_hvd.core as hvd

        hvd.init()
        if hvd.rank() == 0:
            raise ZeroDivisionError("rank zero divides by zero")
        hvd.barrier()

    with pytest.raises(RanksFailedError, match="rank zero divides by zero") as info:
        run(fn, num_proc=2, verbose=0, stderr=io.StringIO())
    assert 0 in info.value.ranks


def test_the_suites_jvms_run_with_its_spark_defaults(spark_cluster):
    """The suite's properties file (``--properties-file`` in ``PYSPARK_SUBMIT_ARGS``, from
    ``tests/spark-defaults.conf``) reaches the driver's JVM and the executors' JVMs, and each
    maps the class-data archive of Spark's classes (tests/spark_class_archive.py): the suite's
    timings in docs/testing.md assume both."""
    import spark_class_archive

    args = shlex.split(os.environ["PYSPARK_SUBMIT_ARGS"])
    conf = Path(args[args.index("--properties-file") + 1]).read_text()
    (expected,) = re.findall(r"^spark\.driver\.defaultJavaOptions\s+(\S+)", conf, re.M)
    archive = spark_class_archive.existing()
    assert archive is not None, "no archive: python tests/spark_class_archive.py --build says why"
    jvm = spark_cluster.sparkContext._jvm
    driver = list(jvm.java.lang.management.ManagementFactory.getRuntimeMXBean().getInputArguments())
    assert expected in driver, driver
    driver_pid = spark_cluster.sparkContext._gateway.proc.pid
    mapped = str(archive) in Path(f"/proc/{driver_pid}/maps").read_text()
    assert mapped, f"the driver's JVM does not map {archive}: {driver}"

    def executor_jvm(_):
        pid = os.getpid()
        while pid > 1:  # the Python worker's daemon, then the executor's JVM
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode().split("\0")
            if os.path.basename(argv[0]) == "java":
                with open(f"/proc/{pid}/maps") as f:
                    mapped = str(archive) in f.read()
                yield " ".join(argv), mapped
                return
        yield "no JVM above the Python worker", False

    found = spark_cluster.sparkContext.parallelize(range(2), 2).mapPartitions(executor_jvm)
    for command, mapped in found.collect():
        assert expected in command and "CoarseGrainedExecutorBackend" in command, command
        assert mapped, f"the executor's JVM does not map {archive}: {command}"
