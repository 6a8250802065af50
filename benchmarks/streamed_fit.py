"""A KerasEstimator fit straight from the DataFrame (``materialize=False``) against the same fit
through Parquet in the Store (``materialize=True``), on a Store in S3.

    python -m benchmarks.streamed_fit [--rows 1000000] [--features 20] [--rounds 2]

A DataFrame of ``--rows`` rows: ``--features`` float features (one array column) computed by
a Spark plan (a join and ``withColumn``s over ``range``) and a label; a Store on moto's S3
server (a process of its own on 127.0.0.1); local[2], 2 ranks; a small Keras MLP, batches of
1024 rows. After one fit per path that neither side counts (the first start of its ranks),
each round runs, alternating the two paths, a 1-epoch and a 5-epoch fit per path, each in a
new Store folder (the materialized path would otherwise reuse its data).

Per path and epochs: the time from ``fit`` to the model, from ``fit`` to the first training
step (the run's ``state.json``), the bytes the fit left in the Store (``data_mb``: outside the
run's folder; ``run_mb``: checkpoints and logs) and the ranks' peak RSS (sampled from
``/proc``). Then the loaders alone, one shuffled epoch on each rank: rows per second from the
rank's partition (the streamed path) and from the Parquet in S3 (the materialized path).
Medians over the rounds; a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid

from benchmarks import local_session, planned_features

SIZE = 2
BATCH = 1024
BUCKET = "bench"
S3_OPTIONS = {"key": "bench", "secret": "bench", "client_kwargs": {"region_name": "us-east-1"}}


def _moto(port: int) -> subprocess.Popen:
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server
        except OSError:
            time.sleep(0.2)
    server.kill()
    raise RuntimeError("moto's S3 server did not start within 60 s")


class _PeakRss:
    """The largest resident set of any rank process while the block runs, sampled."""

    def __enter__(self) -> _PeakRss:
        self.peak_kb = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(0.2):
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        if b"flyte_hvd.launch.bootstrap" not in f.read():
                            continue
                    with open(f"/proc/{pid}/status") as f:
                        rss = next(int(x.split()[1]) for x in f if x.startswith("VmRSS:"))
                except (OSError, StopIteration, ValueError):
                    continue
                self.peak_kb = max(self.peak_kb, rss)


def _model(features: int):  # type: ignore[no-untyped-def]
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((features,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(1)]
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    return model


def _fit(df, store, features: int, epochs: int, materialize: bool) -> dict:  # type: ignore[no-untyped-def]
    from flyte_hvd.estimators.keras import KerasEstimator

    run_id = f"r{uuid.uuid4().hex[:8]}"
    estimator = KerasEstimator(
        num_proc=SIZE, store=store, model=_model(features), feature_cols=["features"],
        label_cols=["label"], batch_size=BATCH, epochs=epochs, verbose=0, random_seed=1,
        run_id=run_id, materialize=materialize,
    )  # fmt: skip
    with _PeakRss() as rss:
        start = time.time()
        model = estimator.fit(df)
        wall = time.time() - start
    state = json.loads(store.read(store.get_state_path(run_id)))
    run_prefix = store.fs_path(store.get_run_path(run_id)).rstrip("/") + "/"
    sizes = store.fs.du(store.fs_path(store.prefix_path), total=False)
    run_bytes = sum(n for path, n in sizes.items() if path.startswith(run_prefix))
    return {
        "fit_s": wall,
        "first_step_s": state["first_step_at"] - start,
        "data_mb": (sum(sizes.values()) - run_bytes) / 1e6,
        "run_mb": run_bytes / 1e6,
        "rank_peak_rss_mb": rss.peak_kb / 1024,
        "loss": model.getHistory()["loss"][-1],
    }


def _read_partition(metadata) -> dict:  # type: ignore[no-untyped-def]
    import flyte_hvd.core as hvd
    from flyte_hvd.data.dataset import partition_splits
    from flyte_hvd.data.loader import ArrowDataLoader
    from flyte_hvd.spark import get_partition

    hvd.init()
    start = time.perf_counter()
    table, _ = partition_splits(get_partition(), metadata.columns, False)
    loader = ArrowDataLoader(
        "partition", BATCH, rank=hvd.rank(), size=hvd.size(), metadata=metadata, table=table,
        float64_as="float32", inmemory_cache_all=False,
        steps_per_epoch=metadata.rows // (hvd.size() * BATCH),
    )  # fmt: skip
    rows = sum(len(b["label"]) for b in loader)
    return {"rows": rows, "s": time.perf_counter() - start}


def _read_parquet(store, path: str) -> dict:  # type: ignore[no-untyped-def]
    import flyte_hvd.core as hvd
    from flyte_hvd.data.loader import ArrowDataLoader

    hvd.init()
    start = time.perf_counter()
    loader = ArrowDataLoader(
        path, BATCH, rank=hvd.rank(), size=hvd.size(), store=store, float64_as="float32",
        inmemory_cache_all=False,
    )  # fmt: skip
    rows = sum(len(b["label"]) for b in loader)
    return {"rows": rows, "s": time.perf_counter() - start}


def _loader_rates(df, store) -> dict:  # type: ignore[no-untyped-def]
    """Rows per second into a rank: its loader over its partition, over Parquet in S3."""
    from flyte_hvd.data.prepare import prepare_data, stream_data
    from flyte_hvd.spark import run

    streamed = stream_data(SIZE, df, ["label"], ["features"])
    start = time.perf_counter()
    meta = streamed.metadata[0]
    ranks = run(_read_partition, args=(meta,), num_proc=SIZE, data=streamed.df, verbose=0)
    streamed_wall = time.perf_counter() - start
    with prepare_data(SIZE, store, df, ["label"], ["features"]) as idx:
        path = store.get_train_data_path(idx)
        stored = run(_read_parquet, args=(store, path), num_proc=SIZE, verbose=0)
    rate = lambda results: sum(r["rows"] for r in results) / max(r["s"] for r in results)  # noqa: E731
    return {
        "streamed_rank_rows_per_s": round(rate(ranks)),
        "streamed_stage_s": round(streamed_wall, 2),
        "parquet_rank_rows_per_s": round(rate(stored)),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--features", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

    import boto3
    from pyspark.sql import functions as F

    from flyte_hvd.data.store import Store

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = _moto(port)
    endpoint = f"http://127.0.0.1:{port}"
    options = {**S3_OPTIONS, "endpoint_url": endpoint}
    boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id="bench", aws_secret_access_key="bench",
        region_name="us-east-1",
    ).create_bucket(Bucket=BUCKET)  # fmt: skip
    spark = local_session("3g")
    names = [f"f{i}" for i in range(args.features)]
    planned = planned_features(spark, args.rows, names)
    df = planned.select(F.array(*names).alias("features"), "label")

    def store() -> Store:
        return Store.create(f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}", storage_options=options)

    sides = {f"{p}_{e}": [] for e in (1, 5) for p in ("streamed", "materialized")}
    try:
        # The ranks' first start, paid by neither side: each path's barrier stage runs in a
        # pool of Spark's Python workers of its own, which keeps spare ranks for its next fit.
        for materialize in (False, True):
            _fit(df, store(), args.features, 1, materialize)
        for _ in range(args.rounds):
            for epochs in (1, 5):
                for materialize in (False, True):
                    side = f"{'materialized' if materialize else 'streamed'}_{epochs}"
                    sides[side].append(_fit(df, store(), args.features, epochs, materialize))
                    print(side, {k: round(v, 2) for k, v in sides[side][-1].items()}, flush=True)
        rates = _loader_rates(df, store())
    finally:
        spark.stop()
        server.kill()

    summary = {
        side: {k: round(statistics.median(r[k] for r in rounds), 2) for k in rounds[0]}
        for side, rounds in sides.items()
    }
    print(f"{args.rows} rows x {args.features} features, Store on S3 (moto), local[2], {SIZE} "
          f"ranks, medians of {args.rounds} alternating rounds")  # fmt: skip
    print(f"{'side':<16} {'fit s':>7} {'1st step s':>11} {'data MB':>8} {'run MB':>7} "
          f"{'RSS MB':>7}")  # fmt: skip
    for side, s in summary.items():
        print(
            f"{side:<16} {s['fit_s']:7.2f} {s['first_step_s']:11.2f} {s['data_mb']:8.1f} "
            f"{s['run_mb']:7.1f} {s['rank_peak_rss_mb']:7.0f}"
        )
    ratios = {
        f"streamed_vs_materialized_fit_{e}_epoch": round(
            summary[f"streamed_{e}"]["fit_s"] / summary[f"materialized_{e}"]["fit_s"], 2
        )
        for e in (1, 5)
    }
    print(ratios, rates)
    print(
        json.dumps(
            {
                "benchmark": "streamed_fit",
                "rows": args.rows,
                "features": args.features,
                "ranks": SIZE,
                "rounds": args.rounds,
                **summary,
                **rates,
                **ratios,
            }
        )
    )


if __name__ == "__main__":
    main()
