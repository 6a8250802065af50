"""``HorovodSpark``: a Flyte Spark task whose function body runs on every rank.

``@task(task_config=HorovodSpark(num_proc=2))`` makes a flytekitplugins-spark task: on
Kubernetes it becomes a SparkApplication (the Spark operator reads ``get_custom``), under
``pyflyte run`` it gets a local SparkSession. Its body does not run on the Spark driver: the
driver starts ``num_proc`` ranks in one Spark barrier stage (``flyte_hvd.spark.run``), each
rank calls ``flyte_hvd.core.init()`` and then the body, and the task's outputs are rank 0's
return values. This module is the driver half; ``rank.py`` turns rank 0's value into the
outputs, and ``flyte_hvd.stage.flyte_task`` holds what the flytekit and Flyte 2 plugins share.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from flytekit import FlyteContextManager, PodTemplate
from flytekit.configuration import SerializationSettings
from flytekit.core.context_manager import ExecutionParameters, ExecutionState
from flytekit.extend import TaskPlugins
from flytekit.models.literals import LiteralMap
from flytekitplugins.spark.task import PysparkFunctionTask

from flyte_hvd.core.types import UserValue
from flyte_hvd.estimators import report, tracking
from flyte_hvd.estimators.tracking import MlflowConfig
from flyte_hvd.flyte.rank import RankSpec, literal_map_from_bytes
from flyte_hvd.launch import failures
from flyte_hvd.stage.flyte_task import (
    BarrierTaskConfig,
    BodyResult,
    connect_session,
    launch_body,
    release,
    start_local_session,
)


@dataclass(frozen=True)
class HorovodSpark(BarrierTaskConfig):
    """flytekit task config for ``num_proc`` ranks in one Spark barrier stage:
    ``@task(task_config=HorovodSpark(num_proc=2))``.

    The fields, the Spark settings derived from them and their checks are
    ``flyte_hvd.stage.flyte_task.BarrierTaskConfig``'s; ``driver_pod`` and ``executor_pod``
    are ``flytekit.PodTemplate``s, as in ``flytekitplugins.spark.Spark``.

    With ``mlflow`` the task is an MLflow run: the driver opens it before any rank starts
    (an unreachable server or a refused experiment fails the task there) with the task's
    scalar inputs as params; on rank 0 it is MLflow's active run (``MLFLOW_RUN_ID``) while the
    body runs, and the epochs ``flyte_hvd.keras.callbacks.MetricAverageCallback`` records are
    logged to it. Every task shows a "Training" Deck: ranks, hosts, the MLflow run, and the
    recorded epochs as a table and curves.
    """

    pod_template_type: ClassVar[type] = PodTemplate
    pod_template_name: ClassVar[str] = "flytekit.PodTemplate"

    driver_pod: PodTemplate | None = None
    executor_pod: PodTemplate | None = None
    # True (MLflow's ``MLFLOW_TRACKING_URI`` and ``MLFLOW_EXPERIMENT_NAME``) or an
    # ``MlflowConfig``: the task is an MLflow run.
    mlflow: bool | MlflowConfig | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        tracking.resolve_config(self.mlflow)


# -- the task --------------------------------------------------------------------------------


class HorovodSparkFunctionTask(PysparkFunctionTask):
    """A Spark task whose body runs on ``num_proc`` ranks; outputs are rank 0's."""

    def __init__(
        self,
        task_config: HorovodSpark,
        task_function: Callable[..., Any],
        **kwargs: Any,  # flytekit's task arguments, passed on
    ) -> None:
        if not isinstance(task_config, HorovodSpark):
            raise ValueError(
                f"`task_config` must be a HorovodSpark; found {type(task_config).__name__}."
            )
        if kwargs.get("enable_deck") is None and kwargs.get("disable_deck") is None:
            kwargs["enable_deck"] = True  # the run's report; `enable_deck=False` turns it off
            kwargs.pop("disable_deck", None)
        super().__init__(task_config=task_config, task_function=task_function, **kwargs)

    def get_custom(self, settings: SerializationSettings) -> dict[str, Any]:
        """The SparkJob of flytekitplugins-spark, with the derived barrier settings."""
        custom = super().get_custom(settings)
        custom["sparkConf"] = self.task_config.effective_spark_conf
        return custom

    def pre_execute(self, user_params: ExecutionParameters) -> ExecutionParameters:
        """Locally, start the SparkSession flytekit would start, with a task slot per rank
        (``start_local_session``); then flytekit's own ``pre_execute`` picks it up. With
        ``connect_url``, the Spark Connect session instead."""
        ctx = FlyteContextManager.current_context()
        state = ctx.execution_state
        in_pod = bool(state and state.mode == ExecutionState.Mode.TASK_EXECUTION)
        url = self.task_config.connect_url
        if url is not None:
            fast = (
                ctx.serialization_settings
                and ctx.serialization_settings.fast_serialization_settings
            )
            shipped = bool(fast and fast.enabled and in_pod)
            self.sess = connect_session(url, self.task_config, os.getcwd() if shipped else None)
            return user_params.builder().add_attr("SPARK_SESSION", self.sess).build()
        if not in_pod:
            start_local_session(f"FlyteSpark: {user_params.execution_id}", self.task_config)
        return super().pre_execute(user_params)

    def execute(self, **kwargs: UserValue) -> LiteralMap:  # the task's inputs
        """Run the body on every rank and return rank 0's outputs as Flyte literals."""
        from flyte_hvd.stage.pipeline import logged_interrupt

        ctx = FlyteContextManager.current_context()
        config = self.task_config
        connect = self.sess if config.connect_url is not None else None
        started = time.monotonic()
        mlflow_run = None
        failed = True
        try:
            mlflow_config = tracking.resolve_config(config.mlflow)
            if mlflow_config is not None:
                params = {**kwargs, "num_proc": config.num_proc, "task": self.name}
                mlflow_run = tracking.start_run(
                    mlflow_config, self.name.split(".")[-1], tracking.loggable_params(params)
                )
            spec = replace(RankSpec.of(self, ctx), mlflow_run=mlflow_run)
            with failures.as_flyte_errors():  # recoverable ones as FlyteRecoverableException
                result = launch_body(self.name, self._task_function, kwargs, spec, config, connect)
            failed = False
        except KeyboardInterrupt as interrupt:
            if not logged_interrupt(interrupt):
                raise
            # Ctrl-C stopped the ranks and said so: end as a command ends on Ctrl-C (130),
            # where click (`pyflyte run`) would print "Aborted!" and exit 1.
            raise SystemExit(130) from None
        finally:
            tracking.end_run(mlflow_run, failed)
            if connect is not None:  # also where the task failed before its launch
                release(connect)
        self._report(result, mlflow_run, time.monotonic() - started)
        return literal_map_from_bytes(result.outputs)

    def _report(
        self, result: BodyResult, mlflow_run: tracking.MlflowRun | None, seconds: float
    ) -> None:
        """The task's "Training" Deck: ranks, hosts, MLflow run and rank 0's epochs. A local
        run writes the Deck file here: flytekit writes it only for tasks that return Python
        values, and this one returns rank 0's literals."""
        history: dict[str, list[float]] = {}
        for epoch in result.epochs:
            for name, value in epoch.metrics.items():
                history.setdefault(name, []).append(value)
        facts = {
            "task": self.name,
            "ranks": len(result.hosts),
            "hosts": sorted(set(result.hosts)),
            "seconds": f"{seconds:.1f}",
            "MLflow run id": mlflow_run.run_id if mlflow_run else None,
            "MLflow tracking URI": mlflow_run.tracking_uri if mlflow_run else None,
        }
        html = report.run_report_html(facts, history, [e.seconds for e in result.epochs])
        if not report.add_deck(html) or not self.enable_deck:
            return
        ctx = FlyteContextManager.current_context()
        if ctx.execution_state and ctx.execution_state.is_local_execution():
            from flytekit.deck.deck import _output_deck

            _output_deck(self.name.split(".")[-1], ctx.user_space_params)


# Inject the plugin into flytekit's dynamic plugin loading, as flytekitplugins-spark does.
TaskPlugins.register_pythontask_plugin(HorovodSpark, HorovodSparkFunctionTask)
