"""How a workflow's code and data reach Spark executors that share nothing with the driver:
its package as a shipped zip (``flyte_hvd.stage.shipping``), its CSV files read on the driver
(``workflows.driver_csv``)."""

from __future__ import annotations

import sys
import uuid

import pytest

from flyte_hvd.stage.shipping import ship_package


@pytest.fixture
def driver_only_package(tmp_path, monkeypatch):
    """A package importable on the driver alone (its folder is on this process's sys.path,
    not on the executors' PYTHONPATH), as `pyflyte run` imports a workflow's package."""
    name = f"shipdemo_{uuid.uuid4().hex[:8]}"
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("")
    (tmp_path / name / "rules.py").write_text("def times_seven(x):\n    return 7 * x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    __import__(f"{name}.rules")
    yield name
    for module in [m for m in sys.modules if m.partition(".")[0] == name]:
        del sys.modules[module]


@pytest.mark.spark
@pytest.mark.timeout(240)
def test_ship_package_makes_a_driver_only_package_importable_on_executors(
    spark_cluster, driver_only_package
):
    rules = sys.modules[f"{driver_only_package}.rules"]
    rdd = spark_cluster.sparkContext.parallelize([1, 2, 3, 4], 2)

    def apply(items):
        return (rules.times_seven(x) for x in items)

    # Pickled by reference to the package, which the executors cannot import.
    with pytest.raises(Exception, match=f"No module named '{driver_only_package}'"):
        rdd.mapPartitions(apply).collect()

    name = ship_package(spark_cluster, f"{driver_only_package}.rules")
    assert name.startswith(f"{driver_only_package}-") and name.endswith(".zip")
    assert rdd.mapPartitions(apply).collect() == [7, 14, 21, 28]
    # Unchanged sources ship nothing new.
    includes = list(spark_cluster.sparkContext._python_includes)
    assert ship_package(spark_cluster, driver_only_package) == name
    assert spark_cluster.sparkContext._python_includes == includes


def test_ship_package_refuses_what_it_cannot_ship():
    import pyspark.sql  # noqa: F401 - an installed package, imported (ship_package imports none)

    with pytest.raises(ValueError, match=r"`module`='no_such_package_x': expected an imported"):
        ship_package(None, "no_such_package_x")
    with pytest.raises(ValueError, match=r"`module`='pyspark.sql' is installed"):
        ship_package(None, "pyspark.sql")


# (Spark's reader takes a doubled quote inside quotes as two characters, RFC 4180 as one: the
# Rossmann files have none.)
CSV = 'Store,Name,Open\n1,"Main St, 5",1\n2,,0\n3,"Ring Rd",\n'


@pytest.mark.spark
@pytest.mark.timeout(240)
def test_driver_csv_reads_as_sparks_csv_reader_does(spark_cluster, tmp_path):
    from workflows.driver_csv import read_csv_on_driver

    path = tmp_path / "stores.csv"
    path.write_text(CSV)
    ours = read_csv_on_driver(spark_cluster, str(path))
    sparks = spark_cluster.read.csv(str(path), header=True, inferSchema=False)
    assert ours.schema == sparks.schema
    assert [tuple(r) for r in ours.collect()] == [tuple(r) for r in sparks.collect()]
    assert [tuple(r) for r in ours.collect()] == [
        ("1", "Main St, 5", "1"),
        ("2", None, "0"),
        ("3", "Ring Rd", None),
    ]


def test_driver_csv_refuses_a_file_without_a_header(tmp_path):
    from workflows.driver_csv import read_csv_on_driver

    path = tmp_path / "empty.csv"
    path.write_text("")
    with pytest.raises(ValueError, match="has no header row"):
        read_csv_on_driver(None, str(path))
