"""Horovod's ``horovod.spark.lightning``: its ``TorchEstimator`` is flyte-hvd's
``LightningEstimator`` (a Lightning module trained on ranks), its ``TorchModel`` the same
``TorchModel`` the PyTorch estimator returns."""

from flyte_hvd.spark.lightning.estimator import MIN_PL_VERSION, TorchEstimator, TorchModel

__all__ = ["MIN_PL_VERSION", "TorchEstimator", "TorchModel"]
