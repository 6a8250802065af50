"""Horovod's TensorFlow 2 API on the collective core: ``import flyte_hvd.tensorflow as hvd``.

Re-exports the core's process API (``init``, ``rank``, ``size``, ...) with collectives that
take and return ``tf.Tensor`` (eagerly and inside ``tf.function``, with Horovod's gradients),
and adds ``DistributedGradientTape``, ``broadcast_variables``, ``broadcast_object`` and
``DistributedOptimizer`` (for Keras optimizers; see ``flyte_hvd.keras``). ``hvd.elastic`` is
not supported: every name in it raises ``NotImplementedError`` with the reason.
"""

import os

if os.environ.get("KERAS_BACKEND", "tensorflow") != "tensorflow":
    raise ImportError(
        f"flyte_hvd.tensorflow needs Keras' TensorFlow backend; KERAS_BACKEND is "
        f"{os.environ['KERAS_BACKEND']!r}. Unset it or set KERAS_BACKEND=tensorflow."
    )

try:
    import tensorflow
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "flyte_hvd.tensorflow needs TensorFlow: install the extra `pip install flyte-hvd[tf]` "
        "(or `[tf-cpu]`)."
    ) from error

from flyte_hvd.core import *  # noqa: F403 - Horovod's API is one namespace
from flyte_hvd.core import __all__ as _core_all
from flyte_hvd.tensorflow import elastic
from flyte_hvd.tensorflow.functions import (
    allgather,
    allgather_object,
    allreduce,
    alltoall,
    broadcast,
    broadcast_,
    broadcast_global_variables,
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    join,
    local_rank_op,
    local_size_op,
    process_set_included_op,
    rank_op,
    reducescatter,
    size_op,
)
from flyte_hvd.tensorflow.gradients import (
    DistributedGradientTape,
    PartialDistributedGradientTape,
)


def _executing_eagerly() -> bool:
    """Horovod's helper, which its TensorFlow scripts and tests call as
    ``hvd._executing_eagerly()``."""
    return tensorflow.executing_eagerly()


def DistributedOptimizer(optimizer, *args, **kwargs):
    """Horovod's ``hvd.DistributedOptimizer`` for a Keras 3 optimizer: the same as
    ``flyte_hvd.keras.DistributedOptimizer`` (TF1 ``tf.compat.v1.train`` optimizers are not
    supported)."""
    import keras

    from flyte_hvd.tensorflow.optimizer import DistributedOptimizer as keras_distributed

    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ValueError(
            f"flyte_hvd.tensorflow.DistributedOptimizer wraps a Keras 3 optimizer (e.g. "
            f"keras.optimizers.SGD(0.01)); found {type(optimizer).__module__}."
            f"{type(optimizer).__name__}. TF1 `tf.compat.v1.train` optimizers are not "
            f"supported: use a Keras optimizer or `hvd.DistributedGradientTape`."
        )
    return keras_distributed(optimizer, *args, **kwargs)


# The tensor collectives replace the core's numpy ones of the same names.
__all__ = [
    *_core_all,
    "DistributedGradientTape",
    "DistributedOptimizer",
    "PartialDistributedGradientTape",
    "allgather",
    "allgather_object",
    "allreduce",
    "alltoall",
    "broadcast",
    "broadcast_",
    "broadcast_global_variables",
    "broadcast_object",
    "broadcast_object_fn",
    "broadcast_variables",
    "elastic",
    "grouped_allgather",
    "grouped_allreduce",
    "grouped_reducescatter",
    "join",
    "local_rank_op",
    "local_size_op",
    "process_set_included_op",
    "rank_op",
    "reducescatter",
    "size_op",
]
