"""Flyte tasks whose body runs on every rank of a Spark barrier stage.

``@task(task_config=HorovodSpark(num_proc=2))``; importing this module registers the plugin
(flytekit also imports it through the ``flytekit.plugins`` entry point). pyspark is imported
only when a task runs.
"""

from flyte_hvd.flyte.task import HorovodSpark, HorovodSparkFunctionTask

__all__ = ["HorovodSpark", "HorovodSparkFunctionTask"]
