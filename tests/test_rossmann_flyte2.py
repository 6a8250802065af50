"""The Rossmann pipeline on Flyte 2 (``workflows/rossmann_flyte2.py``): its weekly retraining
trigger and its train task's Spark settings as deployed, a bad ``work_dir`` refused first, and
the whole pipeline from its command line against the same naive baseline as the flytekit run."""

from __future__ import annotations

import asyncio
import pathlib
import time

import flyte
import pytest

pytest.importorskip("keras")

from flyte._internal.runtime.task_serde import translate_task_to_wire
from flyte._internal.runtime.trigger_serde import to_task_trigger
from flyte.models import SerializationContext
from google.protobuf.json_format import MessageToDict

from workflows import rossmann_flyte2 as r2
from workflows import rossmann_steps as steps

from test_rossmann import check_main_job

REPO = pathlib.Path(__file__).resolve().parent.parent


def _wire(task):
    return translate_task_to_wire(task, SerializationContext(version="v1", root_dir=REPO))


def test_weekly_retraining_trigger_is_declared_as_the_flytekit_launch_plan():
    """``rossmann`` carries one trigger, as deployed: Mondays 03:00 UTC with
    ``warm_start="latest"`` (the launch plan ``rossmann_weekly_retrain``'s schedule and input);
    the other inputs keep the task's defaults."""
    (trigger,) = r2.rossmann.triggers
    spec = _wire(r2.rossmann)
    wire = asyncio.run(
        to_task_trigger(trigger, r2.rossmann.name, spec.task_template.interface.inputs,
                        list(spec.default_inputs))
    )  # fmt: skip
    assert wire.name == "rossmann_weekly_retrain" == steps.RETRAIN_NAME and wire.spec.active
    cron = wire.automation_spec.schedule.cron
    assert (cron.expression, cron.timezone) == ("0 3 * * 1", "UTC")
    inputs = {lit.name: lit.value for lit in wire.spec.inputs.literals}
    assert list(inputs) == ["warm_start"]
    assert inputs["warm_start"].scalar.primitive.string_value == steps.LATEST


def test_train_gets_an_executor_per_rank_from_the_hyperparameters():
    """``rossmann`` calls ``train`` with ``HorovodSpark(num_proc=hp.num_proc)``: on a cluster
    its SparkApplication has an executor, and a task slot, per rank, and keeps ``SPARK_CONF``'s
    other settings."""
    wide = r2.train.override(plugin_config=r2.ranks_config(4))
    conf = MessageToDict(_wire(wide).task_template.custom)["sparkConf"]
    assert conf["spark.executor.instances"] == "4" and conf["spark.task.cpus"] == "1"
    assert conf["spark.dynamicAllocation.enabled"] == "false"
    assert conf["spark.sql.shuffle.partitions"] == "8"
    assert not [key for key in conf if "memory" in key]  # the deployment's defaults decide
    default = MessageToDict(_wire(r2.train).task_template.custom)["sparkConf"]
    assert default["spark.executor.instances"] == str(steps.Hyperparameters().num_proc)


def _local_run(tmp_path, task, **inputs):
    flyte.init()
    context = flyte.with_runcontext(
        mode="local", raw_data_path=str(tmp_path / "raw"), run_base_dir=str(tmp_path / "meta"),
        disable_run_cache=True,
    )  # fmt: skip
    return context.run(task, **inputs).outputs()


@pytest.mark.flyte
def test_a_bad_work_dir_fails_the_pipeline_at_its_first_task(tmp_path, monkeypatch):
    """Before any Spark work: a work_dir the Store cannot write, and on a cluster a local one
    (it would vanish with the pod), stop ``rossmann`` in seconds, naming what to pass."""
    blocker = tmp_path / "file"
    blocker.write_text("a file, not a directory")
    started = time.monotonic()
    with pytest.raises(Exception, match="cannot write to the store") as raised:
        _local_run(tmp_path, r2.rossmann, work_dir=str(blocker / "rossmann"))
    assert str(blocker) in str(raised.value)
    assert time.monotonic() - started < 20
    assert not list(tmp_path.rglob("*.csv"))  # download_data never ran

    monkeypatch.setattr(r2, "_on_cluster", lambda: True)  # what flyte.ctx() says in a pod
    with pytest.raises(Exception, match=r"is a local path, .* --work_dir s3://"):
        _local_run(tmp_path, r2.check_work_dir, work_dir=str(tmp_path / "work"))
    monkeypatch.undo()
    (prefix,) = _local_run(tmp_path, r2.check_work_dir, work_dir=str(tmp_path / "work"))
    assert prefix == str(tmp_path / "work")


@pytest.fixture(scope="module")
def flyte2_job(pipeline_runs):
    """`make run-flyte2`'s command line, run once (beside `make run`'s when the session has the
    main job's tests too: tests/pipelines.py)."""
    return pipeline_runs["flyte2_job"].result()


@pytest.mark.spark
@pytest.mark.mpi
@pytest.mark.flyte
@pytest.mark.e2e
@pytest.mark.timeout(720)
def test_the_flyte2_pipeline_beats_the_baseline_within_ten_minutes(flyte2_job, tmp_path):
    """What `make run-flyte2` runs (flyte run --local, the synthetic default, 2 ranks): the
    trained model beats the naive baseline on the same validation rows, as the flytekit run
    does, in at most 10 minutes."""
    job = flyte2_job
    model, baseline = check_main_job(job, tmp_path)
    print(f"flyte 2 pipeline: {job.seconds:.0f} s, RMSPE {model:.4f} (baseline {baseline:.4f})")
