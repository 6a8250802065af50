"""A Spark Connect server on local[2] for the tests, in its own process (and JVM), so it lives
beside the test process's own classic SparkContext (one SparkContext per JVM).

    python tests/connect_server.py PORT

The authentication token comes in ``SPARK_CONNECT_AUTHENTICATE_TOKEN``. Prints ``ready`` once
clients can connect, and stops when its stdin closes (the test process ended).
"""

from __future__ import annotations

import sys

from pyspark.sql import SparkSession


def main() -> None:
    port = sys.argv[1]
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("flyte-hvd-tests-connect")
        .config("spark.plugins", "org.apache.spark.sql.connect.SparkConnectPlugin")
        .config("spark.connect.grpc.binding.address", "127.0.0.1")
        .config("spark.connect.grpc.binding.port", port)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    print("ready", flush=True)
    sys.stdin.read()
    spark.stop()


if __name__ == "__main__":
    main()
