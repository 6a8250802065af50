"""The same data-parallel regression, with the ranks inside a Spark barrier stage.

Spark prepares the data; ``flyte_hvd.spark.run`` starts one rank per barrier task; each rank
trains on its partition's rows and ``allreduce`` keeps the ranks' weights identical.

    python examples/spark_data_parallel.py
"""

import os
import sys

import numpy as np
from pyspark.sql import SparkSession

from flyte_hvd.spark import run

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
spark = (
    SparkSession.builder.master("local[2]")
    .config("spark.ui.showConsoleProgress", "false")
    .getOrCreate()
)
spark.sparkContext.setLogLevel("ERROR")

TRUE_W = [2.0, -3.0, 0.5]
df = spark.range(4000).selectExpr(
    "rand(1) * 2 - 1 AS x0", "rand(2) * 2 - 1 AS x1", "rand(3) * 2 - 1 AS x2"
)
df = df.selectExpr("*", f"x0 * {TRUE_W[0]} + x1 * {TRUE_W[1]} + x2 * {TRUE_W[2]} AS y")
shards = [
    np.array(part, dtype=np.float64)
    for part in df.repartition(2).rdd.glom().map(lambda rows: [list(r) for r in rows]).collect()
]


def train(steps: int = 60, lr: float = 0.2):
    import flyte_hvd.core as hvd

    hvd.init()
    data = shards[hvd.rank()]  # captured: each rank picks its own shard
    x, y = data[:, :3], data[:, 3]
    w = hvd.broadcast(np.zeros(3), root_rank=0)
    for step in range(steps):
        grad = 2 * x.T @ (x @ w - y) / len(x)
        w -= lr * hvd.allreduce(grad, op=hvd.Average, name="grad")
        if hvd.rank() == 0 and step % 20 == 0:
            print(f"step {step:2d}  rank-0 loss {np.mean((x @ w - y) ** 2):.6f}")
    return w


weights = run(train, num_proc=2)
print(f"2 Spark barrier tasks trained w = {np.round(weights[0], 3)} (true {TRUE_W})")
assert np.allclose(weights[0], weights[1]), "ranks diverged"
spark.stop()
