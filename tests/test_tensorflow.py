"""flyte_hvd.tensorflow: collectives, gradients and DistributedGradientTape on 2 real ranks;
Horovod-style TF2 scripts under flyte-hvd-run and Spark; errors in-process."""

from __future__ import annotations

import os
import runpy

import cloudpickle
import pytest

from flyte_hvd.launch.job import FunctionJob
from flyte_hvd.launch.supervisor import launch_local

import tensorflow_cases

cloudpickle.register_pickle_by_value(tensorflow_cases)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUSTOM_LOOP = os.path.join(REPO, "examples", "tensorflow2_custom_loop.py")
KERAS_FIT = os.path.join(REPO, "examples", "tensorflow2_keras_fit.py")

_results: list[dict] = []


def two_rank_results() -> list[dict[str, str | None]]:
    if not _results:
        job = FunctionJob(tensorflow_cases.run_cases)
        _results.extend(launch_local(job, 2, start_timeout=120))
    return _results


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(tensorflow_cases.CASES))
def test_tensorflow_on_two_ranks(name):
    failures = {r: res[name] for r, res in enumerate(two_rank_results()) if res[name]}
    assert not failures, "\n".join(f"rank {r}:\n{tb}" for r, tb in failures.items())


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("script", [CUSTOM_LOOP, KERAS_FIT], ids=["custom_loop", "keras_fit"])
def test_tensorflow2_script_under_flyte_hvd_run(cli, script):
    result = cli("-np", "2", "python", script, timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[0]<stdout>:loss fell from" in result.stdout, result.stdout[-2000:]
    assert "[1]<stdout>:loss fell" not in result.stdout  # only rank 0 reports
    first, last = result.stdout.split("loss fell from ")[1].split()[::2][:2]
    assert float(last) < float(first)


@pytest.mark.mpi
@pytest.mark.spark
@pytest.mark.timeout(600)  # Spark start, and TensorFlow imported on two ranks: ~3.5 min loaded
def test_tensorflow2_scripts_under_spark_run(spark_local2):
    from flyte_hvd.spark import run

    mains = (runpy.run_path(CUSTOM_LOOP)["main"], runpy.run_path(KERAS_FIT)["main"])
    results = run(tensorflow_cases.both_scripts, args=mains, num_proc=2, verbose=0)
    for name in ("custom_loop", "keras_fit"):
        per_rank = [r[name] for r in results]
        assert [r["size"] for r in per_rank] == [2, 2]
        assert per_rank[0]["losses"][-1] < per_rank[0]["losses"][0], per_rank[0]
        # Broadcast, then identical averaged updates: the ranks end with the same weights.
        assert per_rank[0]["weights_sum"] == pytest.approx(per_rank[1]["weights_sum"], rel=1e-6)


@pytest.fixture(scope="module")
def hvd():
    import flyte_hvd.tensorflow as hvd

    hvd.init()
    return hvd


def test_fp16_compression_casts_tf_tensors_with_tensorflow(hvd):
    import tensorflow as tf

    for dtype in (tf.float16, tf.float32, tf.float64):
        compressed, ctx = hvd.Compression.fp16.compress(tf.ones([3], dtype))
        assert isinstance(compressed, tf.Tensor) and compressed.dtype == tf.float16
        restored = hvd.Compression.fp16.decompress(compressed, ctx)
        assert restored.dtype == dtype and restored.numpy().tolist() == [1, 1, 1]
    for dtype in (tf.int32, tf.bool):
        tensor = tf.ones([3], dtype)
        compressed, ctx = hvd.Compression.fp16.compress(tensor)
        assert compressed is tensor and hvd.Compression.fp16.decompress(compressed, ctx) is tensor


def test_executing_eagerly_helper(hvd):
    import tensorflow as tf

    assert hvd._executing_eagerly() is True
    assert not tf.function(lambda: tf.constant(hvd._executing_eagerly()))().numpy()


def test_bad_collective_arguments_raise_tensorflow_invalid_argument(hvd):
    """As Horovod's ops raise it eagerly (and as a graph reports a ValueError); still a
    ValueError for code that catches that."""
    import tensorflow as tf

    expected = "summing to the first dimension"
    with pytest.raises(tf.errors.InvalidArgumentError, match=expected) as info:
        hvd.alltoall(tf.ones([3]), splits=tf.constant([2]))
    assert isinstance(info.value, ValueError)


def test_compute_gradients_takes_a_tape_or_a_callable_loss(hvd):
    import keras
    import tensorflow as tf

    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(ValueError, match=r"needs the tf\.GradientTape that recorded `loss`"):
        opt._compute_gradients(tf.constant(1.0), [tf.Variable(1.0)])
    v = tf.Variable([2.0])
    ((grad, var),) = opt._compute_gradients(lambda: tf.reduce_sum(v * v), [v])
    assert var is v and grad.numpy().tolist() == [4.0]


def test_tape_wraps_only_gradient_tapes(hvd):
    with pytest.raises(ValueError, match=r"wraps a tf\.GradientTape"):
        hvd.DistributedGradientTape("tape")


def test_tape_argument_errors(hvd):
    import tensorflow as tf

    with pytest.raises(ValueError, match="groups"):
        hvd.DistributedGradientTape(tf.GradientTape(), groups=-1)
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        hvd.DistributedGradientTape(tf.GradientTape(), op=hvd.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="process_set"):
        hvd.DistributedGradientTape(tf.GradientTape(), process_set=object())


def test_tape_at_size_one_gives_local_gradients(hvd):
    import tensorflow as tf

    x = tf.Variable([1.0, 2.0])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(x * x)
    grads = hvd.DistributedGradientTape(tape).gradient(loss, {"x": x})
    assert list(grads) == ["x"] and grads["x"].numpy().tolist() == [2.0, 4.0]


def test_collective_argument_errors(hvd):
    import tensorflow as tf

    with pytest.raises(ValueError, match="not both"):
        hvd.allreduce(tf.ones([2]), average=True, op=hvd.Sum)
    with pytest.raises(ValueError, match="bfloat16"):
        hvd.allreduce(tf.ones([2], dtype=tf.bfloat16))
    with pytest.raises(ValueError, match="process_set"):
        hvd.allgather(tf.ones([2]), process_set="even ranks")
    with pytest.raises(ValueError, match="root_rank"):
        hvd.broadcast(tf.ones([2]), root_rank=3)


def test_distributed_optimizer_needs_a_keras_optimizer(hvd):
    with pytest.raises(ValueError, match=r"TF1 `tf\.compat\.v1\.train` optimizers"):
        hvd.DistributedOptimizer(object())


def test_broadcast_global_variables_in_a_tf1_graph(hvd):
    import tensorflow as tf

    with tf.Graph().as_default():
        v = tf.compat.v1.get_variable("v", initializer=[3.0])
        op = hvd.broadcast_global_variables(0)
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            session.run(op)
            assert session.run(v).tolist() == [3.0]


def test_elastic_is_refused_with_the_reason(hvd):
    import flyte_hvd.keras as hvd_keras

    for module in (hvd.elastic, hvd_keras.elastic):
        with pytest.raises(NotImplementedError, match="barrier stage, which is all-or-nothing"):
            module.run()
        with pytest.raises(NotImplementedError, match=r"elastic\.TensorFlowKerasState"):
            module.TensorFlowKerasState(None)


def test_indexed_slices_refuse_what_horovod_refuses(hvd):
    import tensorflow as tf

    slices = tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0]), tf.constant([2, 2]))
    with pytest.raises(NotImplementedError, match=r"hvd\.Average and hvd\.Sum"):
        hvd.allreduce(slices, op=hvd.Max)
    with pytest.raises(NotImplementedError, match="prescale_factor"):
        hvd.grouped_allreduce([slices], op=hvd.Sum, prescale_factor=2.0)
