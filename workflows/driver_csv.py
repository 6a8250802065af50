"""CSV files read on the Spark driver and handed to Spark.

The dataset's files are on the driver's disk (a ``FlyteDirectory`` downloaded there). Spark's
own CSV reader reads a path on the executors, which on a cluster are other hosts that cannot
see that disk; and reading from the object store with Spark needs S3 jars in Spark's JVM. So
the driver reads each file with pyarrow and hands the rows to Spark (``createDataFrame`` of an
Arrow table), which ships them to the executors with the tasks.
"""

from __future__ import annotations

import csv

import pyarrow as pa
from pyarrow import csv as pa_csv
from pyspark.sql import DataFrame, SparkSession


def read_csv_on_driver(spark: SparkSession, path: str) -> DataFrame:
    """A CSV file as ``spark.read.csv(path, header=True, inferSchema=False)`` reads it: the
    header row names the columns, every value is a string, an empty field is null. (A doubled
    quote inside quotes is one quote here, as RFC 4180 says; Spark's reader keeps both.)"""
    with open(path, newline="") as f:
        header = next(csv.reader(f), None)
    if not header:
        raise ValueError(f"`{path}` has no header row; expected the column names on line 1.")
    table = pa_csv.read_csv(
        path,
        convert_options=pa_csv.ConvertOptions(
            column_types={name: pa.string() for name in header},
            null_values=[""],
            strings_can_be_null=True,
            quoted_strings_can_be_null=False,
        ),
    )
    return spark.createDataFrame(table)
