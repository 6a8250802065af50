"""Horovod's Keras API for Keras 3 on TensorFlow: ``import flyte_hvd.keras as hvd``.

Re-exports the collective core (``init``, ``rank``, ``size``, ``allreduce``, ...) and adds
``DistributedOptimizer``, ``broadcast_variables``, ``load_model`` and ``callbacks``. Its
gradient reduction and variable broadcast are ``flyte_hvd.tensorflow``'s.
"""

import os

if os.environ.get("KERAS_BACKEND", "tensorflow") != "tensorflow":
    raise ImportError(
        f"flyte_hvd.keras needs Keras' TensorFlow backend; KERAS_BACKEND is "
        f"{os.environ['KERAS_BACKEND']!r}. Unset it or set KERAS_BACKEND=tensorflow."
    )

try:
    import keras  # noqa: F401
    import tensorflow  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "flyte_hvd.keras needs TensorFlow and Keras 3: install the extra "
        "`pip install flyte-hvd[tf]` (or `[tf-cpu]`)."
    ) from error

from flyte_hvd.core import *  # noqa: F403 - Horovod's API is one namespace
from flyte_hvd.core import __all__ as _core_all
from flyte_hvd.keras import callbacks
from flyte_hvd.keras.optimizer import DistributedOptimizer, PartialDistributedOptimizer, load_model
from flyte_hvd.tensorflow import elastic
from flyte_hvd.tensorflow.functions import broadcast_global_variables, broadcast_variables

__all__ = [
    *_core_all,
    "DistributedOptimizer",
    "PartialDistributedOptimizer",
    "broadcast_global_variables",
    "broadcast_variables",
    "callbacks",
    "elastic",
    "load_model",
]
