"""How long from ``flyte_hvd.spark.run(fn, num_proc=2)`` until ``fn`` runs on every rank?

    python -m benchmarks.startup [--repeats N]

On a warm local[2] SparkSession, each run is broken down into: stage scheduling (call to
the barrier tasks starting), rank process start (task start to the rank connecting back:
``mpiexec -n 1`` plus Python and imports), rendezvous (joining the communicator and the
secret check), job start (loading ``fn``) and ``hvd.init()`` inside ``fn``. The floor, measured
in the same run, is a barrier stage whose tasks only call ``allGather`` once. Prints a table
and ends with one JSON line.
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
    return started, time.perf_counter() - before


def _floor_task(_):
    from pyspark import BarrierTaskContext

    BarrierTaskContext.get().allGather("ready")
    yield time.time()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

    from pyspark.sql import SparkSession

    from flyte_hvd.spark import launch

    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    sc = spark.sparkContext

    def floor_once() -> float:
        start = time.time()
        ends = sc.parallelize(range(2), 2).barrier().mapPartitions(_floor_task).collect()
        return max(ends) - start

    def ours_once() -> dict[str, float]:
        report = launch(_fn, num_proc=2, verbose=0)
        t0 = report.submitted_at
        ev = report.events
        fn_start = max(started for started, _ in report.results)

        def span(a: str, b: str) -> float:
            return max(ev[r][b] - ev[r][a] for r in ev)

        return {
            "to_fn_start": fn_start - t0,
            "stage_scheduling": max(ev[r]["task_started"] for r in ev) - t0,
            "rank_process_start": span("task_started", "hello"),
            "rendezvous": span("hello", "joined"),
            "job_start": fn_start - max(ev[r]["joined"] for r in ev),
            "init": max(init for _, init in report.results),
        }

    floor_once()  # warm: Python workers and the barrier coordinator exist afterwards
    ours_once()
    floors, runs = [], []
    for _ in range(args.repeats):  # interleaved, so load drift hits both alike
        floors.append(floor_once())
        runs.append(ours_once())
    spark.stop()

    median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    floor = statistics.median(floors)
    overhead = median["to_fn_start"] - floor
    print(f"{'phase (median of ' + str(args.repeats) + ')':<28} {'seconds':>8}")
    print(f"{'floor: barrier + allGather':<28} {floor:8.3f}")
    for key in ("stage_scheduling", "rank_process_start", "rendezvous", "job_start", "init"):
        print(f"{key:<28} {median[key]:8.4f}")
    print(f"{'run() to fn on every rank':<28} {median['to_fn_start']:8.3f}")
    print(f"{'overhead above floor':<28} {overhead:8.3f}  (target <= 2 s)")
    summary = {
        "benchmark": "startup",
        "ranks": 2,
        "repeats": args.repeats,
        "floor_s": round(floor, 3),
        **{f"{k}_s": round(v, 4) for k, v in median.items()},
        "overhead_above_floor_s": round(overhead, 3),
        "target_overhead_s": 2.0,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
