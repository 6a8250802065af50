"""Benchmarks: one module per question, ``python -m benchmarks.<name>``; each ends with one
JSON line of figures and ratios. What several of them share is here."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession


def local_session(driver_memory: str = "2g") -> SparkSession:
    """A quiet ``local[2]`` session: no UI, no progress bars, errors only."""
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.memory", driver_memory)
        .config("spark.sql.shuffle.partitions", "4")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def planned_features(spark: SparkSession, rows: int, features: list[str]) -> DataFrame:
    """``rows`` rows of float ``features`` and a ``label``, computed by a Spark plan (a
    broadcast join and ``rand`` columns over ``range``), as a user's prepared data is."""
    from pyspark.sql import functions as F

    groups = spark.range(100).select(F.col("id").alias("group"), (F.col("id") / 100).alias("w"))
    return (
        spark.range(rows, numPartitions=4)
        .withColumn("group", F.col("id") % 100)
        .join(F.broadcast(groups), "group")
        .select(
            *[(F.rand(seed=i) * F.col("w")).alias(c) for i, c in enumerate(features)],
            F.rand(seed=999).alias("label"),
        )
    )
