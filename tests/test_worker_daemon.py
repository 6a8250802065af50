"""The Python worker daemon HorovodSpark sessions use: pyspark from its installed package,
not from the archives Spark puts first on the workers' path."""

from __future__ import annotations

import os

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
