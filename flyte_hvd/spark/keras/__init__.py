"""Horovod's ``horovod.spark.keras``: ``KerasEstimator`` and ``KerasModel``."""

from flyte_hvd.estimators.keras import KerasEstimator, KerasModel

__all__ = ["KerasEstimator", "KerasModel"]
