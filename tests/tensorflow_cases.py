"""flyte_hvd.tensorflow cases run on real rank processes; each asserts on every rank, with
answers in closed form in ``rank`` and ``size``."""

from __future__ import annotations

import traceback

import numpy as np

CASES: dict[str, object] = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def run_cases(names: list[str] | None = None) -> dict[str, str | None]:
    import tensorflow as tf

    import flyte_hvd.tensorflow as hvd

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


def both_scripts(custom_loop_main, keras_fit_main) -> dict:
    """The two TF2 example scripts' ``main``, one after the other in one rank process."""
    return {"custom_loop": custom_loop_main(steps=12), "keras_fit": keras_fit_main(epochs=2)}


def _both_modes(fn):
    """``fn`` run eagerly and traced in a ``tf.function``: the two results."""
    import tensorflow as tf

    return fn(), tf.function(fn, autograph=False)()


@case
def collectives_return_tensors_eagerly_and_in_tf_function():
    import tensorflow as tf

    import flyte_hvd.tensorflow as hvd

    n, r = hvd.size(), hvd.rank()
    x = tf.fill([2, 3], float(r + 1))
    for out in _both_modes(lambda: hvd.allreduce(x)):
        assert isinstance(out, tf.Tensor) and out.shape == (2, 3)
        np.testing.assert_allclose(out.numpy(), np.full((2, 3), (n + 1) / 2))
    for out in _both_modes(lambda: hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0)):
        np.testing.assert_allclose(out.numpy(), np.full((2, 3), n * (n + 1)))
    ints = tf.constant([r, 10 * r], dtype=tf.int32)
    for out in _both_modes(lambda: hvd.allreduce(ints, average=False)):
        assert out.dtype == tf.int32
        np.testing.assert_array_equal(out.numpy(), [n * (n - 1) // 2, 5 * n * (n - 1)])
    for a, b in _both_modes(lambda: hvd.grouped_allreduce([x, 2 * x], op=hvd.Max)):
        np.testing.assert_allclose(a.numpy(), np.full((2, 3), n))
        np.testing.assert_allclose(b.numpy(), np.full((2, 3), 2 * n))

    ragged = tf.fill([r + 1, 2], float(r))  # rank r sends r + 1 rows
    for out in _both_modes(lambda: hvd.allgather(ragged)):
        expected = np.concatenate([np.full((k + 1, 2), float(k)) for k in range(n)])
        np.testing.assert_array_equal(out.numpy(), expected)
    for out in _both_modes(lambda: hvd.broadcast(tf.constant([r, r], tf.float64), root_rank=n - 1)):
        assert out.dtype == tf.float64
        np.testing.assert_array_equal(out.numpy(), [n - 1, n - 1])

    # alltoall: rank r sends k + 1 rows, valued r, to rank k.
    rows = tf.concat([tf.fill([k + 1], r) for k in range(n)], axis=0)
    splits = [k + 1 for k in range(n)]
    for out, received in _both_modes(lambda: hvd.alltoall(rows, splits=splits)):
        np.testing.assert_array_equal(out.numpy(), np.repeat(np.arange(n), r + 1))
        np.testing.assert_array_equal(received.numpy(), [r + 1] * n)
    even = tf.fill([2 * n], float(r))
    for out in _both_modes(lambda: hvd.alltoall(even)):  # no splits: the tensor alone
        np.testing.assert_array_equal(out.numpy(), np.repeat(np.arange(n, dtype=float), 2))

    table = tf.reshape(tf.range(4 * n, dtype=tf.float32), [2 * n, 2]) * float(r + 1)
    for out in _both_modes(lambda: hvd.reducescatter(table, op=hvd.Sum)):
        full = np.arange(4 * n, dtype=np.float32).reshape(2 * n, 2) * n * (n + 1) / 2
        np.testing.assert_allclose(out.numpy(), full[2 * r : 2 * r + 2])

    sparse = tf.IndexedSlices(tf.fill([1, 2], float(r)), tf.constant([r]), tf.constant([n, 2]))
    summed = hvd.allreduce(sparse, op=hvd.Sum)
    np.testing.assert_allclose(tf.convert_to_tensor(summed).numpy(), np.repeat(
        np.arange(n, dtype=np.float32)[:, None], 2, axis=1))  # fmt: skip
    assert int(hvd.size_op()) == n and int(hvd.rank_op()) == r


@case
def gradients_through_collectives_follow_horovod():
    import tensorflow as tf

    import flyte_hvd.tensorflow as hvd

    n, r = hvd.size(), hvd.rank()

    def grads():
        x = tf.constant([1.0, 2.0])
        rows = tf.ones([r + 1, 2])
        table = tf.ones([2 * n, 2])
        with tf.GradientTape(persistent=True) as tape:
            tape.watch([x, rows, table])
            # Each rank's upstream gradient is (r + 1): the allreduce gradient averages them.
            reduced = hvd.allreduce(x) * float(r + 1)
            gathered = hvd.allgather(rows) * float(r + 1)
            sent = hvd.broadcast(x, root_rank=0) * float(r + 1)
            scattered = hvd.reducescatter(table, op=hvd.Sum) * float(r + 1)
        return (
            tape.gradient(reduced, x),
            tape.gradient(gathered, rows),
            tape.gradient(sent, x),
            tape.gradient(scattered, table),
        )

    mean = (n + 1) / 2
    # Rank k's rows of the reducescatter input reach only rank k's output (gradient k + 1);
    # Horovod scales a Sum's gradient by size.
    scattered = np.repeat(np.arange(1, n + 1, dtype=np.float32), 2)[:, None] * np.ones((1, 2)) * n
    for g_reduce, g_gather, g_bcast, g_scatter in _both_modes(grads):
        np.testing.assert_allclose(g_reduce.numpy(), [mean, mean])
        np.testing.assert_allclose(g_gather.numpy(), np.full((r + 1, 2), mean))
        np.testing.assert_allclose(g_bcast.numpy(), [mean, mean] if r == 0 else [0.0, 0.0])
        np.testing.assert_allclose(g_scatter.numpy(), scattered)


def _custom_loop_weights(hvd_tape: bool, steps: int, local_bias: bool = False):
    import keras
    import tensorflow as tf

    import flyte_hvd.tensorflow as hvd

    n, r = hvd.size(), hvd.rank()
    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"),
                              keras.layers.Dense(1)])  # fmt: skip
    opt = keras.optimizers.SGD(0.1)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8 * n * steps, 3)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5]])).astype("float32")

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
        if hvd_tape:
            tape = hvd.DistributedGradientTape(tape)
            if local_bias:
                tape.register_local_source(model.layers[-1].bias)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    for s in range(steps):
        batch = slice(s * 8 * n, (s + 1) * 8 * n)
        if hvd_tape:  # each rank its slice of the global batch
            mine = slice(s * 8 * n + 8 * r, s * 8 * n + 8 * (r + 1))
            step(x[mine], y[mine])
        else:
            step(x[batch], y[batch])
    return [v.numpy() for v in model.trainable_variables]


@case
def distributed_gradient_tape_equals_one_process_on_the_global_batch():
    import flyte_hvd.tensorflow as hvd

    distributed = _custom_loop_weights(hvd_tape=True, steps=3)
    reference = _custom_loop_weights(hvd_tape=False, steps=3)
    for a, b in zip(distributed, reference, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    partial = _custom_loop_weights(hvd_tape=True, steps=3, local_bias=True)
    mine = partial[-1]
    if hvd.size() > 1:  # a local gradient differs between ranks
        theirs = hvd.allgather_object(mine)
        assert not np.allclose(theirs[0], theirs[1]), theirs


@case
def sparse_gradients_reduce_like_dense():
    import keras
    import tensorflow as tf

    import flyte_hvd.tensorflow as hvd

    n, r = hvd.size(), hvd.rank()
    table = tf.Variable(tf.zeros([2 * n, 2]))
    ids = tf.constant([2 * r, 2 * r + 1])
    for sparse_as_dense in (False, True):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(table, ids)) * float(r + 1)
        tape = hvd.DistributedGradientTape(tape, sparse_as_dense=sparse_as_dense)
        (grad,) = tape.gradient(loss, [table])
        expected = np.repeat(np.arange(1, n + 1, dtype=np.float32), 2)[:, None] / n
        np.testing.assert_allclose(tf.convert_to_tensor(grad).numpy(), expected * np.ones((1, 2)))
    model = keras.Sequential([keras.Input((1,), dtype="int32"), keras.layers.Embedding(4, 2)])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), sparse_as_dense=True)
    model.compile(optimizer=opt, loss="mse")
    model.fit(np.zeros((4, 1), "int32"), np.ones((4, 1, 2), "float32"), verbose=0)


@case
def broadcast_variables_and_objects():
    import tensorflow as tf

    import flyte_hvd.tensorflow as hvd

    r = hvd.rank()
    a, b = tf.Variable([float(r), 1.0]), tf.Variable([r, r], dtype=tf.int64)
    hvd.broadcast_variables([a, b], root_rank=0)
    np.testing.assert_array_equal(a.numpy(), [0.0, 1.0])
    np.testing.assert_array_equal(b.numpy(), [0, 0])
    c = tf.Variable([float(r)])

    @tf.function
    def first_step():
        hvd.broadcast_variables([c], root_rank=hvd.size() - 1)

    first_step()
    assert float(c.numpy()[0]) == hvd.size() - 1
    got = hvd.broadcast_object({"rank": r, "fn": lambda v: v + 1}, root_rank=0)
    assert got["rank"] == 0 and got["fn"](1) == 2
    assert hvd.allgather_object(r) == list(range(hvd.size()))
    try:
        hvd.broadcast_global_variables(0)
    except RuntimeError as error:
        assert "eager" in str(error) and "broadcast_variables" in str(error), error
    else:
        raise AssertionError("broadcast_global_variables ran eagerly")


@case
def iterations_advance_every_backward_pass():
    import keras
    import tensorflow as tf

    import flyte_hvd.keras as hvd

    # lr 1.0 for steps 0-1, 0.0 after: counted in batches, the second update has rate 0.
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([1], [1.0, 0.0])
    v = tf.Variable([0.0])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(schedule), backward_passes_per_step=2)
    for k in range(4):
        opt.apply_gradients([(tf.constant([1.0]), v)])
        assert int(opt.iterations) == k + 1, (k, int(opt.iterations))
        # Passes since the last reduction, under Horovod's name for it.
        assert int(opt._agg_helper.counter) == (k + 1) % 2
    # Update 1 (at pass 2) used step 1's rate 1.0 on the summed gradient 2; update 2 rate 0.
    np.testing.assert_allclose(v.numpy(), [-2.0])


@case
def broadcast_inplace_takes_bools_and_returns_the_new_values_in_graphs():
    import tensorflow as tf

    import flyte_hvd.tensorflow as hvd

    r = hvd.rank()
    flags = tf.Variable([r == 1, True])
    (out,) = hvd.broadcast_([flags], root_rank=1)
    assert out.numpy().tolist() == [True, True] == flags.numpy().tolist()
    with tf.Graph().as_default():
        v = tf.compat.v1.Variable(tf.fill([3], float(r + 1)), use_resource=True)
        (new,) = hvd.broadcast_([v], root_rank=0)
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            assert session.run(new).tolist() == [1.0, 1.0, 1.0]
            assert session.run(v).tolist() == [1.0, 1.0, 1.0]


@case
def tf1_graph_collectives_run_in_build_order_and_bools_travel():
    import tensorflow as tf

    import flyte_hvd.tensorflow as hvd

    n, r = hvd.size(), hvd.rank()
    with tf.Graph().as_default():
        # Independent ops: a TF1 session may run them in any order unless they are chained.
        gathered = [hvd.allgather(tf.fill([r + 1, k + 1], k)) for k in range(6)]
        flags = hvd.broadcast(tf.constant([r == 0, True]), root_rank=0)
        with tf.compat.v1.Session() as session:
            values = session.run([*gathered, flags])
    for k, value in enumerate(values[:6]):
        assert value.shape == (n * (n + 1) // 2, k + 1) and (value == k).all()
    assert values[6].tolist() == [True, True]
    assert hvd.allgather(tf.constant([r == 1])).numpy().tolist() == [k == 1 for k in range(n)]


@case
def mismatches_raise_failed_precondition_and_sparse_groups_reduce():
    import tensorflow as tf

    import flyte_hvd.tensorflow as hvd

    n, r = hvd.size(), hvd.rank()
    # Eagerly Horovod's FailedPreconditionError; a graph's py-function op reports any
    # Python error as an OpError (UnknownError) carrying the same message.
    graph = lambda f: tf.function(f, autograph=False)()  # noqa: E731
    for run, expected in ((lambda f: f(), tf.errors.FailedPreconditionError),
                          (graph, tf.errors.OpError)):  # fmt: skip
        try:
            run(lambda: hvd.allreduce(tf.ones([3 + r])))  # shapes differ between ranks
        except expected as error:
            assert "rank 0" in error.message and "rank 1" in error.message, error.message
        else:
            assert n == 1, "a shape mismatch was not reported"
    sparse = tf.IndexedSlices(tf.fill([1, 2], float(r + 1)), tf.constant([r]), tf.constant([n, 2]))
    dense, gathered = hvd.grouped_allreduce([tf.fill([2], float(r + 1)), sparse], op=hvd.Sum)
    np.testing.assert_allclose(dense.numpy(), [n * (n + 1) / 2] * 2)
    assert isinstance(gathered, tf.IndexedSlices)
    np.testing.assert_array_equal(gathered.indices.numpy(), np.arange(n))
    ints = tf.fill([2 * n], 10)
    scattered = hvd.reducescatter(ints, op=hvd.Sum, prescale_factor=0.5)  # 10 * 0.5 = 5 each
    np.testing.assert_array_equal(scattered.numpy(), [5 * n, 5 * n])
    summed = hvd.allreduce(tf.fill([2], 10), op=hvd.Sum, prescale_factor=0.5, postscale_factor=2.0)
    np.testing.assert_array_equal(summed.numpy(), [10 * n, 10 * n])
