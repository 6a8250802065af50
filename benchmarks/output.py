"""What does a rank's output cost? One rank printing 50 MB as fast as it can, against the same
rank printing nothing.

    python -m benchmarks.output [--rounds N] [--megabytes M] [--line-bytes B]

On a local[2] SparkSession (the Python-worker settings a ``HorovodSpark`` task gets), each
round runs ``flyte_hvd.spark.run`` once with a rank that prints nothing and once with a rank
that prints ``M`` MB in lines of ``B`` bytes, alternating. For each it reports the wall time of
``run()``, the time the rank itself spent printing, and the driver process's peak resident
memory above its level before the run (sampled every 10 ms). The driver's console is
``/dev/null``, so the figures are the launcher's cost, not a terminal's. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    import os

    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


class _PeakRss:
    def __init__(self) -> None:
        self.base = _rss_mb()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, _rss_mb())

    def __enter__(self) -> _PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _printer(total_bytes: int, line_bytes: int):
    def fn() -> float:
        import sys
        import time

        line = "━" * ((line_bytes - 1) // 3) + "\n"  # 3 bytes a character in UTF-8
        count = total_bytes // len(line.encode())
        write = sys.stdout.write
        started = time.perf_counter()
        for _ in range(count):
            write(line)
        sys.stdout.flush()
        return time.perf_counter() - started

    return fn


def _silent() -> float:
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--megabytes", type=int, default=50)
    parser.add_argument("--line-bytes", type=int, default=100)
    args = parser.parse_args()

    import os
    import sys

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # the ranks' Python: this venv's
    from pyspark.sql import SparkSession

    from flyte_hvd.spark import run
    from flyte_hvd.stage.flyte_task import PYTHON_WORKER_CONF

    builder = (
        SparkSession.builder.master("local[2]")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
    )
    for key, value in PYTHON_WORKER_CONF.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    printer = _printer(args.megabytes << 20, args.line_bytes)
    sides = {"silent": _silent, "printing": printer}
    figures: dict[str, dict[str, list[float]]] = {
        side: {"wall_s": [], "rank_print_s": [], "driver_rss_mb": []} for side in sides
    }
    with open("/dev/null", "w") as sink:
        run(_silent, num_proc=1, stdout=sink, stderr=sink, verbose=0)  # warm-up
        for _ in range(args.rounds):
            for side, fn in sides.items():
                with _PeakRss() as rss:
                    started = time.perf_counter()
                    [printing] = run(fn, num_proc=1, stdout=sink, stderr=sink, verbose=0)
                    wall = time.perf_counter() - started
                figures[side]["wall_s"].append(round(wall, 3))
                figures[side]["rank_print_s"].append(round(printing, 3))
                figures[side]["driver_rss_mb"].append(round(rss.peak - rss.base, 1))
    spark.stop()

    medians = {side: {k: statistics.median(v) for k, v in f.items()} for side, f in figures.items()}
    extra = medians["printing"]["wall_s"] - medians["silent"]["wall_s"]
    print(f"{'':10} {'run() s':>9} {'rank printing s':>16} {'driver RSS +MB':>15}")
    for side, m in medians.items():
        print(f"{side:10} {m['wall_s']:9.2f} {m['rank_print_s']:16.2f} {m['driver_rss_mb']:15.1f}")
    rate = args.megabytes / extra if extra > 0 else float("inf")
    print(f"{args.megabytes} MB of output cost {extra:.2f} s more ({rate:.0f} MB/s end to end)")
    print(
        json.dumps(
            {
                "benchmark": "output",
                "megabytes": args.megabytes,
                "line_bytes": args.line_bytes,
                "rounds": args.rounds,
                "medians": medians,
                "extra_wall_s": round(extra, 3),
                "rounds_figures": figures,
            }
        )
    )


if __name__ == "__main__":
    main()
