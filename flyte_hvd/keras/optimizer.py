"""``DistributedOptimizer``, ``PartialDistributedOptimizer`` and ``load_model`` for Keras 3, as
``flyte_hvd.keras`` offers them (Horovod's ``horovod.tensorflow.keras``). They live in
``flyte_hvd.tensorflow.optimizer``: a Keras 3 optimizer is distributed on the TensorFlow
backend, and ``flyte_hvd.tensorflow.DistributedOptimizer`` wraps the same class."""

from flyte_hvd.tensorflow.optimizer import (
    DistributedOptimizer,
    PartialDistributedOptimizer,
    load_model,
)

__all__ = ["DistributedOptimizer", "PartialDistributedOptimizer", "load_model"]
