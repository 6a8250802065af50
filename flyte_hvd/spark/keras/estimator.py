"""Horovod's ``horovod.spark.keras.estimator``."""

from flyte_hvd.estimators.keras import KerasEstimator, KerasModel
from flyte_hvd.estimators.params import EstimatorParams

__all__ = ["EstimatorParams", "KerasEstimator", "KerasModel"]
