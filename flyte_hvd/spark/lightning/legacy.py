"""Horovod's ``horovod.spark.lightning.legacy``: ``to_lightning_module`` builds the
LightningModule that trains a plain ``torch.nn.Module`` with an optimizer and a loss."""

from flyte_hvd.estimators.lightning_legacy import to_lightning_module

__all__ = ["to_lightning_module"]
