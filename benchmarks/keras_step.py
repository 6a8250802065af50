"""What does gradient synchronization cost a Keras training step?

    python -m benchmarks.keras_step [--steps N]

Two ranks train an MLP of about 5 M parameters with ``DistributedOptimizer``. In the same run:
- sync: the optimizer's reduction of one step's gradients (all layers, fused, traced as in
  ``fit``), timed alone after a barrier, against the floor: one ``allreduce`` of a single
  buffer of the same bytes;
- the same reduction as it happens inside ``model.fit`` (includes waiting for the slower rank);
- the graph boundary: the same reduction through ``tf.py_function`` instead of
  ``tf.numpy_function``, and called eagerly (no op: ``flyte_hvd.tensorflow`` hands the
  tensors' numpy views straight to the core);
- throughput: samples/s of 2 ranks x 1 thread against 1 process x 2 threads on the same
  global batch.
Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

GLOBAL_BATCH = 256
FEATURES, HIDDEN = 512, 2048


def _model():
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(HIDDEN, activation="relu"),
            keras.layers.Dense(HIDDEN, activation="relu"),
            keras.layers.Dense(1),
        ]
    )


def _data(rows: int, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, FEATURES)).astype("float32")
    return x, x[:, :1] * 0.5


def _fit_seconds_per_step(model, x, y, batch: int, steps: int) -> float:
    model.fit(x[: batch * 2], y[: batch * 2], batch_size=batch, epochs=1, verbose=0)  # warm
    start = time.perf_counter()
    model.fit(x[: batch * steps], y[: batch * steps], batch_size=batch, epochs=1, verbose=0,
              shuffle=False)  # fmt: skip
    return (time.perf_counter() - start) / steps


def ranks_part(steps: int) -> dict:
    import keras
    import tensorflow as tf

    import flyte_hvd.keras as hvd
    from flyte_hvd.core import collectives
    from flyte_hvd.tensorflow import optimizer as dist

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    hvd.init()
    model = _model()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.001))
    model.compile(optimizer=opt, loss="mse")
    params = int(sum(np.prod(v.shape) for v in model.trainable_variables))

    # Sync time inside fit: wrap the fused reduction the optimizer calls.
    in_fit: list[float] = []
    original = collectives.grouped_allreduce

    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = original(*args, **kwargs)
        in_fit.append(time.perf_counter() - start)
        return out

    collectives.grouped_allreduce = timed
    x, y = _data(GLOBAL_BATCH // 2 * (steps + 2), seed=hvd.rank())
    step_s = _fit_seconds_per_step(model, x, y, GLOBAL_BATCH // 2, steps)
    collectives.grouped_allreduce = original

    # Sync time alone: the optimizer's reduction of real gradient tensors, after a barrier.
    with tf.GradientTape() as tape:
        loss = keras.losses.mean_squared_error(y[:8], model(x[:8]))
    grads = tape.gradient(loss, model.trainable_variables)
    total_bytes = int(sum(g.numpy().nbytes for g in grads))
    single = np.ones(total_bytes // 4, np.float32)
    # Traced as in fit: the tf.numpy_function boundary is part of the cost.
    reduce_step = tf.function(lambda: dist._allreduce_gradients(grads, opt._hvd))

    def py_function_reduce(*tensors):
        return collectives.grouped_allreduce([t.numpy() for t in tensors], name="py_function")

    py_step = tf.function(
        lambda: tf.py_function(py_function_reduce, grads, [g.dtype for g in grads])
    )
    eager_step = lambda: dist._allreduce_gradients(grads, opt._hvd)  # noqa: E731
    sync, floor, py_sync, eager_sync = [], [], [], []
    for _ in range(3):
        reduce_step()  # warm (traces once)
        py_step()
        eager_step()
        hvd.allreduce(single)
    for _ in range(15):  # interleaved, so load drift hits all alike
        for fn, times in ((reduce_step, sync), (lambda: hvd.allreduce(single), floor),
                          (py_step, py_sync), (eager_step, eager_sync)):  # fmt: skip
            hvd.barrier()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return {
        "params": params,
        "grad_bytes": total_bytes,
        "tensors": len(grads),
        "step_s": step_s,
        "sync_alone_s": statistics.median(sync),
        "floor_s": statistics.median(floor),
        "sync_in_fit_s": statistics.median(in_fit[-steps:]),
        "py_function_s": statistics.median(py_sync),
        "eager_s": statistics.median(eager_sync),
    }


def single_process_part(steps: int) -> float:
    """Runs in a fresh interpreter so its thread settings take effect."""
    import keras
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(2)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    model = _model()
    model.compile(optimizer=keras.optimizers.SGD(0.001), loss="mse")
    x, y = _data(GLOBAL_BATCH * (steps + 2), seed=0)
    return _fit_seconds_per_step(model, x, y, GLOBAL_BATCH, steps)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--single", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.single:
        print(json.dumps({"step_s": single_process_part(args.steps)}))
        return

    from flyte_hvd.launch.job import FunctionJob
    from flyte_hvd.launch.supervisor import launch_local

    ranks = launch_local(FunctionJob(ranks_part, (args.steps,)), 2, start_timeout=120)[0]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.keras_step", "--single", "--steps", str(args.steps)],
        capture_output=True, text=True, check=True, env=env,
    )  # fmt: skip
    single_step = json.loads(out.stdout.strip().splitlines()[-1])["step_s"]

    sync_ratio = ranks["sync_alone_s"] / ranks["floor_s"]
    two_ranks_sps = GLOBAL_BATCH / ranks["step_s"]
    one_proc_sps = GLOBAL_BATCH / single_step
    mb = ranks["grad_bytes"] / 1e6
    print(f"MLP {ranks['params'] / 1e6:.2f} M parameters, {ranks['tensors']} gradient tensors, "
          f"{mb:.1f} MB per step, global batch {GLOBAL_BATCH}")  # fmt: skip
    print(f"{'gradient sync, alone':<38} {ranks['sync_alone_s'] * 1e3:8.2f} ms")
    print(f"{'floor: one allreduce of the same bytes':<38} {ranks['floor_s'] * 1e3:8.2f} ms")
    print(f"{'sync / floor (target <= 1.3)':<38} {sync_ratio:8.2f}")
    print(f"{'gradient sync inside fit (with skew)':<38} {ranks['sync_in_fit_s'] * 1e3:8.2f} ms")
    print(f"{'same sync via tf.py_function':<38} {ranks['py_function_s'] * 1e3:8.2f} ms")
    print(f"{'same sync called eagerly (no op)':<38} {ranks['eager_s'] * 1e3:8.2f} ms")
    print(f"{'step, 2 ranks x 1 thread':<38} {ranks['step_s'] * 1e3:8.1f} ms "
          f"({two_ranks_sps:.0f} samples/s)")  # fmt: skip
    print(f"{'step, 1 process x 2 threads':<38} {single_step * 1e3:8.1f} ms "
          f"({one_proc_sps:.0f} samples/s)")  # fmt: skip
    print(
        json.dumps(
            {
                "benchmark": "keras_step",
                "ranks": 2,
                "params": ranks["params"],
                "grad_mb": round(mb, 2),
                "sync_alone_ms": round(ranks["sync_alone_s"] * 1e3, 3),
                "floor_ms": round(ranks["floor_s"] * 1e3, 3),
                "sync_vs_floor": round(sync_ratio, 3),
                "sync_in_fit_ms": round(ranks["sync_in_fit_s"] * 1e3, 3),
                "py_function_ms": round(ranks["py_function_s"] * 1e3, 3),
                "py_function_vs_numpy_function": round(
                    ranks["py_function_s"] / ranks["sync_alone_s"], 3
                ),
                "eager_ms": round(ranks["eager_s"] * 1e3, 3),
                "two_ranks_samples_per_s": round(two_ranks_sps, 1),
                "one_process_two_threads_samples_per_s": round(one_proc_sps, 1),
                "throughput_ratio": round(two_ranks_sps / one_proc_sps, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
