"""Horovod's ``horovod.spark.torch``: ``TorchEstimator`` and ``TorchModel``."""

from flyte_hvd.estimators.torch import TorchEstimator
from flyte_hvd.estimators.torch_model import TorchModel

__all__ = ["TorchEstimator", "TorchModel"]
