"""Horovod's ``horovod.tensorflow.keras``: the Keras API of ``flyte_hvd.keras`` under
Horovod's module path (``import flyte_hvd.tensorflow.keras as hvd``)."""

from flyte_hvd.keras import *  # noqa: F403
from flyte_hvd.keras import __all__ as _keras_all

__all__ = list(_keras_all)
