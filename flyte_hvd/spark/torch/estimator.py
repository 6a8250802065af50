"""Horovod's ``horovod.spark.torch.estimator``."""

from flyte_hvd.estimators.params import EstimatorParams
from flyte_hvd.estimators.params import param_to_save as _torch_param_serialize
from flyte_hvd.estimators.torch import TorchEstimator
from flyte_hvd.estimators.torch_model import TorchModel

__all__ = ["EstimatorParams", "TorchEstimator", "TorchModel", "_torch_param_serialize"]
