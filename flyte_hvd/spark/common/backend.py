"""Horovod's ``horovod.spark.common.backend``: ``SparkBackend`` runs an estimator's training
function on ranks of the active SparkSession."""

from flyte_hvd.estimators.backend import SparkBackend

__all__ = ["SparkBackend"]
