"""Keras cases run on real rank processes (2 ranks); each asserts on every rank."""

from __future__ import annotations

import traceback

import numpy as np

CASES: dict[str, object] = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def run_cases(names: list[str] | None = None) -> dict[str, str | None]:
    import tensorflow as tf

    import flyte_hvd.keras as hvd

    tf.config.threading.set_intra_op_parallelism_threads(1)
    hvd.init()
    results: dict[str, str | None] = {}
    for name, fn in CASES.items():
        if names is None or name in names:
            try:
                fn()
                results[name] = None
            except Exception:
                results[name] = traceback.format_exc()
    return results


def _mlp(seed: int, width: int = 4):
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(width, activation="tanh"), keras.layers.Dense(1)]
    )


def _data(seed: int, rows: int):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 3)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5]]) + 0.3).astype("float32")
    return x, y


def _weights(model) -> list[np.ndarray]:
    return [np.asarray(w) for w in model.get_weights()]


def _assert_same_on_all_ranks(model) -> None:
    import flyte_hvd.keras as hvd

    mine = _weights(model)
    for theirs in hvd.allgather_object(mine):
        for a, b in zip(mine, theirs, strict=True):
            np.testing.assert_array_equal(a, b)


@case
def weights_identical_after_every_epoch():
    import keras

    import flyte_hvd.keras as hvd

    model = _mlp(seed=100 + hvd.rank())  # different starting weights on purpose
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
    x, y = _data(hvd.rank(), 64)  # different data per rank

    class Check(keras.callbacks.Callback):
        epochs = 0

        def on_epoch_end(self, epoch, logs=None):
            _assert_same_on_all_ranks(self.model)
            Check.epochs += 1

    model.fit(
        x, y, batch_size=16, epochs=3, verbose=0,
        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), Check()],
    )  # fmt: skip
    assert Check.epochs == 3


@case
def two_half_batches_equal_one_full_batch():
    import keras

    import flyte_hvd.keras as hvd

    n = hvd.size()
    x, y = _data(7, 16 * n * 3)  # same data everywhere; each rank trains on its slice
    model = _mlp(seed=1)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    reference = _mlp(seed=1)
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    for step in range(3):
        batch = slice(step * 16 * n, (step + 1) * 16 * n)
        xb, yb = x[batch], y[batch]
        mine = slice(hvd.rank() * 16, (hvd.rank() + 1) * 16)
        model.train_on_batch(xb[mine], yb[mine])
        reference.train_on_batch(xb, yb)
    for a, b in zip(_weights(model), _weights(reference), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@case
def backward_passes_two_equal_one_double_batch():
    import keras

    import flyte_hvd.keras as hvd

    n = hvd.size()
    x, y = _data(8, 8 * 2 * n)
    model = _mlp(seed=2)
    opt = hvd.DistributedOptimizer(
        keras.optimizers.SGD(0.1), backward_passes_per_step=2, average_aggregated_gradients=True
    )
    model.compile(optimizer=opt, loss="mse")
    reference = _mlp(seed=2)
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    start = _weights(model)
    r = hvd.rank()
    model.train_on_batch(x[r * 16 : r * 16 + 8], y[r * 16 : r * 16 + 8])
    for a, b in zip(_weights(model), start, strict=True):  # first pass only accumulates
        np.testing.assert_array_equal(a, b)
    model.train_on_batch(x[r * 16 + 8 : r * 16 + 16], y[r * 16 + 8 : r * 16 + 16])
    reference.train_on_batch(x, y)
    for a, b in zip(_weights(model), _weights(reference), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@case
def fp16_compression_trains_like_none():
    import keras

    import flyte_hvd.keras as hvd

    x, y = _data(20 + hvd.rank(), 64)
    trained = []
    for compression in (hvd.Compression.none, hvd.Compression.fp16):
        model = _mlp(seed=3)
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.05), compression=compression)
        model.compile(optimizer=opt, loss="mse")
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
        trained.append(_weights(model))
    for a, b in zip(*trained, strict=True):
        np.testing.assert_allclose(a, b, atol=2e-3)


@case
def metric_average_gives_the_mean_of_ranks():
    import keras

    import flyte_hvd.keras as hvd

    seen: dict[str, list[float]] = {"before": [], "after": []}

    class Record(keras.callbacks.Callback):
        def __init__(self, key):
            super().__init__()
            self.key = key

        def on_epoch_end(self, epoch, logs=None):
            seen[self.key].append(float(logs["loss"]))

    model = _mlp(seed=4)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    x, y = _data(30 + hvd.rank(), 32)
    model.fit(
        x, y, batch_size=16, epochs=2, verbose=0,
        callbacks=[Record("before"), hvd.callbacks.MetricAverageCallback(), Record("after")],
    )  # fmt: skip
    per_rank = hvd.allgather_object(seen["before"])
    expected = np.mean(np.array(per_rank), axis=0)
    np.testing.assert_allclose(seen["after"], expected, rtol=1e-6)
    assert per_rank[0] != per_rank[1]  # the ranks really had different losses


@case
def learning_rate_warmup_and_schedule_values():
    import keras

    import flyte_hvd.keras as hvd

    n = hvd.size()
    lrs: list[tuple[int, int, float]] = []

    class Record(keras.callbacks.Callback):
        epoch = 0

        def on_epoch_begin(self, epoch, logs=None):
            Record.epoch = epoch

        def on_batch_begin(self, batch, logs=None):
            lrs.append((Record.epoch, batch, float(np.asarray(self.model.optimizer.learning_rate))))

    model = _mlp(seed=5)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.2)), loss="mse")
    x, y = _data(5, 64)
    warmup = hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.2, warmup_epochs=2)
    model.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[warmup, Record()])
    for epoch, batch, lr in lrs:
        expected = 0.2 / n * ((epoch + batch / 4) * (n - 1) / 2 + 1) if epoch < 2 else 0.2
        assert abs(lr - expected) < 1e-6, (epoch, batch, lr, expected)

    lrs.clear()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    schedule = hvd.callbacks.LearningRateScheduleCallback(
        initial_lr=0.1, multiplier=lambda epoch: 0.5**epoch, start_epoch=1
    )
    model.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[schedule, Record()])
    per_epoch = {epoch: lr for epoch, _, lr in lrs}
    np.testing.assert_allclose([per_epoch[0], per_epoch[1], per_epoch[2]], [0.1, 0.05, 0.025])


@case
def embedding_model_trains_in_sync():
    import keras

    import flyte_hvd.keras as hvd

    keras.utils.set_random_seed(50 + hvd.rank())
    model = keras.Sequential(
        [keras.Input((2,), dtype="int32"), keras.layers.Embedding(20, 4), keras.layers.Flatten(),
         keras.layers.Dense(1)]
    )  # fmt: skip
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.05)), loss="mse")
    rng = np.random.default_rng(hvd.rank())
    ids = rng.integers(0, 20, size=(64, 2)).astype("int32")
    target = (ids[:, :1] % 5).astype("float32")
    history = model.fit(
        ids, target, batch_size=16, epochs=4, verbose=0,
        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)],
    )  # fmt: skip
    losses = history.history["loss"]
    assert losses[-1] < losses[0], losses
    _assert_same_on_all_ranks(model)


@case
def different_architectures_are_reported_with_both_shapes():
    import flyte_hvd.keras as hvd

    model = _mlp(seed=6, width=4 + hvd.rank())
    try:
        hvd.broadcast_variables(model.variables, root_rank=0)
    except ValueError as error:
        message = str(error)
        assert "ranks built different models" in message, message
        assert "(3, 4)" in message and "(3, 5)" in message, message
    else:
        raise AssertionError("different architectures were not detected")


@case
def eager_apply_gradients_with_one_gradient():
    import keras
    import tensorflow as tf

    import flyte_hvd.keras as hvd

    n, r = hvd.size(), hvd.rank()
    mean = (n + 1) / 2  # rank r sends gradient r + 1 everywhere
    for passes in (1, 2):
        v = tf.Variable([1.0, 2.0])
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=passes)
        for _ in range(passes):
            opt.apply_gradients([(tf.fill([2], float(r + 1)), v)])
        # Accumulated gradients are summed over the passes (average_aggregated_gradients off).
        np.testing.assert_allclose(v.numpy(), [1.0 - passes * mean, 2.0 - passes * mean])


@case
def broadcast_callback_on_unbuilt_model_keeps_local_variables():
    import keras

    import flyte_hvd.keras as hvd

    r = hvd.rank()
    keras.utils.set_random_seed(60 + r)
    model = keras.Sequential([keras.layers.Dense(2), keras.layers.Dense(1)])  # no Input
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.0)), loss="mse")
    x, y = _data(r, 16)
    # Built only when the first step is traced: the broadcast follows the first batch.
    model.fit(x, y, batch_size=8, epochs=1, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])  # fmt: skip
    kernels = hvd.allgather_object([w.numpy() for w in model.layers[0].weights])
    for a, b in zip(kernels[0], kernels[-1], strict=True):
        np.testing.assert_array_equal(a, b)
    model.layers[1].bias.assign([float(r)])
    model.layers[1].kernel.assign(model.layers[1].kernel * float(r + 1))
    callback = hvd.callbacks.BroadcastGlobalVariablesCallback(
        0, local_variables=model.layers[1].bias
    )
    callback.set_model(model)
    callback.on_train_batch_end(0)  # broadcasts everything but the local bias
    assert float(model.layers[1].bias.numpy()[0]) == r
    kernels = hvd.allgather_object(model.layers[1].kernel.numpy())
    np.testing.assert_array_equal(kernels[0], kernels[-1])


@case
def local_variables_keep_their_own_gradient():
    import keras
    import tensorflow as tf

    import flyte_hvd.keras as hvd

    n, r = hvd.size(), hvd.rank()
    shared, local = tf.Variable([0.0]), tf.Variable([0.0])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0))
    opt.register_local_var(local)
    g = tf.constant([float(r + 1)])
    opt.apply_gradients([(g, shared), (g, local)])
    np.testing.assert_allclose(shared.numpy(), [-(n + 1) / 2])  # averaged
    np.testing.assert_allclose(local.numpy(), [-(r + 1) / n])  # local, divided by size
    # tf.keras' hook, as Horovod scripts call it: reduced gradients, nothing applied.
    with tf.GradientTape() as tape:
        loss = shared * float(r + 1) + local * float(r + 1)
    pairs = opt._compute_gradients(loss, [shared, local], tape=tape)
    assert [v is w for (_, v), w in zip(pairs, [shared, local], strict=True)] == [True, True]
    np.testing.assert_allclose(pairs[0][0].numpy(), [(n + 1) / 2])
    np.testing.assert_allclose(pairs[1][0].numpy(), [(r + 1) / n])
    np.testing.assert_allclose(shared.numpy(), [-(n + 1) / 2])

    model = _mlp(seed=9)
    partial = hvd.PartialDistributedOptimizer(
        keras.optimizers.SGD(0.1), local_layers=[model.layers[-1]]
    )
    model.compile(optimizer=partial, loss="mse")
    x, y = _data(70 + r, 16)
    model.train_on_batch(x, y)
    everyone = hvd.allgather_object([_weights(model)[0], _weights(model)[-1]])
    first, last = everyone[0], everyone[-1]
    np.testing.assert_array_equal(first[0], last[0])  # shared layer: same update everywhere
    if n > 1:
        assert not np.array_equal(first[1], last[1])  # local bias: each rank its own
