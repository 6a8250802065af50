"""How long from ``flyte_hvd.spark.run(fn, num_proc=2)`` until ``fn`` runs on every rank?

    python -m benchmarks.startup [--repeats N] [--session classic|connect|both]

On a warm local[2] SparkSession (classic, or Spark Connect on an in-process local[2] server;
``both``, the default, runs each in its own process and compares them), each run is broken
down into: stage scheduling (call to the barrier tasks starting), rank process start (task
start to the rank connecting back: ``mpiexec -n 1`` plus Python and imports), rendezvous
(joining the communicator and the secret check), job start (loading ``fn``) and
``hvd.init()`` inside ``fn``; and the way back, from the last rank's ``fn`` returning to
``run()`` returning (the ranks' exit, the results to the driver). The floor, measured in the
same run, is a barrier stage whose tasks only call ``allGather`` once: an RDD stage on a
classic session, a ``mapInArrow(barrier=True)`` stage on Connect. On a classic session the
DataFrame stage's floor is measured too, to compare the two launch paths. Prints a table and
ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def _fn():
    started = time.time()
    import flyte_hvd.core as hvd

    before = time.perf_counter()
    hvd.init()
    return started, time.perf_counter() - before, time.time()


def _floor_task(_):
    from pyspark import BarrierTaskContext

    BarrierTaskContext.get().allGather("ready")
    yield time.time()


def _floor_batches(batches):
    import pyarrow as pa

    for _ in batches:
        pass
    for at in _floor_task(None):
        yield pa.RecordBatch.from_pydict({"at": [at]})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--session", choices=["classic", "connect", "both"], default="both")
    args = parser.parse_args()
    if args.session == "both":
        _compare(args.repeats)
    else:
        _measure(args.repeats, args.session)


def _compare(repeats: int) -> None:
    """Each session kind in its own process (one SparkContext per process), then one line."""
    import subprocess

    kinds = {}
    for kind in ("classic", "connect"):
        command = [sys.executable, "-m", "benchmarks.startup", "--repeats", str(repeats)]
        out = subprocess.run(
            [*command, "--session", kind], capture_output=True, text=True, check=True
        ).stdout
        print(out, end="")
        kinds[kind] = json.loads(out.strip().splitlines()[-1])
    gap = kinds["connect"]["overhead_above_floor_s"] - kinds["classic"]["overhead_above_floor_s"]
    print(f"{'Connect overhead - classic':<28} {gap:8.3f}  (target <= 1 s)")
    summary = {
        "benchmark": "startup",
        "ranks": 2,
        "repeats": repeats,
        **{kind: {k: v for k, v in r.items() if k not in ("benchmark", "ranks", "repeats")}
           for kind, r in kinds.items()},
        "connect_minus_classic_overhead_s": round(gap, 3),
        "target_connect_minus_classic_s": 1.0,
    }  # fmt: skip
    print(json.dumps(summary))


def _measure(repeats: int, kind: str) -> None:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

    from pyspark.sql import SparkSession

    from flyte_hvd.spark import launch

    builder = (
        SparkSession.builder.config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
    )  # fmt: skip
    if kind == "connect":
        spark = builder.remote("local[2]").getOrCreate()
    else:
        spark = builder.master("local[2]").getOrCreate()
        spark.sparkContext.setLogLevel("ERROR")

    def rdd_floor_once() -> float:
        start = time.time()
        sc = spark.sparkContext
        ends = sc.parallelize(range(2), 2).barrier().mapPartitions(_floor_task).collect()
        return max(ends) - start

    def dataframe_floor_once() -> float:
        start = time.time()
        stage = spark.range(0, 2, 1, 2).mapInArrow(_floor_batches, "at double", barrier=True)
        return max(r.at for r in stage.collect()) - start

    floor_once = dataframe_floor_once if kind == "connect" else rdd_floor_once

    def ours_once() -> dict[str, float]:
        called = time.time()
        report = launch(_fn, num_proc=2, verbose=0)
        returned = time.time()
        t0 = report.submitted_at
        ev = report.events
        fn_start = max(started for started, _, _ in report.results)

        def span(a: str, b: str) -> float:
            return max(ev[r][b] - ev[r][a] for r in ev)

        return {
            "to_fn_start": fn_start - t0,
            "stage_scheduling": max(ev[r]["task_started"] for r in ev) - t0,
            "rank_process_start": span("task_started", "hello"),
            "rendezvous": span("hello", "joined"),
            "job_start": fn_start - max(ev[r]["joined"] for r in ev),
            "init": max(init for _, init, _ in report.results),
            # The ranks' exit and the results' way back, after the last rank's fn returned.
            "fn_end_to_return": returned - max(ended for _, _, ended in report.results),
            "whole_run": returned - called,
        }

    floor_once()  # warm: Python workers and the barrier coordinator exist afterwards
    ours_once()
    floors, runs, dataframe_floors = [], [], []
    if kind == "classic":
        dataframe_floor_once()
    for _ in range(repeats):  # interleaved, so load drift hits all alike
        floors.append(floor_once())
        runs.append(ours_once())
        if kind == "classic":
            dataframe_floors.append(dataframe_floor_once())
    spark.stop()

    median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    floor = statistics.median(floors)
    overhead = median["to_fn_start"] - floor
    print(f"{kind} session")
    print(f"{'phase (median of ' + str(repeats) + ')':<28} {'seconds':>8}")
    print(f"{'floor: barrier + allGather':<28} {floor:8.3f}")
    extra = {}
    if dataframe_floors:
        extra["dataframe_stage_floor_s"] = round(statistics.median(dataframe_floors), 3)
        print(f"{'  same, DataFrame stage':<28} {extra['dataframe_stage_floor_s']:8.3f}")
    for key in ("stage_scheduling", "rank_process_start", "rendezvous", "job_start", "init"):
        print(f"{key:<28} {median[key]:8.4f}")
    print(f"{'run() to fn on every rank':<28} {median['to_fn_start']:8.3f}")
    print(f"{'fn returned to run() returns':<28} {median['fn_end_to_return']:8.3f}")
    print(f"{'run() whole':<28} {median['whole_run']:8.3f}")
    print(f"{'overhead above floor':<28} {overhead:8.3f}  (target <= 2 s)")
    summary = {
        "benchmark": "startup",
        "session": kind,
        "ranks": 2,
        "repeats": repeats,
        "floor_s": round(floor, 3),
        **extra,
        **{f"{k}_s": round(v, 4) for k, v in median.items()},
        "overhead_above_floor_s": round(overhead, 3),
        "target_overhead_s": 2.0,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
