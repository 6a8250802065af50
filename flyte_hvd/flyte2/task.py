"""``HorovodSpark`` for Flyte 2: a ``flyteplugins-spark`` task whose body runs on every rank.

``flyte.TaskEnvironment(name="train", plugin_config=HorovodSpark(num_proc=2))`` makes each
``@env.task`` a Spark task (task type ``spark``, the ``SparkJob`` of ``flyteplugins-spark``
with the barrier stage's settings), so Flyte 2's backend runs it with its Spark plugin. Its
body does not run on the Spark driver: the driver starts ``num_proc`` ranks in one Spark
barrier stage, each rank calls ``flyte_hvd.core.init()`` and then the body, and the task's
outputs are rank 0's return values. ``flyte_hvd.stage.flyte_task`` holds what this plugin
shares with the flytekit one (``flyte_hvd.flyte``); ``rank.py`` is Flyte 2's rank half.
"""

from __future__ import annotations

import asyncio
import collections.abc
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

try:
    import flyte
    from flyte import PodTemplate
    from flyte.extend import TaskPluginRegistry
    from flyte.models import SerializationContext
    from flyteplugins.spark.task import PysparkFunctionTask
except ImportError as error:  # pragma: no cover - depends on the install
    raise ImportError(
        f"flyte_hvd.flyte2 needs the Flyte 2 SDK and its Spark plugin ({error}); install the "
        f"extra: pip install 'flyte-hvd[flyte2]'."
    ) from error

from flyte_hvd.core.types import UserValue
from flyte_hvd.flyte2.rank import RankSpec, outputs_from_bytes
from flyte_hvd.launch import failures
from flyte_hvd.stage import flyte_task


@dataclass(frozen=True)
class HorovodSpark(flyte_task.BarrierTaskConfig):
    """Flyte 2 task config for ``num_proc`` ranks in one Spark barrier stage:
    ``flyte.TaskEnvironment(name=..., plugin_config=HorovodSpark(num_proc=2))``.

    The fields, the Spark settings derived from them and their checks are
    ``flyte_hvd.stage.flyte_task.BarrierTaskConfig``'s, the same as the flytekit
    ``flyte_hvd.flyte.HorovodSpark``; ``driver_pod`` and ``executor_pod`` are
    ``flyte.PodTemplate``s, as in ``flyteplugins.spark.Spark``.

    Example:
        >>> env = flyte.TaskEnvironment(name="train", plugin_config=HorovodSpark(num_proc=2))
        >>> @env.task
        ... def rank_count() -> int:
        ...     import flyte_hvd.core as hvd
        ...     return hvd.size()  # runs on both ranks; the output is rank 0's
    """

    pod_template_type: ClassVar[type] = PodTemplate
    pod_template_name: ClassVar[str] = "flyte.PodTemplate"

    driver_pod: PodTemplate | None = None
    executor_pod: PodTemplate | None = None


@dataclass(kw_only=True)
class HorovodSparkTask(PysparkFunctionTask):
    """A Flyte 2 Spark task whose body runs on ``num_proc`` ranks; outputs are rank 0's."""

    plugin_config: HorovodSpark  # type: ignore[assignment]

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.plugin_config, HorovodSpark):
            raise ValueError(
                f"`plugin_config` of `{self.name}` must be a flyte_hvd.flyte2.HorovodSpark; "
                f"found {type(self.plugin_config).__name__}. A task has one plugin config: put "
                f"Spark settings in HorovodSpark(spark_conf=..., hadoop_conf=..., "
                f"driver_pod=..., executor_pod=...), or define the task in an environment of "
                f"its own for a plain Spark task."
            )
        _check_outputs(self.name, self.interface.outputs)

    def custom_config(self, sctx: SerializationContext) -> dict[str, Any]:
        """The SparkJob of flyteplugins-spark, with the derived barrier settings."""
        custom = super().custom_config(sctx)
        custom["sparkConf"] = self.plugin_config.effective_spark_conf
        return custom

    async def pre(self, *args: UserValue, **kwargs: UserValue) -> dict[str, Any]:  # inputs
        """Locally, start the SparkSession flyteplugins-spark would start, with a task slot
        per rank; in a pod, the SparkApplication's. With ``connect_url``, the Spark Connect
        session instead (with the run's code bundle as an artifact in a pod)."""
        ctx = flyte.ctx()
        in_cluster = bool(ctx and ctx.is_in_cluster())
        config = self.plugin_config
        if config.connect_url is not None:
            bundle = ctx.code_bundle if ctx and in_cluster else None
            code_dir = bundle.destination if bundle is not None else None
            return {
                "spark_session": flyte_task.connect_session(config.connect_url, config, code_dir)
            }
        if not in_cluster:
            action = ctx.action.name if ctx else "local"
            flyte_task.start_local_session(f"FlyteSpark: {action}", config)
        return await super().pre(*args, **kwargs)

    async def execute(self, *args: UserValue, **kwargs: UserValue) -> UserValue:
        """Run the body on every rank and return rank 0's outputs."""
        if args:  # the runtime passes inputs by name; a positional call is bound to them
            kwargs = {**dict(zip(self.interface.inputs, args, strict=False)), **kwargs}
        data = await self.pre()
        connect = data["spark_session"] if self.plugin_config.connect_url is not None else None
        try:
            spec = RankSpec.of(self)
            # The launch blocks until the ranks end: off the event loop, in the context of the
            # run. A failure leaves as the kind Flyte 2 retries (or not):
            # ``flyte_hvd.launch.failures``.
            with failures.as_flyte_errors():
                result = await asyncio.to_thread(
                    flyte_task.launch_body,
                    self.name,
                    self.func,
                    kwargs,
                    spec,
                    self.plugin_config,
                    connect,
                )
        finally:
            if connect is not None:  # also where the task failed before its launch
                flyte_task.release(connect)
        value = await outputs_from_bytes(spec, result.outputs)
        if connect is None:  # the session flyteplugins-spark stops in a debug run
            await self.post(value)
        return value


def _check_outputs(task_name: str, outputs: dict[str, Any]) -> None:
    """Refuse outputs a rank cannot produce, when the task is defined."""
    for name, python_type in outputs.items():
        module = getattr(python_type, "__module__", "") or ""
        origin = typing.get_origin(python_type) or python_type
        if module.startswith("pyspark.sql") and getattr(python_type, "__name__", "") == "DataFrame":
            reason = (
                "a Spark DataFrame lives in a SparkSession, and the ranks have none. Return "
                "a flyte.io.DataFrame (a pandas or pyarrow frame written by rank 0), or "
                "write the data to a path and return a flyte.io.Dir or File"
            )
        elif isinstance(origin, type) and issubclass(
            origin, collections.abc.Iterator | collections.abc.AsyncIterator
        ):
            reason = (
                "a stream of values cannot leave a rank; return a list, or write the values "
                "to a file and return a flyte.io.File"
            )
        else:
            continue
        raise ValueError(
            f"output `{name}` of `{task_name}` is declared {python_type!r}, which cannot cross "
            f"from a rank: {reason}."
        )


# Inject the plugin into Flyte 2's plugin registry, as flyteplugins-spark does.
TaskPluginRegistry.register(HorovodSpark, HorovodSparkTask)
