"""Flyte 2 (the ``flyte`` SDK) tasks whose body runs on every rank of a Spark barrier stage.

``flyte.TaskEnvironment(name=..., plugin_config=HorovodSpark(num_proc=2))``; importing this
module registers the plugin with ``flyte.extend.TaskPluginRegistry``. pyspark is imported only
when a task runs. Needs the ``flyte2`` extra (``pip install 'flyte-hvd[flyte2]'``).
"""

from flyte_hvd.flyte2.report import fit_with_report
from flyte_hvd.flyte2.task import HorovodSpark, HorovodSparkTask

__all__ = ["HorovodSpark", "HorovodSparkTask", "fit_with_report"]
