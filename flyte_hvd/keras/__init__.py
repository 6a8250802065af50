"""Horovod's Keras API for Keras 3 on TensorFlow: ``import flyte_hvd.keras as hvd``.

Re-exports the collective core (``init``, ``rank``, ``size``, ``allreduce``, ...) and adds
``DistributedOptimizer``, ``broadcast_variables``, ``load_model`` and ``callbacks``.
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
from flyte_hvd.keras.optimizer import (
    DistributedOptimizer,
    broadcast_variables,
    load_model,
)

__all__ = [*_core_all, "DistributedOptimizer", "broadcast_variables", "callbacks", "load_model"]
