"""Horovod's ``horovod.spark.lightning.estimator``."""

from flyte_hvd.estimators.lightning import LightningEstimator as TorchEstimator
from flyte_hvd.estimators.params import EstimatorParams
from flyte_hvd.estimators.params import param_to_save as _torch_param_serialize
from flyte_hvd.estimators.torch_model import TorchModel

# The oldest Lightning this estimator runs (Horovod's name): Lightning 2's Trainer API.
MIN_PL_VERSION = "2.0.0"

__all__ = [
    "MIN_PL_VERSION",
    "EstimatorParams",
    "TorchEstimator",
    "TorchModel",
    "_torch_param_serialize",
]
