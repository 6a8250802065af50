"""Ranks inside Spark: the launch pipeline, the barrier stage that runs one rank per task, the
driver link, and what both Flyte plugins share of a Spark task.

Below the estimators and the Flyte plugins; ``flyte_hvd.spark`` (Horovod's ``horovod.spark``)
is the public facade over this package, the Store and the estimators. Importing this package
loads the launch modules and no pyspark: Spark's Python worker daemon
(``worker_daemon.py``) finds them loaded before it forks its workers.
"""

from flyte_hvd.stage.dispatch import launch, run
from flyte_hvd.stage.horovod_runner import HorovodRunner
from flyte_hvd.stage.partition import get_partition
from flyte_hvd.stage.pipeline import RunReport
from flyte_hvd.stage.rank_task import get_available_devices
from flyte_hvd.stage.torch_distributor import TorchDistributor

__all__ = [
    "HorovodRunner",
    "RunReport",
    "TorchDistributor",
    "get_available_devices",
    "get_partition",
    "launch",
    "run",
]
