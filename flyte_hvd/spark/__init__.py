"""Run Horovod-style ranks inside Spark: ``run``, ``HorovodRunner``, ``get_available_devices``.

pyspark is imported only when a function needs it.
"""

from flyte_hvd.spark.horovod_runner import HorovodRunner
from flyte_hvd.spark.runner import RunReport, get_available_devices, launch, run

__all__ = ["HorovodRunner", "RunReport", "get_available_devices", "launch", "run"]
