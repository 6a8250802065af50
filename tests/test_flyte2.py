"""``flyte_hvd.flyte2``: Flyte 2 HorovodSpark tasks run locally (``flyte.run`` in local mode on
a real SparkSession, real ranks) and serialize as the SparkJob flyteplugins-spark produces."""

import dataclasses
import doctest
import gc
import json
import os
import pathlib
import tempfile
import threading
import time
from collections.abc import Iterator

import flyte
import pydantic
import pytest
from flyte.io import File
from flyte.models import SerializationContext
from flyteplugins.spark import Spark
from google.protobuf.json_format import MessageToDict

from flyte_hvd.data.store import Store
from flyte_hvd.estimators.history import history_html, watch_history
from flyte_hvd.flyte2 import HorovodSpark, HorovodSparkTask, fit_with_report

pytestmark = pytest.mark.flyte

REPO = pathlib.Path(__file__).resolve().parent.parent

env = flyte.TaskEnvironment(name="hvd2", plugin_config=HorovodSpark(num_proc=2))


@dataclasses.dataclass
class RankResult:
    rank: int
    size: int
    seen: list[int]
    greeting: File


class Summary(pydantic.BaseModel):
    ranks: int
    total: float


@env.task
def ranks(offset: int) -> tuple[RankResult, Summary]:
    import numpy as np

    import flyte_hvd.core as hvd

    seen = hvd.allgather(np.array([hvd.rank() + offset])).tolist()
    # Written in the rank's temporary folder, which is removed when the rank ends.
    path = os.path.join(tempfile.mkdtemp(), f"rank{hvd.rank()}.txt")
    with open(path, "w") as f:
        f.write(f"hello from rank {hvd.rank()} of {hvd.size()} in {flyte.ctx().action.name}")
    total = hvd.allreduce(np.array([float(hvd.rank())]), op=hvd.Sum)[0]
    summary = Summary(ranks=hvd.size(), total=float(total))
    return RankResult(hvd.rank(), hvd.size(), seen, File.from_local_sync(path)), summary


@env.task
def fails_on_rank_1() -> int:
    import flyte_hvd.core as hvd

    if hvd.rank() == 1:
        raise KeyError("missing shard")
    hvd.barrier()
    return 0


@env.task
def wrong_type() -> File:
    return 42  # type: ignore[return-value]


def local_run(tmp_path, task, *args):
    flyte.init()
    context = flyte.with_runcontext(
        mode="local", raw_data_path=str(tmp_path / "raw"), run_base_dir=str(tmp_path / "meta")
    )
    return context.run(task, *args)


@pytest.mark.mpi
@pytest.mark.spark
def test_body_runs_on_every_rank_and_outputs_are_rank_0s(spark_local2, tmp_path, no_leftover_ranks):
    assert isinstance(ranks, HorovodSparkTask) and ranks.task_type == "spark"
    result, summary = local_run(tmp_path, ranks, 10).outputs()
    assert (result.rank, result.size, result.seen) == (0, 2, [10, 11])
    assert summary == Summary(ranks=2, total=1.0)
    # Rank 0's file was copied to the run's raw data path before its folder went away.
    assert result.greeting.path.startswith(str(tmp_path / "raw"))
    with open(result.greeting.path) as f:
        assert f.read().startswith("hello from rank 0 of 2 in ")


@pytest.mark.mpi
@pytest.mark.spark
def test_a_task_runs_on_a_spark_connect_endpoint(spark_connect_url, tmp_path, no_leftover_ranks):
    """`connect_url`: Flyte 2 launches from a thread of its own, on the task's own Connect
    session, which is released and closed with the task."""
    from pyspark.sql.connect.client.core import SparkConnectClient
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    on_connect = flyte.TaskEnvironment(
        name="hvd2connect", plugin_config=HorovodSpark(num_proc=2, connect_url=spark_connect_url)
    )

    @on_connect.task
    def seen_by_ranks(offset: int) -> list[int]:
        import numpy as np

        import flyte_hvd.core as hvd

        return hvd.allgather(np.array([hvd.rank() + offset])).tolist()

    had = ConnectSession.getActiveSession()
    before = {id(o) for o in gc.get_objects() if isinstance(o, SparkConnectClient)}
    (seen,) = local_run(tmp_path, seen_by_ranks, 3).outputs()
    assert seen == [3, 4]
    made = [
        o for o in gc.get_objects() if isinstance(o, SparkConnectClient) and id(o) not in before
    ]
    assert made and all(client.is_closed for client in made)
    assert ConnectSession.getActiveSession() is had


@pytest.mark.mpi
@pytest.mark.spark
def test_a_failing_rank_fails_the_task_naming_it(spark_local2, tmp_path, no_leftover_ranks):
    started = time.monotonic()
    with pytest.raises(Exception, match="rank 1 failed") as info:
        local_run(tmp_path, fails_on_rank_1)
    assert "KeyError: 'missing shard'" in str(info.value)
    assert time.monotonic() - started < 60


@pytest.mark.spark
def test_rank_0_returning_the_wrong_type_says_which_output(spark_local2, tmp_path):
    with pytest.raises(
        Exception, match=r"output `o0` of `hvd2.wrong_type`: rank 0 returned int 42"
    ):
        local_run(tmp_path, wrong_type)


@pytest.mark.spark
def test_num_proc_above_the_sessions_slots_fails_before_ranks_start(spark_local2, tmp_path):
    wide = flyte.TaskEnvironment(name="wide", plugin_config=HorovodSpark(num_proc=3))

    @wide.task
    def three_ranks() -> int:
        return 0

    started = time.monotonic()
    with pytest.raises(Exception, match=r"`num_proc`=3 but the cluster has 2 free task slot"):
        local_run(tmp_path, three_ranks)
    assert time.monotonic() - started < 10


# -- serialization: the SparkJob flyteplugins-spark produces, with the barrier settings -------

# What the two configs have in common: the Spark plugin's own fields.
SPARK_FIELDS = {
    "hadoop_conf": {"fs.s3a.fast.upload": "true"},
    "executor_path": "/opt/py/bin/python",
}
CONFIG = HorovodSpark(num_proc=3, gpus_per_rank=2, spark_conf={"spark.executor.memory": "2g"},
                      **SPARK_FIELDS)  # fmt: skip


def _wire(plugin_config):
    from flyte._internal.runtime.task_serde import translate_task_to_wire

    environment = flyte.TaskEnvironment(
        name="wire", image="ghcr.io/x/y:1", plugin_config=plugin_config
    )

    @environment.task
    def body(x: int) -> int:
        return x

    return translate_task_to_wire(body, SerializationContext(version="v1", root_dir=REPO))


def test_serialized_task_is_the_spark_plugins_job_with_the_barrier_settings():
    ours = _wire(CONFIG).task_template
    spark_conf = CONFIG.effective_spark_conf
    theirs = _wire(Spark(spark_conf=spark_conf, **SPARK_FIELDS)).task_template
    assert ours.type == theirs.type == "spark"
    assert ours.custom == theirs.custom
    assert list(ours.container.args) == list(theirs.container.args)
    custom = MessageToDict(ours.custom)
    # The derivation is the flytekit plugin's (tests/test_flyte_plugin.py checks each value).
    assert custom["sparkConf"] == spark_conf
    assert spark_conf["spark.executor.instances"] == "3"
    assert spark_conf["spark.task.resource.gpu.amount"] == "2"
    assert spark_conf["spark.executor.memory"] == "2g"
    assert custom["executorPath"] == "/opt/py/bin/python"
    assert custom["hadoopConf"] == {"fs.s3a.fast.upload": "true"}


def test_config_example_defines_a_task():
    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner()
    for test in finder.find(HorovodSpark, globs={"flyte": flyte, "HorovodSpark": HorovodSpark}):
        runner.run(test)
    assert runner.tries > 0 and runner.failures == 0


# -- bad input: refused when the task is defined, before any rank starts ----------------------


def test_a_spark_plugin_config_on_a_horovod_task_is_refused():
    with pytest.raises(
        ValueError, match=r"`plugin_config` of `hvd2.ranks` must be a .*HorovodSpark; found Spark"
    ):
        ranks.override(plugin_config=Spark(spark_conf={"spark.executor.memory": "2g"}))
    # The other way round, a Spark task becomes a HorovodSpark one.
    spark_env = flyte.TaskEnvironment(name="plain", plugin_config=Spark())

    @spark_env.task
    def plain() -> int:
        return 0

    assert isinstance(plain.override(plugin_config=HorovodSpark(num_proc=2)), HorovodSparkTask)


def test_outputs_that_cannot_leave_a_rank_are_refused_when_the_task_is_defined():
    import pyspark.sql

    with pytest.raises(
        ValueError,
        match=r"`o0` of `hvd2.frame` is declared .*DataFrame.*cannot cross from a rank: a Spark",
    ):

        @env.task
        def frame() -> pyspark.sql.DataFrame: ...

    with pytest.raises(ValueError, match=r"output `o0` of `hvd2.stream` .*a stream of values"):

        @env.task
        def stream() -> Iterator[int]: ...


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_proc": 0}, r"`num_proc` must be an int >= 1; found 0"),
        (
            {"num_proc": 2, "executor_pod": {"spec": {}}},
            r"`executor_pod` must be a flyte.PodTemplate",
        ),
        (
            {"num_proc": 4, "spark_conf": {"spark.executor.instances": "2"}},
            r"`num_proc`=4 needs 4 task slots, but `spark_conf` leaves 2",
        ),
        (
            {"num_proc": 2, "connect_url": "http://spark:15002"},
            r"`connect_url` must be a Spark Connect URL",
        ),
    ],
)
def test_bad_config_is_refused_with_what_to_change(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HorovodSpark(**kwargs)


# -- live progress: an estimator's epochs in the task's report ------------------------------


class EpochWriter:
    """An estimator's seam: ``fit`` publishes epochs as rank 0 does (``state.json`` in the
    Store, through the estimators' own ``RunRecord``), waiting after each for ``shown``."""

    def __init__(self, store, epochs, shown):
        self.store, self.epochs, self.shown, self.run_id = store, epochs, shown, None

    def getRunId(self):  # the estimators' Param API
        return self.run_id

    def copy(self):
        return EpochWriter(self.store, self.epochs, self.shown)

    def setRunId(self, run_id):
        self.run_id = run_id

    def getStore(self):
        return self.store

    def fit(self, df, params=None):
        from flyte_hvd.estimators.training import RunRecord

        record = RunRecord(self.store.to_remote(self.run_id, None), None, self.epochs, ".txt")
        last = os.path.join(tempfile.mkdtemp(), "last.txt")
        pathlib.Path(last).write_text("model")
        for epoch in range(self.epochs):
            record.epoch_end(
                epoch, {"loss": 1.0 / (epoch + 1), "val_loss": 2.0 / (epoch + 1)}, last
            )
            assert self.shown(epoch + 1), f"epoch {epoch + 1} did not reach the report"
        return Fitted(record.history)


@dataclasses.dataclass
class Fitted:
    history: dict

    def getHistory(self):
        return self.history


def test_fit_with_report_flushes_the_report_after_every_epoch(tmp_path):
    store = Store.create(str(tmp_path / "store"))
    reporting = flyte.TaskEnvironment(name="reporting")

    @reporting.task(report=True)
    def train() -> tuple[int, str]:
        report = pathlib.Path(flyte.ctx().output_path) / "report.html"

        def shown(epochs: int) -> bool:  # the flushed report has a row per epoch so far
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                if report.exists() and report.read_text().count("<tr><td>") == epochs:
                    return True
                time.sleep(0.05)
            return False

        model = fit_with_report(EpochWriter(store, 3, shown), None, poll_s=0.1)
        return len(model.getHistory()["loss"]), str(report)

    epochs, report = local_run(tmp_path, train).outputs()
    assert epochs == 3
    text = pathlib.Path(report).read_text()
    assert "<th>val_loss</th>" in text and "<polyline" in text and "0.3333" in text


def test_a_failing_report_does_not_stop_the_fit(tmp_path, caplog):
    store = Store.create(str(tmp_path / "store"))
    remote = store.to_remote("run", None)
    remote.store.write_text(remote.state_path, json.dumps({"history": {"loss": [1.0]}}))
    calls = threading.Event()

    def broken(history):
        calls.set()
        raise OSError("report storage is down")

    with watch_history(store, "run", broken, poll_s=0.05):
        assert calls.wait(5)
    assert "the progress of run run could not be shown: report storage is down" in caplog.text
    assert "<td>1</td><td>1</td>" in history_html({"loss": [1.0]})
