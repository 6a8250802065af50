"""The Python worker daemon HorovodSpark sessions use: pyspark from its installed package,
not from the archives Spark puts first on the workers' path."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from flyte_hvd.stage.worker_daemon import bundled_archives, installed_pyspark


def test_only_archives_inside_the_installed_pyspark_are_dropped(tmp_path):
    site = tmp_path / "site"
    package = site / "pyspark"
    (package / "python" / "lib").mkdir(parents=True)
    (package / "jars").mkdir()
    (package / "__init__.py").write_text("")
    inside = [package / "python" / "lib" / "pyspark.zip", package / "jars" / "spark-core.jar"]
    outside = tmp_path / "spark-home" / "python" / "lib" / "pyspark.zip"
    outside.parent.mkdir(parents=True)
    for archive in [*inside, outside]:
        archive.write_bytes(b"PK\x05\x06" + b"\0" * 18)  # an empty zip
    path = [str(inside[0]), str(outside), str(inside[1]), str(site)]
    assert installed_pyspark(path) == os.path.realpath(package)
    assert bundled_archives(path) == [str(inside[0]), str(inside[1])]
    # A Spark distribution's archives, with no pyspark installed beside them, stay.
    assert installed_pyspark(path[:3]) is None
    assert bundled_archives(path[:3]) == []


@pytest.mark.spark
def test_workers_import_pyspark_from_its_package(spark_local2):
    def inspect(_):
        import sys
        import zipimport

        import pyspark

        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            daemon = f.read().replace(b"\0", b" ").decode()
        package = os.path.dirname(os.path.realpath(pyspark.__file__))
        # Spark's archives inside the package (a job's own zips, addPyFile, may be there too).
        zips = [k for k, v in sys.path_importer_cache.items()
                if isinstance(v, zipimport.zipimporter) and k.startswith(package)]  # fmt: skip
        yield daemon, pyspark.__file__, zips

    [(daemon, origin, zips)] = (
        spark_local2.sparkContext.parallelize([0], 1).mapPartitions(inspect).collect()
    )
    assert "-m flyte_hvd.stage.worker_daemon" in daemon, daemon
    assert ".zip" not in origin and origin.endswith(os.path.join("pyspark", "__init__.py"))
    assert zips == []


def test_the_daemons_workers_print_no_tensorflow_import_notices():
    # The daemon's filter, then a forked worker: what both write to stderr, less the notices.
    program = (
        "import os, time\n"
        "from flyte_hvd.stage.worker_daemon import filter_stderr\n"
        "filter_stderr()\n"
        "notice = b'WARNING: All log messages before absl::InitializeLog() is called are "
        "written to STDERR\\n'\n"
        "os.write(2, notice + b'daemon\\n')\n"
        "if os.fork() == 0:\n"
        "    os.write(2, notice + b'worker\\n')\n"
        "    os._exit(0)\n"
        "os.wait()\n"
        "time.sleep(1)  # a daemon outlives its workers' writes; the filter ends with it\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, timeout=60, env=_env()
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == b"daemon\nworker\n"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "FLYTE_HVD_SPARK_LOG"}
    return {**env, **extra}


@pytest.mark.spark
@pytest.mark.parametrize("setting", ["error", "warn"])
def test_a_local_session_logs_errors_only_unless_asked(setting):
    from flyte_hvd.stage.flyte_task import BarrierTaskConfig

    conf = BarrierTaskConfig(1).local_spark_conf if setting == "error" else {}
    program = (
        "import sys\n"
        "from pyspark.sql import SparkSession\n"
        "b = SparkSession.builder.master('local[1]')\n"
        f"for k, v in {conf!r}.items():\n"
        "    b = b.config(k, v)\n"
        "s = b.getOrCreate()\n"
        "s.sparkContext._jvm.org.apache.log4j.LogManager.getLogger('flyte-hvd-test')"
        ".warn('a warning')\n"
        "s.range(3).count()\n"
        "s.stop()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        timeout=180,
        env=_env(FLYTE_HVD_SPARK_LOG=setting),
    )
    assert done.returncode == 0, done.stderr
    quiet = "Setting default log level" not in done.stderr and "a warning" not in done.stderr
    assert quiet == (setting == "error"), done.stderr


def test_the_filter_ends_with_its_daemon_and_drops_what_orphaned_workers_write_later():
    # Spark's shutdown ends the daemon first; its workers' tracebacks come after, and went
    # nowhere before there was a filter (the daemon's stderr was gone): so they still do.
    program = (
        "import os, time\n"
        "from flyte_hvd.stage.worker_daemon import filter_stderr\n"
        "filter_stderr()\n"
        "if os.fork() == 0:\n"
        "    time.sleep(1.5)\n"
        "    try:\n"
        "        os.write(2, b'late\\n')\n"
        "    except BrokenPipeError:\n"
        "        pass\n"
        "    os._exit(0)\n"
        "os.write(2, b'daemon\\n')\n"
        "time.sleep(0.5)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, timeout=60, env=_env()
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == b"daemon\n"
