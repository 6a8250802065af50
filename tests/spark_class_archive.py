"""The suite's Spark JVMs start from a class-data archive of Spark's classes (JDK's CDS).

    python tests/spark_class_archive.py [--build]

A JVM that starts Spark loads and verifies about 13,000 classes from Spark's jars; a dynamic
class-data archive (``-XX:ArchiveClassesAtExit``, JDK 13+) holds them already parsed and
verified, and the JVMs that name it (``-XX:SharedArchiveFile``) map it instead. Measured on 2
cores: a local[2] session, a few small jobs and ``toPandas``, 12.1-13.2 s and 14.2-16.0 busy
core-seconds without it, 7.7-8.2 s and 9.3-10.0 with it (docs/testing.md).

The archive is made once per Spark installation and JVM (``.cache/spark-classes/``, about 180
MB) by a session that runs what the suite's sessions run (DataFrames, Arrow, Parquet, a
barrier stage, Python UDFs). A JVM uses it only where its class path is the one it was made
with, which Spark's launcher builds from ``SPARK_CONF_DIR`` and the jars: the conf folder must
be missing or empty (CDS refuses a class path with a non-empty folder), so the suite's Spark
defaults travel as a properties file instead (``--properties-file`` in
``PYSPARK_SUBMIT_ARGS``, tests/conftest.py). Any other JVM, or one where the jars changed,
starts as before (``-Xshare:auto``, the default), without a word where its CDS warnings are off
(``-Xlog:cds=off,cds+dynamic=off``, which the conftest adds).

Without ``--build`` it prints the archive's path, or nothing where there is none yet.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FOLDER = REPO / ".cache" / "spark-classes"
# Where the archive is made beside its build's output (the JVM prints a line per class it
# skips) and a lock, so two test runs of one checkout build it once.
_LOG, _LOCK = FOLDER / "build.log", FOLDER / "build.lock"


def _java() -> str | None:
    home = os.environ.get("JAVA_HOME")
    found = os.path.join(home, "bin", "java") if home else shutil.which("java")
    return os.path.realpath(found) if found and os.path.exists(found) else None


def path() -> Path | None:
    """This Spark installation's and JVM's archive (made or not), or None without a JVM."""
    import pyspark

    java = _java()
    if java is None:
        return None
    jars = Path(pyspark.__file__).parent / "jars"
    key = f"{pyspark.__version__}|{jars}|{java}|{os.stat(java).st_mtime_ns}"
    return FOLDER / f"spark-{hashlib.sha256(key.encode()).hexdigest()[:16]}.jsa"


def existing() -> Path | None:
    """The archive where it is made already."""
    archive = path()
    return archive if archive is not None and archive.exists() else None


def build(defaults: Path) -> Path | None:
    """Makes the archive unless it exists (a session's worth of Spark, about 40 s on 2 cores,
    with ``defaults`` as its properties file); returns it, or None if the JVM made none (its
    output in ``.cache/spark-classes/build.log``)."""
    archive = path()
    if archive is None:
        return None
    FOLDER.mkdir(parents=True, exist_ok=True)
    with open(_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another run's build: wait for its archive
        if archive.exists():
            return archive
        for stale in FOLDER.glob("*.part"):  # a build that ended before its JVM did
            stale.unlink()
        partial = archive.with_suffix(f".{os.getpid()}.part")
        env = dict(os.environ)
        env.pop("SPARK_CONF_DIR", None)  # the class path the suite's JVMs have
        env["PYSPARK_PYTHON"] = env["PYSPARK_DRIVER_PYTHON"] = sys.executable
        env["PYSPARK_SUBMIT_ARGS"] = (
            f"--properties-file {defaults} --driver-java-options "
            f"-XX:ArchiveClassesAtExit={partial} pyspark-shell"
        )
        with open(_LOG, "w") as log:
            session = subprocess.run(
                [sys.executable, __file__, "--session"], env=env, stdout=log,
                stderr=subprocess.STDOUT, timeout=600, check=False,
            )  # fmt: skip
        # A session that failed did not wait for its JVM: what it wrote may be partial.
        if session.returncode != 0 or not partial.exists():
            return None
        partial.rename(archive)  # whole or not at all: a JVM reading it sees it complete
        return archive


def _session() -> None:
    """What the suite's sessions load: a local[2] session's DataFrames, Arrow both ways,
    Parquet, a pandas UDF, a barrier stage; then the JVM ends and writes the archive."""
    import pandas as pd
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .getOrCreate()
    )
    df = spark.range(20_000).withColumn("x", F.rand(1)).withColumn("k", F.col("id") % 7)
    df.groupBy("k").agg(F.avg("x")).collect()
    df.join(df.select("k").distinct(), "k").count()
    spark.createDataFrame(pd.DataFrame({"a": [1.0, 2.0], "b": [3, 4]})).toPandas()
    folder = FOLDER / f"parquet-{os.getpid()}"
    try:
        df.write.mode("overwrite").parquet(str(folder))
        spark.read.parquet(str(folder)).mapInArrow(lambda batches: batches, df.schema).count()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    rdd = spark.sparkContext.parallelize(range(4), 2).barrier()
    rdd.mapPartitions(lambda rows: [sum(rows)]).collect()
    process = spark.sparkContext._gateway.proc  # the JVM (spark-submit execs java)
    spark.stop()
    # It ends when its stdin closes, and writes the archive as it ends.
    process.stdin.close()
    process.wait(timeout=300)


if __name__ == "__main__":
    if "--session" in sys.argv:
        _session()
    elif "--build" in sys.argv:
        if path() is None:
            print("no archive: no java on PATH or in JAVA_HOME")
        else:
            built = build(REPO / "tests" / "spark-defaults.conf")
            print(built or f"no archive: the JVM made none; see {_LOG}")
    else:
        print(existing() or "")
