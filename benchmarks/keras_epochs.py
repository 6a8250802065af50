"""What does an epoch of the Rossmann model cost on 2 ranks fed by the Parquet loader?

    python -m benchmarks.keras_epochs [--rounds N] [--epochs N] [--rows N]

Two ranks (``OMP_NUM_THREADS=1`` each, what a ``local[2]`` Spark session gives them) train the
Rossmann example's model (``workflows.rossmann_model``: 18 embeddings, 18 continuous inputs,
dense 1000-1000-1000-500) with ``DistributedOptimizer`` on a Parquet file of synthetic rows of
its columns, through ``ArrowDataLoader.to_tf_dataset`` as ``KerasEstimator`` does, for a few
epochs. Four settings, launched in alternation, ``--rounds`` times each:

- now: the defaults (TensorFlow's intra-op pool as ``OMP_NUM_THREADS`` says, tf.data's
  autotuning off in the loader's dataset);
- threads 2: TensorFlow's pool of 2 threads a rank, its size for this machine when nothing
  sets it;
- autotune on: tf.data's autotuning turned back on for the loader's dataset;
- before: both, as the ranks ran before.

Per launch: the steady epoch (the median of the epochs after the first), the longest wait for
the first step of an epoch after the first, and ms per step. Prints a table and ends with one
JSON line of the medians over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np

BATCH = 256
SETTINGS = {
    "now": {"threads": None, "autotune": False},
    "threads 2": {"threads": "2", "autotune": False},
    "autotune on": {"threads": None, "autotune": True},
    "before": {"threads": "2", "autotune": True},
}


def write_rows(path: str, rows: int) -> None:
    """Synthetic rows of the Rossmann model's columns (categories below 20, continuous in
    [0, 1), log sales around 8) as one Parquet file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from workflows.rossmann_features import CATEGORICAL_COLS, CONTINUOUS_COLS

    rng = np.random.default_rng(0)
    columns = {c: rng.integers(0, 20, rows).astype(np.int64) for c in CATEGORICAL_COLS}
    columns |= {c: rng.random(rows) for c in CONTINUOUS_COLS}
    columns["Sales"] = 8 + rng.normal(0, 0.5, rows)
    pq.write_table(pa.table(columns), path, row_group_size=4096)


def rank_part(path: str, epochs: int, autotune: bool) -> dict:
    """On each rank: fit the model for ``epochs`` and time every epoch and its first step."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import tensorflow as tf

    import flyte_hvd.keras as hvd
    from flyte_hvd.data.loader import ArrowDataLoader
    from workflows.rossmann_features import CATEGORICAL_COLS, FEATURE_COLS
    from workflows.rossmann_model import build_model, exp_rmspe

    hvd.init()
    model = build_model({c: [str(i) for i in range(20)] for c in CATEGORICAL_COLS}, 12.0, 8.0)
    optimizer = hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3, epsilon=1e-3))
    model.compile(optimizer=optimizer, loss="mae", metrics=[exp_rmspe])
    loader = ArrowDataLoader(path, BATCH, rank=hvd.rank(), size=hvd.size(), float64_as="float32")
    dataset = loader.to_tf_dataset(FEATURE_COLS, ["Sales"], float64_as="float32")
    if autotune:
        options = tf.data.Options()
        options.autotune.enabled = True
        dataset = dataset.with_options(options)

    class Times(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.epochs: list[float] = []
            self.first_steps: list[float] = []

        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            if batch == 0:
                self.first_steps.append(time.perf_counter() - self.start)

        def on_epoch_end(self, epoch, logs=None):
            self.epochs.append(time.perf_counter() - self.start)

    times = Times()
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), times]
    model.fit(
        dataset,
        epochs=epochs,
        steps_per_epoch=len(loader),
        callbacks=callbacks,
        verbose=0,
        shuffle=False,
    )
    return {"epochs": times.epochs, "first_steps": times.first_steps, "steps": len(loader)}


def launch(path: str, epochs: int, setting: dict) -> dict:
    from flyte_hvd.launch.job import FunctionJob
    from flyte_hvd.launch.supervisor import launch_local

    env = {"OMP_NUM_THREADS": "1"}
    if setting["threads"]:
        env["TF_NUM_INTRAOP_THREADS"] = setting["threads"]
    job = FunctionJob(rank_part, (path, epochs, setting["autotune"]))
    result = launch_local(job, 2, start_timeout=120, env=env)[0]
    later = result["epochs"][1:]
    return {
        "steady_epoch_s": statistics.median(later),
        "longest_first_step_s": max(result["first_steps"][1:]),
        "ms_per_step": 1e3 * statistics.median(later) / result["steps"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--rows", type=int, default=33_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "rows.parquet")
        write_rows(path, args.rows)
        runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
        for _ in range(args.rounds):
            for name, setting in SETTINGS.items():
                runs[name].append(launch(path, args.epochs, setting))

    def median(name: str, key: str) -> float:
        return round(statistics.median(r[key] for r in runs[name]), 3)

    now_epoch = median("now", "steady_epoch_s")
    print(
        f"{args.rows} rows, 2 ranks x OMP_NUM_THREADS=1, batch {BATCH} a rank, "
        f"{args.epochs} epochs, medians of {args.rounds} launches"
    )
    print(f"{'setting':<12} {'steady epoch s':>15} {'ms/step':>8} {'longest first step s':>21}")
    for name in SETTINGS:
        print(
            f"{name:<12} {median(name, 'steady_epoch_s'):>15.2f} "
            f"{median(name, 'ms_per_step'):>8.1f} {median(name, 'longest_first_step_s'):>21.2f}"
        )
    figures = {
        name.replace(" ", "_"): {
            "steady_epoch_s": median(name, "steady_epoch_s"),
            "ms_per_step": median(name, "ms_per_step"),
            "longest_first_step_s": median(name, "longest_first_step_s"),
        }
        for name in SETTINGS
    }
    ratios = {
        f"{name.replace(' ', '_')}_vs_now": round(median(name, "steady_epoch_s") / now_epoch, 3)
        for name in SETTINGS
        if name != "now"
    }
    print(
        json.dumps(
            {
                "benchmark": "keras_epochs",
                "rows": args.rows,
                "epochs": args.epochs,
                "rounds": args.rounds,
                **figures,
                **ratios,
            }
        )
    )


if __name__ == "__main__":
    main()
