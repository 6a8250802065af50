"""A classic session's barrier stage (``ClassicBackend``, an RDD barrier stage, what
``pipeline.launch`` runs on a ``SparkContext``): its task slots and the wait for executors that
are still registering, and the spare rank processes started ahead of an estimator's run.

The driver checks that the cluster can hold the stage (free slots, no dynamic allocation)
before submitting, so a job that cannot start fails in seconds with what to change, not after
Horovod's 600 s "Timed out waiting for Spark tasks".
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from flyte_hvd.core.log import get_logger
from flyte_hvd.stage.dataframe_stage import run_data_stage
from flyte_hvd.stage.pipeline import (
    expected_executors,
    is_local,
    slots_message,
    stage_attempts,
)
from flyte_hvd.stage.pipeline import start_spares as pipeline_start_spares
from flyte_hvd.stage.rank_task import BarrierTask, SpareTask

if TYPE_CHECKING:
    from pyspark import SparkContext
    from pyspark.sql import DataFrame

logger = get_logger(__name__)

_SLOT_POLL_S = 1.0


def task_slots(sc: SparkContext) -> int:
    """How many tasks of the default resource profile the cluster can run at once now
    (what Spark's own barrier check counts: cores and accelerators per executor)."""
    jsc = sc._jsc.sc()
    profile = jsc.resourceProfileManager().defaultResourceProfile()
    return int(jsc.maxNumConcurrentTasks(profile))


def _registered_executors(sc: SparkContext) -> int:
    return max(0, int(sc._jsc.sc().getExecutorMemoryStatus().size()) - 1)  # minus the driver


def wait_for_slots(sc: SparkContext, num_proc: int, deadline: float, timeout: float) -> None:
    """Fail fast when the stage can never be scheduled; wait (up to the deadline) only while
    executors the application asked for are still registering."""
    conf = sc.getConf()
    if conf.get("spark.dynamicAllocation.enabled", "false").lower() == "true":
        raise RuntimeError(
            "Spark barrier stages cannot run with dynamic allocation: set "
            f"spark.dynamicAllocation.enabled=false and spark.executor.instances so the "
            f"cluster has {num_proc} task slots."
        )
    while True:
        slots = task_slots(sc)
        if slots >= num_proc:
            return
        expected = expected_executors(sc)
        registered = _registered_executors(sc)
        coming = expected is not None and registered < expected
        if not coming or time.monotonic() >= deadline:
            raise RuntimeError(slots_message(sc, num_proc, slots, registered, coming, timeout))
        time.sleep(_SLOT_POLL_S)


def start_spares(
    sc: SparkContext, num_proc: int, env: dict[str, str] | None, preload: tuple[str, ...]
) -> threading.Thread | None:
    """Spare rank processes for the RDD barrier stage that follows
    (``pipeline.start_spares``): a short RDD job, so that they start in the Python workers
    that run RDD tasks."""

    def submit(task: SpareTask) -> int:
        sc.setLocalProperty("spark.job.description", "flyte-hvd: spare rank processes")
        return int(sc.parallelize(range(num_proc), num_proc).mapPartitions(task).sum())

    return pipeline_start_spares(str(sc.master), num_proc, env, preload, submit)


# How long a failed run waits for its stage's cancelled tasks to report their end.
SETTLE_TIMEOUT_S = 5.0


class ClassicBackend:
    """A classic session's barrier stage (``pipeline.StageBackend``): an RDD stage, task slots
    from the scheduler, cancelled by job tag."""

    label = ""

    def __init__(self, sc: SparkContext):
        self.sc = sc
        self.master = str(sc.master)

    def default_parallelism(self) -> int:
        return int(self.sc.defaultParallelism)

    def wait_for_slots(self, num_proc: int, deadline: float, timeout: float) -> None:
        wait_for_slots(self.sc, num_proc, deadline, timeout)

    def stage_attempts(self) -> int:
        return stage_attempts(self.sc)

    def link_host(self) -> str:
        """Loopback when every task runs on this host (``local``, ``local[N]``,
        ``local-cluster``), whatever ``spark.driver.host`` says: there it is the host's
        external address, and nothing beyond the host needs the link. Else the driver's
        address, where executors reach the driver."""
        if is_local(self.master) or self.master.startswith("local-cluster["):
            return "127.0.0.1"
        return self.sc.getConf().get("spark.driver.host") or "127.0.0.1"

    def run_stage(
        self,
        task: BarrierTask,
        num_proc: int,
        retried: bool,
        tag: str,
        data: DataFrame | None = None,
    ) -> list[tuple[int, bytes]]:
        self.sc.addJobTag(tag)
        try:
            if data is not None:  # the DataFrame's rows reach the tasks as Arrow batches
                return run_data_stage(data, num_proc, task, retried)
            rdd = self.sc.parallelize(range(num_proc), num_proc).barrier().mapPartitions(task)
            if retried:
                # Spark retries a failed barrier stage only when it feeds a shuffle (a failed
                # barrier result stage is aborted); the driver stops it after the last attempt.
                rdd = rdd.partitionBy(1)
            return sorted(rdd.collect())
        finally:
            self.sc.removeJobTag(tag)

    def cancel(self, tag: str) -> None:
        self.sc.cancelJobsWithTag(tag)

    def settle(self, tag: str, timeout: float = SETTLE_TIMEOUT_S) -> None:
        """Waits until the stages of the jobs tagged ``tag`` have no running task (at most
        ``timeout``): a cancelled task reports its end after the job failed, and a
        SparkContext stopped meanwhile (a script's ``spark.stop()`` right after our error)
        logs a Java stack for it."""
        tracker = self.sc._jsc.sc().statusTracker()
        deadline = time.monotonic() + timeout
        try:
            stages = [
                stage
                for job in tracker.getJobIdsForTag(tag)
                for stage in (
                    tracker.getJobInfo(job).get().stageIds()
                    if tracker.getJobInfo(job).isDefined()
                    else []
                )
            ]
            while time.monotonic() < deadline:
                infos = [tracker.getStageInfo(stage) for stage in stages]
                if not any(i.isDefined() and i.get().numActiveTasks() > 0 for i in infos):
                    return
                time.sleep(0.05)
        except Exception as error:  # py4j or a stopped context: nothing to wait for
            logger.debug("waiting for the stage's tasks to end: %s", error)
