"""How fast do a DataFrame's rows reach the ranks: straight from the DataFrame (``run(fn,
data=df)``) against through the Store (``prepare_data``, then each rank's Parquet loader)?

    python -m benchmarks.dataframe_to_ranks [--rows 1000000] [--features 20] [--rounds 3]

A DataFrame of ``--rows`` rows x ``--features`` float features and a label, computed by a
Spark plan (a join and ``withColumn``s over ``range``), on a warm local[2] session, 2 ranks.
Two sides, alternating, each round on a fresh Store (``prepare_data`` would otherwise reuse
the first round's split):

- streamed: ``run(fn, data=df)``; each rank reads its partition (``get_partition``) and
  turns the features into one float32 array;
- stored: ``prepare_data`` into a local Store, then ``run(fn)``; each rank reads its shard
  with ``ArrowDataLoader`` (in order, no shuffle: its fastest), one epoch of full batches.

Per side: the time from the call to every rank holding its rows (the call's wall time), the
rows per second that rate gives, the rank's own reading time, the bytes written to the Store
and the ranks' peak RSS. Medians over the rounds. Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from benchmarks import local_session, planned_features

SIZE = 2
BATCH = 1024


def _streamed(features: list[str]) -> dict:
    import resource

    import numpy as np

    from flyte_hvd.spark import get_partition

    start = time.perf_counter()
    table = get_partition()
    x = np.stack([table.column(c).to_numpy() for c in features], axis=1).astype(np.float32)
    return {
        "rows": len(x),
        "read_s": time.perf_counter() - start,
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _stored(path: str, features: list[str]) -> dict:
    import resource

    import flyte_hvd.core as hvd
    from flyte_hvd.data.loader import ArrowDataLoader

    hvd.init()
    start = time.perf_counter()
    loader = ArrowDataLoader(
        path, BATCH, rank=hvd.rank(), size=hvd.size(), shuffle=False, columns=features
    )
    rows = sum(len(batch[features[0]]) for batch in loader)
    return {
        "rows": rows,
        "read_s": time.perf_counter() - start,
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _folder_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(root, name))
        for root, _, names in os.walk(path)
        for name in names
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--features", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

    from flyte_hvd.data.prepare import prepare_data
    from flyte_hvd.data.store import Store
    from flyte_hvd.spark import run

    spark = local_session()
    features = [f"f{i}" for i in range(args.features)]
    df = planned_features(spark, args.rows, features)
    sides: dict[str, list[dict]] = {"streamed": [], "stored": []}
    run(lambda: None, num_proc=SIZE, verbose=0)  # the ranks' first start, paid by neither side
    for _ in range(args.rounds):
        start = time.perf_counter()
        ranks = run(_streamed, args=(features,), num_proc=SIZE, data=df, verbose=0)
        sides["streamed"].append(
            {"wall_s": time.perf_counter() - start, "store_bytes": 0, "ranks": ranks}
        )
        folder = tempfile.mkdtemp(prefix="flyte-hvd-bench-")
        try:
            store = Store.create(os.path.join(folder, "store"))
            start = time.perf_counter()
            with prepare_data(SIZE, store, df, ["label"], features, verbose=0) as idx:
                path = store.get_train_data_path(idx)
                ranks = run(_stored, args=(path, features), num_proc=SIZE, verbose=0)
                wall = time.perf_counter() - start
                written = _folder_bytes(os.path.join(folder, "store"))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        sides["stored"].append({"wall_s": wall, "store_bytes": written, "ranks": ranks})
    spark.stop()

    summary: dict[str, dict] = {}
    for side, rounds in sides.items():
        rows = [sum(r["rows"] for r in one["ranks"]) for one in rounds]
        assert all(n == rows[0] for n in rows), (side, rows)
        wall = statistics.median(one["wall_s"] for one in rounds)
        summary[side] = {
            "wall_s": round(wall, 2),
            "rows_into_ranks": rows[0],
            "rows_per_s": round(rows[0] / wall),
            "rank_read_s": round(
                statistics.median(max(r["read_s"] for r in one["ranks"]) for one in rounds), 3
            ),
            "store_mb": round(statistics.median(one["store_bytes"] for one in rounds) / 1e6, 1),
            "rank_peak_rss_mb": round(max(r["rss_mb"] for one in rounds for r in one["ranks"])),
        }
    print(
        f"{args.rows} rows x {args.features} features, local[2], {SIZE} ranks, medians of "
        f"{args.rounds} alternating rounds"
    )
    print(
        f"{'side':<10} {'wall s':>8} {'rows/s':>11} {'rank read s':>12} {'store MB':>9} "
        f"{'rank RSS MB':>12}"
    )
    for side, s in summary.items():
        print(
            f"{side:<10} {s['wall_s']:8.2f} {s['rows_per_s']:11d} {s['rank_read_s']:12.3f} "
            f"{s['store_mb']:9.1f} {s['rank_peak_rss_mb']:12d}"
        )
    speedup = summary["stored"]["wall_s"] / summary["streamed"]["wall_s"]
    print(f"streamed: {speedup:.2f}x the stored path's rate; nothing written to the Store")
    print(
        json.dumps(
            {
                "benchmark": "dataframe_to_ranks",
                "rows": args.rows,
                "features": args.features,
                "ranks": SIZE,
                "rounds": args.rounds,
                **summary,
                "streamed_speedup_vs_stored": round(speedup, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
