"""What do the estimators cost next to the same work done by hand, and how fast is
``transform``?

    python -m benchmarks.estimator [--rows 200000] [--predict-rows 1000000] [--rounds 5]
                                   [--epoch-rounds 5]

Same data (rows x 20 float features), same MLP, same batch, in one run. These machines are
shared and noisy, so every comparison alternates ours and the reference ``--rounds`` times
(``--epoch-rounds`` for the epochs, whose sub-second figures vary most) and reports the
medians, both sides seeing the same neighbours:

- epoch, Keras: the steady epoch (the median of a fit's epochs after the first, which builds
  the graph) of ``KerasEstimator(num_proc=1)`` against plain ``model.fit`` on in-memory numpy;
- epoch, PyTorch: ``TorchEstimator(num_proc=1)`` against a plain loop over in-memory tensors
  (a shuffled index per epoch, forward, backward, step, the loss read each step);
- first step: the time from ``fit()`` to the first training step with 2 ranks, cold (the
  session's first fit: data preparation included) and warm (a second fit on the same
  DataFrame, whose prepared data is reused), with ``prepare_data`` alone timed once more;
- transform: rows/s of ``KerasModel.transform`` against plain ``model.predict`` on the same
  rows in one process (the session has the Python-worker settings HorovodSpark tasks get:
  Unix domain sockets, pyspark imported from its package; ``--spark-default-workers`` leaves
  Spark's loopback TCP and its own daemon), with its
  breakdown (the same transform on the DataFrame's own partitions, one per 10 k rows as
  ``createDataFrame`` of pandas makes them, instead of the ones it merges them into; on the
  merged partitions, the query's input alone, in the JVM, and the same Spark query with a UDF
  that does not call the model; larger Arrow batches; the default against Spark's Arrow
  batches one model call each, as before ``transform_batch_rows`` joined them, alternating),
  against a row-at-a-time UDF (Horovod's
  way; measured on a sample), and the CPU seconds of one transform in Spark's JVM and in its
  Python workers, against plain predict's, with the CPU one more Spark task costs.

The cold first step also reports how busy the machine's cores were until that step and the
CPU seconds a new rank spends importing its framework (Keras and TensorFlow), as ranks import
it (garbage collector paused) and with the collector running.

Ends with one JSON line: per target, our figure, the reference measured in this run, their
ratio and whether the target is met.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

FEATURES = 20
GLOBAL_BATCH = 256
EPOCHS = 4  # per fit: the first builds the graph, the other three are steady
TARGETS = {  # from issue 20
    "keras_epoch_vs_plain_max": 1.15,
    "torch_epoch_vs_plain_max": 1.15,
    "first_step_cold_s_max": 8.0,
    "first_step_warm_s_max": 3.0,
    "transform_vs_plain_min": 0.6,
    "transform_small_vs_plain_min": 0.75,  # issue 50, at 100 k rows
    "transform_vs_row_udf_min": 100.0,
}


def _model():
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(0.001), loss="mse")
    return model


def _torch_model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
        torch.nn.ReLU(), torch.nn.Linear(64, 1),
    )  # fmt: skip


def _data(rows: int):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, FEATURES)).astype("float32")
    y = (x[:, :5].sum(axis=1, keepdims=True) + 0.1).astype("float32")
    return x, y


def _steady(seconds: list[float]) -> float:
    return statistics.median(seconds[1:])


def _busy_cores() -> tuple[float, float]:
    """(busy, all) CPU seconds of the whole machine so far, from /proc/stat."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:9]]
    idle = ticks[3] + ticks[4]  # idle, iowait
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(ticks) - idle) / hz, sum(ticks) / hz


def _process_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def _pyspark_workers(jvm_pid: int) -> list[int]:
    """The JVM's descendant processes that are PySpark's daemon or its Python workers."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    found, frontier = [], [jvm_pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier]
        for pid in children:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"pyspark" in f.read():
                        found.append(pid)
            except OSError:
                continue
        frontier = children
    return found


def _cpu_split(jvm_pid: int, action) -> dict:
    """CPU seconds that ``action`` cost the JVM (local mode: driver and executors) and the
    PySpark Python workers, and the wall time it took."""

    def snapshot() -> dict[int, float]:
        out = {}
        for pid in [jvm_pid, *_pyspark_workers(jvm_pid)]:
            try:
                out[pid] = _process_cpu_s(pid)
            except OSError:
                continue
        return out

    before = snapshot()
    start = time.perf_counter()
    action()
    wall = time.perf_counter() - start
    after = snapshot()
    spent = {pid: t - before.get(pid, 0.0) for pid, t in after.items()}
    jvm = spent.pop(jvm_pid, 0.0)
    python = sum(spent.values())
    return {"wall_s": round(wall, 2), "jvm_cpu_s": round(jvm, 2),
            "python_workers_cpu_s": round(python, 2),
            "busy_cores": round((jvm + python) / wall, 2)}  # fmt: skip


def _import_cpu_s(module: str, collector_paused: bool = True) -> float:
    """CPU seconds a fresh interpreter spends importing ``module``: as each new rank imports
    it (Python's garbage collector paused, ``flyte_hvd.launch.job.collector_paused``), or with
    the collector running."""
    imports = (
        "from flyte_hvd.launch.job import collector_paused\n"
        f"with collector_paused(): import {module}"
        if collector_paused
        else f"import {module}"
    )
    code = f"import time\nt = time.process_time()\n{imports}\nprint(time.process_time() - t)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return round(float(out.stdout.split()[-1]), 2)


def plain_keras_fit(x, y) -> float:
    import keras

    seconds: list[float] = []

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            seconds.append(time.perf_counter() - self.start)

    _model().fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, verbose=0, callbacks=[Timer()])
    return _steady(seconds)


def plain_torch_fit(x, y) -> float:
    import torch

    model = _torch_model()
    optimizer = torch.optim.Adam(model.parameters(), 0.001)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    seconds = []
    for _ in range(EPOCHS):
        start = time.perf_counter()
        total = 0.0
        for index in torch.randperm(len(xt)).split(GLOBAL_BATCH):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(xt[index]), yt[index])
            loss.backward()
            optimizer.step()
            total += float(loss.detach())
        seconds.append(time.perf_counter() - start)
    return _steady(seconds)


def estimator_fit(df, store, num_proc: int, framework: str = "keras") -> dict:
    run_id = f"bench_{framework}_{num_proc}_{time.time_ns()}"
    common = dict(
        num_proc=num_proc, store=store, feature_cols=["features"], label_cols=["label"],
        batch_size=GLOBAL_BATCH // num_proc, epochs=EPOCHS, verbose=0, run_id=run_id,
    )  # fmt: skip
    if framework == "keras":
        from flyte_hvd.estimators.keras import KerasEstimator

        estimator = KerasEstimator(model=_model(), **common)
    else:
        import torch

        from flyte_hvd.estimators.torch import TorchEstimator

        model = _torch_model()
        estimator = TorchEstimator(
            model=model, optimizer=torch.optim.Adam(model.parameters(), 0.001),
            loss=torch.nn.functional.mse_loss, **common,
        )  # fmt: skip
    samples: list[tuple[float, float, float]] = []  # (time, busy, all) CPU seconds
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.1):
            samples.append((time.time(), *_busy_cores()))

    sampler = threading.Thread(target=sample, daemon=True)
    started = time.time()
    samples.append((started, *_busy_cores()))
    sampler.start()
    try:
        fitted = estimator.fit(df)
    finally:
        done.set()
        sampler.join()
    state = json.loads(store.read(store.get_state_path(run_id)))
    # How busy the machine's cores were from fit() to the first step: near 1 means the
    # time to the first step is bought with CPU work, not lost waiting.
    upto = [s for s in samples if s[0] <= state["first_step_at"]]
    busy = (upto[-1][1] - upto[0][1]) / max(upto[-1][2] - upto[0][2], 1e-9)
    return {
        "steady_epoch_s": _steady(state["epoch_seconds"]),
        "to_first_step_s": state["first_step_at"] - started,
        "to_first_step_cpu_busy": round(busy, 2),
        "model": fitted,
    }


def _alternate(rounds: int, ours, reference) -> tuple[float, float, list]:
    """Median of ``rounds`` alternating measurements of each (ours first, then the reference,
    then ours ...): both see the same neighbours."""
    pairs = []
    for _ in range(rounds):
        pairs.append((ours(), reference()))
    return (
        statistics.median(p[0] for p in pairs),
        statistics.median(p[1] for p in pairs),
        [[round(a, 3), round(b, 3)] for a, b in pairs],
    )


def _target(ours: float, reference: float | None, limit: float, higher_is_better: bool,
            ratio: float | None = None) -> dict:  # fmt: skip
    value = ratio if ratio is not None else ours
    return {
        "ours": round(ours, 3),
        "reference": None if reference is None else round(reference, 3),
        "ratio": None if ratio is None else round(ratio, 3),
        "target": limit,
        "pass": bool(value >= limit if higher_is_better else value <= limit),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--predict-rows", type=int, default=1_000_000)
    parser.add_argument("--small-predict-rows", type=int, default=100_000)
    parser.add_argument("--row-udf-rows", type=int, default=3_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epoch-rounds", type=int, default=5)
    parser.add_argument(
        "--spark-default-workers", action="store_true",
        help="leave Spark's Python workers as Spark starts them (loopback TCP, its own daemon) "
        "instead of with the settings HorovodSpark tasks get (PYTHON_WORKER_CONF)",
    )  # fmt: skip
    args = parser.parse_args()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

    import pandas as pd
    from pyspark.ml.functions import array_to_vector
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F
    from pyspark.sql.types import DoubleType

    from flyte_hvd.data.prepare import prepare_data
    from flyte_hvd.data.store import Store
    from flyte_hvd.stage.flyte_task import PYTHON_WORKER_CONF

    # The Python-worker settings a HorovodSpark task's session gets (see flyte_hvd.flyte.task).
    spark_conf = {} if args.spark_default_workers else dict(PYTHON_WORKER_CONF)
    builder = SparkSession.builder.master("local[2]")
    for key, value in {
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.driver.memory": "4g",
        **spark_conf,
    }.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    x, y = _data(args.rows)
    pdf = pd.DataFrame({"features": list(x), "label": y[:, 0].astype(float)})
    df = spark.createDataFrame(pdf).select(
        array_to_vector("features").alias("features"), "label"
    ).cache()  # fmt: skip
    df.count()
    store = Store.create(tempfile.mkdtemp(prefix="flyte-hvd-bench-"))
    results: dict = {}

    # First step, 2 ranks: cold (this session's first fit), then warm (prepared data reused).
    cold = estimator_fit(df, store, 2)
    warm = estimator_fit(df, store, 2)
    start = time.perf_counter()
    with prepare_data(2, store, df, label_columns=["label"], feature_columns=["features"],
                      partitions_per_process=11, verbose=0):  # fmt: skip
        prepare_s = time.perf_counter() - start

    # Steady epochs, alternating ours and plain.
    keras_ours, keras_plain, keras_pairs = _alternate(
        args.epoch_rounds, lambda: estimator_fit(df, store, 1)["steady_epoch_s"],
        lambda: plain_keras_fit(x, y),
    )  # fmt: skip
    torch_ours, torch_plain, torch_pairs = _alternate(
        args.epoch_rounds, lambda: estimator_fit(df, store, 1, "torch")["steady_epoch_s"],
        lambda: plain_torch_fit(x, y),
    )  # fmt: skip

    # Prediction: our transform vs plain predict, alternating; then the breakdown.
    model = warm["model"]
    keras_model = model.getModel()
    xp, _ = _data(args.predict_rows)
    big = _cached_features(spark, xp)
    # Warm up every Python worker first (TensorFlow import, model load), as plain predict
    # runs in a process that has both already; then one untimed full run of each side, so
    # that both are measured in their steady state (the JVM compiles the transform's per-row
    # code during its first full run; TensorFlow's predict loop speeds up over its first).
    model.transform(big.sample(0.002, seed=0)).agg(F.sum("label__output")).collect()
    keras_model.predict(xp[:10_000], batch_size=10_000, verbose=0)

    def timed_rps(action) -> float:
        start = time.perf_counter()
        action()
        return args.predict_rows / (time.perf_counter() - start)

    def transform(transformer=model) -> float:
        return timed_rps(lambda: transformer.transform(big).agg(F.sum("label__output")).collect())

    # The same model keeping the DataFrame's own partitions (one task per 10 k rows here).
    as_given = model.copy({model.transform_partition_bytes: None})
    partitions = {"input": big.rdd.getNumPartitions(),
                  "transform": model.transform(big).rdd.getNumPartitions()}  # fmt: skip

    def plain_predict() -> float:
        # The same rows as a pandas column of arrays, as a user holding them would have them.
        frame = pd.DataFrame({"features": list(xp)})
        return timed_rps(lambda: keras_model.predict(
            np.stack(frame["features"].to_numpy()), batch_size=10_000, verbose=0))  # fmt: skip

    transform(), plain_predict()
    transform_rps, plain_rps, transform_pairs = _alternate(args.rounds, transform, plain_predict)
    breakdown = _transform_breakdown(spark, big, partitions["transform"], model, timed_rps)
    breakdown["as_given_partitions"] = round(transform(as_given))
    # The model calls joined (``transform_batch_rows``, the default) against Spark's Arrow
    # batches as they come, one model call each (before they were joined), alternating.
    spark_batches = model.copy().setTransformBatchRows(None)
    joined_rps, batches_rps, joined_pairs = _alternate(
        args.rounds, transform, lambda: transform(spark_batches)
    )
    breakdown["joined_batches"] = round(joined_rps)
    breakdown["spark_batches"] = round(batches_rps)
    small = _small_transform(spark, model, keras_model, args.small_predict_rows, args.rounds)
    # Where the CPU goes: Spark's JVM (local mode: driver and executors in one) against its
    # Python workers (model calls, Arrow in and out), and plain predict in this process.
    jvm_pid = int(spark._jvm.java.lang.ProcessHandle.current().pid())
    cpu = {
        "transform": _cpu_split(jvm_pid, transform),
        "transform_as_given_partitions": _cpu_split(jvm_pid, lambda: transform(as_given)),
    }
    # What one more Spark task costs: the CPU the as-given partitions' extra tasks add.
    extra_tasks = partitions["input"] - partitions["transform"]
    task_cpu_ms = {
        side: round(1000 * (cpu["transform_as_given_partitions"][side] - cpu["transform"][side])
                    / max(extra_tasks, 1), 1)
        for side in ("jvm_cpu_s", "python_workers_cpu_s")
    }  # fmt: skip
    cpu_start, wall_start = time.process_time(), time.perf_counter()
    plain_predict()
    plain_cpu, plain_wall = time.process_time() - cpu_start, time.perf_counter() - wall_start
    cpu["plain_predict"] = {"wall_s": round(plain_wall, 2), "cpu_s": round(plain_cpu, 2),
                            "busy_cores": round(plain_cpu / plain_wall, 2)}  # fmt: skip

    model_bytes = spark.sparkContext.broadcast(model._model_bytes)

    def predict_row(features):
        from flyte_hvd.estimators.keras import _worker_model

        m = _worker_model(model_bytes.value, {})
        return float(m.predict_on_batch(np.asarray([features.toArray()], np.float32))[0, 0])

    row_udf = F.udf(predict_row, DoubleType())
    sample = big.limit(args.row_udf_rows).cache()
    sample.count()
    sample.select(row_udf("features").alias("p")).limit(10).collect()  # load the model first
    start = time.perf_counter()
    sample.select(row_udf("features").alias("p")).agg(F.sum("p")).collect()
    row_rps = args.row_udf_rows / (time.perf_counter() - start)
    spark.stop()
    import_cpu = _import_cpu_s("keras")  # TensorFlow under it: what every Keras rank imports
    import_cpu_collector_on = _import_cpu_s("keras", collector_paused=False)

    limits = TARGETS
    results = {
        "keras_epoch_vs_plain": _target(
            keras_ours,
            keras_plain,
            limits["keras_epoch_vs_plain_max"],
            False,
            keras_ours / keras_plain,
        ),
        "torch_epoch_vs_plain": _target(
            torch_ours,
            torch_plain,
            limits["torch_epoch_vs_plain_max"],
            False,
            torch_ours / torch_plain,
        ),
        "first_step_cold_s": _target(
            cold["to_first_step_s"], None, limits["first_step_cold_s_max"], False
        ),
        "first_step_warm_s": _target(
            warm["to_first_step_s"], None, limits["first_step_warm_s_max"], False
        ),
        "transform_vs_plain": _target(
            transform_rps,
            plain_rps,
            limits["transform_vs_plain_min"],
            True,
            transform_rps / plain_rps,
        ),
        "transform_small_vs_plain": _target(
            small["transform"],
            small["plain"],
            limits["transform_small_vs_plain_min"],
            True,
            small["transform"] / small["plain"],
        ),
        "transform_vs_row_udf": _target(
            transform_rps,
            row_rps,
            limits["transform_vs_row_udf_min"],
            True,
            transform_rps / row_rps,
        ),
    }
    print(f"Spark settings beyond local[2]: {spark_conf or 'none'}")
    print(f"{args.rows} rows x {FEATURES} features, global batch {GLOBAL_BATCH}, "
          f"{EPOCHS} epochs a fit, {args.epoch_rounds} alternating rounds for the epochs, "
          f"{args.rounds} for transform")  # fmt: skip
    for name, r in results.items():
        ratio = "" if r["ratio"] is None else f"  ratio {r['ratio']:.2f}"
        print(f"{name:<24} ours {r['ours']:>12,.3f}  reference {r['reference'] or 0:>12,.3f}"
              f"{ratio}  target {r['target']}  {'pass' if r['pass'] else 'MISS'}")  # fmt: skip
    print(f"prepare_data alone (2 ranks, a new write): {prepare_s:.2f} s")
    print(
        f"transform partitions: {partitions['input']} in the DataFrame, {partitions['transform']}"
        f" after transform merged them; one more task costs {task_cpu_ms} ms of CPU"
    )
    print(f"transform breakdown: {json.dumps(breakdown)}")
    floor = small["spark_count"] / small["plain"]
    print(f"{args.small_predict_rows} rows, rows/s: transform {small['transform']:,.0f}, plain "
          f"{small['plain']:,.0f}, Spark counting the same rows {small['spark_count']:,.0f} "
          f"(the most any transform reaches: {floor:.2f}x plain)")  # fmt: skip
    print(f"CPU, {args.predict_rows} rows: {json.dumps(cpu)}")
    print(f"cold first step: machine {cold['to_first_step_cpu_busy']:.0%} busy; a rank's "
          f"framework import costs {import_cpu:.2f} CPU s ({import_cpu_collector_on:.2f} with "
          f"the garbage collector running)")  # fmt: skip
    print(json.dumps({
        "benchmark": "estimator",
        "rows": args.rows,
        "predict_rows": args.predict_rows,
        "rounds": args.rounds,
        "epoch_rounds": args.epoch_rounds,
        "spark_conf": spark_conf,
        "targets": results,
        "pairs": {"keras_epoch_s": keras_pairs, "torch_epoch_s": torch_pairs,
                  "transform_rows_per_s": transform_pairs,
                  "joined_vs_spark_batches_rows_per_s": joined_pairs},
        "first_step_s": {"cold": round(cold["to_first_step_s"], 2),
                         "warm": round(warm["to_first_step_s"], 2),
                         "prepare_data_s": round(prepare_s, 2),
                         "cold_cpu_busy": cold["to_first_step_cpu_busy"],
                         "rank_framework_import_cpu_s": import_cpu,
                         "framework_import_cpu_s_collector_on": import_cpu_collector_on},
        "transform_partitions": partitions,
        "transform_breakdown_rows_per_s": breakdown,
        "transform_small_rows_per_s": small,
        "predict_cpu": cpu,
        "transform_task_cpu_ms": task_cpu_ms,
    }))  # fmt: skip


def _cached_features(spark, x: np.ndarray):
    """The rows of ``x`` as a cached DataFrame of one vector column, ``features``, in the
    partitions ``createDataFrame`` of pandas makes (one per 10 k rows)."""
    import pandas as pd
    from pyspark.ml.functions import array_to_vector

    df = spark.createDataFrame(pd.DataFrame({"features": list(x)})).select(
        array_to_vector("features").alias("features")
    ).cache()  # fmt: skip
    df.count()
    return df


def _small_transform(spark, model, keras_model, rows: int, rounds: int) -> dict:
    """rows/s on ``rows`` rows (a cached DataFrame) of the transform, of plain predict and of
    Spark counting the same rows (a query that reads them and runs nothing else: no
    transform of them can be faster), the three alternating; medians and each round."""
    import pandas as pd
    from pyspark.sql import functions as F

    x, _ = _data(rows)
    df = _cached_features(spark, x)
    frame = pd.DataFrame({"features": list(x)})
    sides = {
        "transform": lambda: model.transform(df).agg(F.sum("label__output")).collect(),
        "plain": lambda: keras_model.predict(
            np.stack(frame["features"].to_numpy()), batch_size=10_000, verbose=0
        ),
        "spark_count": lambda: df.agg(F.count("*")).collect(),
    }
    for side in sides.values():  # each side's first run, untimed
        side()
    measured: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(rounds):
        for name, side in sides.items():
            start = time.perf_counter()
            side()
            measured[name].append(rows / (time.perf_counter() - start))
    df.unpersist()
    return {
        **{name: round(statistics.median(values)) for name, values in measured.items()},
        "rows": rows,
        "rounds": [[round(v) for v in values] for values in zip(*measured.values(), strict=True)],
    }


def _transform_breakdown(spark, big, partitions: int, model, timed_rps) -> dict:
    """rows/s, on the partitions the transform merges ``big`` into, of the transform's own
    input (reading the rows and ``vector_to_array``, in the JVM alone) and of its Spark query
    without the model call (that, plus Arrow in and out, the UDF's Python worker and joining
    the results back to the rows); and of the full transform with 4x larger Arrow batches."""
    import pyarrow as pa
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F
    from pyspark.sql.functions import ArrowUDFType

    def no_model(batches):
        for batch in batches:
            yield pa.array(np.zeros(len(batch), np.float64))

    udf = F.arrow_udf(no_model, "double", ArrowUDFType.SCALAR_ITER)  # type: ignore[call-overload]
    features = vector_to_array("features", "float32")  # the transform's input, as it builds it
    merged = big.coalesce(partitions)
    out = {}
    for name, query in (("jvm_input_only", merged.select(F.size(features).alias("p"))),
                        ("without_model", merged.select(udf(features).alias("p")))):  # fmt: skip
        query.agg(F.sum("p")).collect()
        out[name] = round(timed_rps(lambda q=query: q.agg(F.sum("p")).collect()))
    key = "spark.sql.execution.arrow.maxRecordsPerBatch"
    before = spark.conf.get(key)
    spark.conf.set(key, "40000")
    try:
        out["arrow_batches_40k"] = round(
            timed_rps(lambda: model.transform(big).agg(F.sum("label__output")).collect())
        )
    finally:
        spark.conf.set(key, before)
    return out


if __name__ == "__main__":
    main()
