"""``flyte_hvd.flyte``: HorovodSpark tasks run locally (Flyte local execution on a real
SparkSession) and serialize to the SparkJob the Spark operator reads."""

import dataclasses
import os
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections import OrderedDict
from typing import NamedTuple

import flytekit
import pytest
from flytekit import task, workflow
from flytekit.configuration import Image, ImageConfig, SerializationSettings
from flytekit.tools.translator import get_serializable
from flytekit.types.file import FlyteFile
from flytekitplugins.spark import Spark

from flyte_hvd.core.errors import RanksFailedError
from flyte_hvd.estimators.tracking import MlflowConfig
from flyte_hvd.flyte import HorovodSpark, HorovodSparkFunctionTask
from flyte_hvd.flyte.rank import RankSpec, _to_literal_map
from flyte_hvd.stage.flyte_task import (
    GPU_EXECUTOR_CONF,
    PYTHON_WORKER_CONF,
    pickle_body,
    quiet_local_conf,
)

from test_output import assert_shown, printer

pytestmark = pytest.mark.flyte

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class RankInfo(NamedTuple):
    rank: int
    size: int
    ranks_seen: list[int]
    initialized_before_body: bool


@task(task_config=HorovodSpark(num_proc=2))
def rank_info(offset: int) -> RankInfo:
    import numpy as np

    import flyte_hvd.core as hvd

    initialized = hvd.is_initialized()
    hvd.init()  # a no-op: the plugin initialized this rank
    seen = hvd.allgather(np.array([hvd.rank() + offset])).tolist()
    return RankInfo(hvd.rank(), hvd.size(), seen, initialized)


@task(task_config=HorovodSpark(num_proc=2))
def rank_file(greeting: str) -> FlyteFile:
    import flyte_hvd.core as hvd

    # The rank's working directory is removed when the rank ends: the file must be uploaded.
    path = os.path.join(flytekit.current_context().working_directory, f"rank{hvd.rank()}.txt")
    with open(path, "w") as f:
        f.write(f"{greeting} from rank {hvd.rank()} of {hvd.size()}")
    return FlyteFile(path)


@task(task_config=HorovodSpark(num_proc=2))
def printing() -> int:
    return printer()()


@pytest.mark.spark
def test_rank_output_of_any_bytes_reaches_the_task_log(spark_local2, capfd):
    assert printing() == 0
    captured = capfd.readouterr()
    assert_shown(captured.out + captured.err)


@task
def read_file(f: FlyteFile) -> str:
    with open(f) as handle:
        return handle.read()


@workflow
def file_workflow(greeting: str) -> str:
    return read_file(f=rank_file(greeting=greeting))


@pytest.mark.mpi
@pytest.mark.spark
def test_body_runs_on_every_rank_and_outputs_are_rank_0s(spark_local2, no_leftover_ranks):
    assert isinstance(rank_info, HorovodSparkFunctionTask)
    assert rank_info.task_type == "spark"
    out = rank_info(offset=10)
    assert (out.rank, out.size, out.ranks_seen, out.initialized_before_body) == (
        0,
        2,
        [10, 11],
        True,
    )


@pytest.mark.spark
def test_flytefile_written_by_rank_0_reaches_the_outputs(spark_local2):
    out = rank_file(greeting="hello")
    raw_prefix = flytekit.FlyteContextManager.current_context().file_access.raw_output_prefix
    assert os.path.abspath(out.path).startswith(os.path.abspath(raw_prefix))
    with open(out) as f:
        assert f.read() == "hello from rank 0 of 2"


@pytest.mark.spark
def test_flytefile_flows_to_the_next_task_in_a_workflow(spark_local2):
    assert file_workflow(greeting="hi") == "hi from rank 0 of 2"


@pytest.mark.mpi
@pytest.mark.spark
def test_a_failing_rank_fails_the_task_naming_it(spark_local2, no_leftover_ranks):
    @task(task_config=HorovodSpark(num_proc=2))
    def fails_on_rank_1() -> int:
        import flyte_hvd.core as hvd

        if hvd.rank() == 1:
            raise KeyError("missing shard")
        hvd.barrier()
        return 0

    with pytest.raises(RanksFailedError, match="rank 1 failed") as info:
        fails_on_rank_1()
    assert "KeyError: 'missing shard'" in str(info.value)


@pytest.mark.spark
def test_rank_0_returning_the_wrong_type_says_which_output(spark_local2):
    @task(task_config=HorovodSpark(num_proc=2))
    def wrong_type() -> FlyteFile:
        return 42

    with pytest.raises(RanksFailedError, match=r"output `o0` of .*: rank 0 returned int 42"):
        wrong_type()


@pytest.mark.spark
def test_num_proc_above_the_sessions_slots_fails_with_the_preflight_message(spark_local2):
    @task(task_config=HorovodSpark(num_proc=3))
    def three_ranks() -> int:
        return 0

    with pytest.raises(RuntimeError, match=r"`num_proc`=3 but the cluster has 2 free task slot"):
        three_ranks()


# -- serialization ---------------------------------------------------------------------------

SETTINGS = SerializationSettings(
    project="project",
    domain="domain",
    version="version",
    env={"FOO": "baz"},
    image_config=ImageConfig(default_image=Image(name="default", fqn="test", tag="tag")),
)


@task(
    task_config=HorovodSpark(
        num_proc=4,
        cores_per_rank=2,
        gpus_per_rank=1,
        spark_conf={"spark.executor.memory": "4g", "spark.executor.instances": 5},
        hadoop_conf={"fs.s3a.fast.upload": "true"},
        executor_path="/opt/conda/bin/python",
    )
)
def configured(x: int) -> int:
    return x


def test_get_custom_has_the_derived_spark_settings_and_overrides():
    custom = configured.get_custom(SETTINGS)
    assert custom["sparkConf"] == {
        "spark.executor.instances": "5",  # overridden
        "spark.executor.cores": "2",
        "spark.task.cpus": "2",
        "spark.dynamicAllocation.enabled": "false",
        **PYTHON_WORKER_CONF,  # Python workers on Unix domain sockets
        "spark.executor.resource.gpu.amount": "1",
        "spark.task.resource.gpu.amount": "1",
        "spark.executor.resource.gpu.vendor": "nvidia.com",
        **GPU_EXECUTOR_CONF,  # a memory-backed /dev/shm and the GPU node selector
        "spark.executor.memory": "4g",
    }
    assert custom["hadoopConf"] == {"fs.s3a.fast.upload": "true"}
    assert custom["executorPath"] == "/opt/conda/bin/python"
    assert custom["mainApplicationFile"].startswith("local://")
    # The user's own settings stay as given; the derived ones are computed from them.
    assert configured.task_config.spark_conf == {
        "spark.executor.memory": "4g",
        "spark.executor.instances": "5",
    }


def test_serialized_task_is_a_spark_task_with_the_barrier_settings():
    spec = get_serializable(OrderedDict(), SETTINGS, rank_info)
    assert spec.template.type == "spark"
    conf = spec.template.custom["sparkConf"]
    assert conf["spark.executor.instances"] == "2"
    assert conf["spark.dynamicAllocation.enabled"] == "false"
    assert not any("gpu" in key for key in conf)


def test_local_session_has_a_task_slot_per_rank_and_no_gpu_settings():
    config = HorovodSpark(num_proc=3, cores_per_rank=2, gpus_per_rank=1)
    assert config.local_spark_conf["spark.master"] == "local[6]"
    assert not any("gpu" in key for key in config.local_spark_conf)
    assert (
        HorovodSpark(2, spark_conf={"spark.master": "local[8]"}).local_spark_conf["spark.master"]
        == "local[8]"
    )


def test_a_local_session_is_quiet_unless_the_caller_says_otherwise(monkeypatch):
    options = HorovodSpark(2).local_spark_conf["spark.driver.extraJavaOptions"]
    path = options.removeprefix("-Dlog4j2.configurationFile=file:")
    with open(path) as f:
        assert "rootLogger" in f.read()
    own = {"spark.driver.extraJavaOptions": "-Dmine=1"}
    assert (
        HorovodSpark(2, spark_conf=own).local_spark_conf["spark.driver.extraJavaOptions"]
        == "-Dmine=1"
    )
    monkeypatch.setenv("FLYTE_HVD_SPARK_LOG", "warn")
    assert "spark.driver.extraJavaOptions" not in HorovodSpark(2).local_spark_conf
    monkeypatch.setenv("FLYTE_HVD_SPARK_LOG", "quiet")
    with pytest.raises(ValueError, match="FLYTE_HVD_SPARK_LOG='quiet': expected 'error'"):
        quiet_local_conf()
    # Not in what a cluster's SparkApplication gets: its JVM does not see this machine's file.
    assert "spark.driver.extraJavaOptions" not in HorovodSpark(2).effective_spark_conf


def test_config_is_frozen_and_replace_derives_again():
    config = HorovodSpark(num_proc=2, spark_conf={"spark.executor.memory": "2g"})
    with pytest.raises(AttributeError):
        config.num_proc = 3  # type: ignore[misc]
    bigger = dataclasses.replace(config, num_proc=4)
    assert bigger.effective_spark_conf["spark.executor.instances"] == "4"
    assert bigger.effective_spark_conf["spark.executor.memory"] == "2g"


def test_task_class_refuses_another_config():
    with pytest.raises(ValueError, match="`task_config` must be a HorovodSpark; found Spark"):
        HorovodSparkFunctionTask(task_config=Spark(), task_function=read_file.task_function)


def test_rank_0_returning_too_few_values_names_the_outputs():
    """The conversion rank 0 runs, called here directly with the task's own output spec."""

    @task(task_config=HorovodSpark(num_proc=2))
    def two_outputs() -> tuple[int, str]:
        return 1, "a"

    ctx = flytekit.FlyteContextManager.current_context()
    spec = RankSpec.of(two_outputs, ctx)
    literals = _to_literal_map(ctx, (7, "b"), spec).literals
    assert literals["o0"].scalar.primitive.integer == 7
    assert literals["o1"].scalar.primitive.string_value == "b"
    with pytest.raises(
        ValueError, match=r"declares 2 outputs \(o0, o1\), but rank 0 returned int 7"
    ):
        _to_literal_map(ctx, 7, spec)


def test_unpicklable_inputs_are_refused_before_any_rank_starts():
    ctx = flytekit.FlyteContextManager.current_context()
    with pytest.raises(
        ValueError, match=r"the body of `.*rank_info` or its inputs cannot be pickled"
    ):
        pickle_body(
            rank_info.name,
            rank_info.task_function,
            {"offset": threading.Lock()},
            RankSpec.of(rank_info, ctx),
        )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_proc": 0}, r"`num_proc` must be an int >= 1; found 0"),
        ({"num_proc": "2"}, r"`num_proc` must be an int >= 1; found '2' \(str\)"),
        ({"num_proc": True}, r"`num_proc` must be an int >= 1; found True \(bool\)"),
        ({"num_proc": 2, "gpus_per_rank": -1}, r"`gpus_per_rank` must be an int >= 0; found -1"),
        ({"num_proc": 2, "cores_per_rank": 1.5}, r"`cores_per_rank` must be an int >= 1"),
        ({"num_proc": 2, "start_timeout": 0}, r"`start_timeout` must be seconds > 0"),
        ({"num_proc": 2, "spark_conf": ["a"]}, r"`spark_conf` must be a dict .*found list"),
        ({"num_proc": 2, "spark_conf": {1: "a"}}, r"`spark_conf` keys must be str; found 1"),
        ({"num_proc": 2, "hadoop_conf": {"a": None}}, r"`hadoop_conf\['a'\]` must be a str"),
        ({"num_proc": 2, "executor_pod": {"spec": {}}}, r"`executor_pod` must be a flytekit"),
        ({"num_proc": 2, "mlflow": "http://mlflow:5000"}, r"`mlflow` must be True .*MlflowConfig"),
        (
            {"num_proc": 2, "spark_conf": {"spark.dynamicAllocation.enabled": "true"}},
            r"spark.dynamicAllocation.enabled='true'.*needs 'false'.*Remove the override",
        ),
        (
            {"num_proc": 4, "spark_conf": {"spark.executor.instances": "2"}},
            r"`num_proc`=4 needs 4 task slots, but `spark_conf` leaves 2: "
            r"spark.executor.instances=2 x 1 per executor",
        ),
        (
            {"num_proc": 2, "spark_conf": {"spark.task.cpus": "2"}},
            r"leaves 0: .*spark.executor.cores=1 // spark.task.cpus=2",
        ),
        (
            {
                "num_proc": 2,
                "gpus_per_rank": 1,
                "spark_conf": {"spark.task.resource.gpu.amount": 2},
            },
            r"leaves 0: .*gpu.amount=1 / spark.task.resource.gpu.amount=2",
        ),
        (
            {"num_proc": 2, "spark_conf": {"spark.executor.cores": "two"}},
            r"`spark_conf\['spark.executor.cores'\]` must be a number >= 1; found 'two'",
        ),
    ],
)
def test_bad_config_is_refused_with_what_to_change(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HorovodSpark(**kwargs)


def test_fractional_gpus_share_an_executor():
    config = HorovodSpark(
        num_proc=4,
        gpus_per_rank=1,
        spark_conf={
            "spark.executor.instances": "2",
            "spark.executor.cores": "2",
            "spark.task.cpus": "1",
            "spark.task.resource.gpu.amount": "0.5",
        },
    )
    assert config.effective_spark_conf["spark.task.resource.gpu.amount"] == "0.5"


# -- a fresh pyflyte process: local session, interpreter, files through an object store -------

SCRIPT = """
import os

import flytekit
from flytekit import task, workflow
from flytekit.types.file import FlyteFile

from flyte_hvd.flyte import HorovodSpark


@task(task_config=HorovodSpark(num_proc=3))
def write() -> FlyteFile:
    import flyte_hvd.core as hvd

    path = os.path.join(flytekit.current_context().working_directory, "result.txt")
    with open(path, "w") as f:
        f.write(f"rank {hvd.rank()} of {hvd.size()}")
    return FlyteFile(path)


@task
def read(f: FlyteFile) -> str:
    with open(f) as handle:
        return "read: " + handle.read()


@workflow
def wf() -> str:
    return read(f=write())
"""


def test_pyflyte_run_starts_a_session_and_files_travel_through_the_object_store(
    tmp_path, s3_server
):
    """No SparkSession, no PYSPARK_PYTHON, more ranks than cores, and a raw output prefix in
    S3: rank 0's file must go to S3 from the rank, as it does from an executor pod."""
    script = tmp_path / "horovod_wf.py"
    script.write_text(textwrap.dedent(SCRIPT))
    prefix = f"raw-{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYSPARK_")}
    env.update(
        FLYTE_AWS_ENDPOINT=s3_server.endpoint_url,
        FLYTE_AWS_ACCESS_KEY_ID=s3_server.key,
        FLYTE_AWS_SECRET_ACCESS_KEY=s3_server.secret,
    )
    pyflyte = os.path.join(os.path.dirname(sys.executable), "pyflyte")
    done = subprocess.run(
        [pyflyte, "run", "--raw-output-data-prefix", f"s3://{s3_server.bucket}/{prefix}",
         str(script), "wf"],
        capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "read: rank 0 of 3" in done.stdout
    listed = s3_server.client().list_objects_v2(Bucket=s3_server.bucket, Prefix=prefix)
    keys = [item["Key"] for item in listed.get("Contents", [])]
    assert any(key.endswith("/result.txt") for key in keys), keys


@pytest.mark.mpi
@pytest.mark.spark
def test_a_task_runs_on_a_spark_connect_endpoint(spark_connect_url, no_leftover_ranks):
    """`connect_url`: the task connects to an existing cluster instead of starting a session;
    the ranks run in that cluster and the outputs are rank 0's, as on a session of its own."""

    @task(task_config=HorovodSpark(num_proc=2, connect_url=spark_connect_url))
    def on_connect(offset: int) -> RankInfo:
        import numpy as np

        import flyte_hvd.core as hvd

        seen = hvd.allgather(np.array([hvd.rank() + offset])).tolist()
        return RankInfo(hvd.rank(), hvd.size(), seen, hvd.is_initialized())

    from pyspark.sql.connect.session import SparkSession as ConnectSession

    had = ConnectSession.getActiveSession()  # the test session's own, or none
    assert on_connect(offset=5) == RankInfo(0, 2, [5, 6], True)
    # The task ran on a Connect session of its own, which stops being active with the task;
    # one the process had stays active and working.
    assert on_connect.sess is not had
    assert ConnectSession.getActiveSession() is had
    if had is not None:
        assert had.range(3).count() == 3

    @task(
        task_config=HorovodSpark(
            num_proc=2, connect_url=spark_connect_url, spark_conf={"spark.executor.memory": "2g"}
        )
    )
    def fixed_setting() -> int:
        return 0

    with pytest.raises(RuntimeError, match=r"\['spark\.executor\.memory'\].*cannot change"):
        fixed_setting()
    assert ConnectSession.getActiveSession() is had
    # Each task's session was the task's own: released and its client closed, so pyspark
    # has nothing to clean up at the process's exit.
    assert on_connect.sess.client.is_closed

    # A task that fails after its session opened and before its launch releases it too.
    gone = socket.socket()
    gone.bind(("127.0.0.1", 0))
    uri = f"http://127.0.0.1:{gone.getsockname()[1]}"
    gone.close()

    @task(
        task_config=HorovodSpark(
            num_proc=2, connect_url=spark_connect_url, mlflow=MlflowConfig(tracking_uri=uri)
        )
    )
    def tracked() -> int:
        return 0

    with pytest.raises(RuntimeError, match=r"tracking server at .* is not reachable"):
        tracked()
    assert tracked.sess.client.is_closed
    assert ConnectSession.getActiveSession() is had


_CONNECT_CHILD = """
import socket, sys, time
from flyte_hvd.flyte import HorovodSpark
from flyte_hvd.stage import flyte_task

gone = socket.socket()
gone.bind(("127.0.0.1", 0))  # a port nothing listens on: the server is gone
port = gone.getsockname()[1]
gone.close()
session = flyte_task.connect_session(f"sc://127.0.0.1:{port}", HorovodSpark(num_proc=2))
print("built", flush=True)
if sys.argv[1] == "release":
    flyte_task.RELEASE_SECONDS = 1.0
    flyte_task.release(session)
    print("closed", session.client.is_closed, flush=True)
"""


def test_a_connect_session_a_task_built_ends_bounded_where_its_server_is_gone():
    """A task's Connect session is released when its launch ends; where the server is gone
    (its cluster ended with the task), the release gives up after its bound and the process
    exits at once. Left open (the second process), pyspark's exit hook retries the client's
    clean-up against the missing server for about 10 minutes."""

    def start(mode: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-c", _CONNECT_CHILD, mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    released, left_open = start("release"), start("open")
    try:
        assert left_open.stdout.readline() == "built\n"
        built = time.monotonic()
        out, err = released.communicate(timeout=120)
        assert out.splitlines() == ["built", "closed True"], err
        assert "did not release this task's session within 1 s" in err
        with pytest.raises(subprocess.TimeoutExpired):  # still in pyspark's exit hook
            left_open.wait(timeout=max(0.0, built + 10 - time.monotonic()))
    finally:
        for child in (released, left_open):
            child.kill()
            child.communicate()


def test_connect_url_must_be_a_spark_connect_url():
    with pytest.raises(ValueError, match=r"`connect_url` must be a Spark Connect URL"):
        HorovodSpark(num_proc=2, connect_url="http://spark:15002")


LOCAL_UI_SCRIPT = """
import json, os, socket, sys, urllib.parse
from pyspark.sql import SparkSession
from flyte_hvd.flyte import HorovodSpark
from flyte_hvd.stage.flyte_task import start_local_session

with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
    probe.connect(("192.0.2.123", 9))  # UDP: picks the host's outward address, sends nothing
    outward = probe.getsockname()[0]
start_local_session("ui-on-loopback", HorovodSpark(num_proc=1))
spark = SparkSession.getActiveSession()
port = urllib.parse.urlparse(spark.sparkContext.uiWebUrl).port
answers = {}
for host in ("127.0.0.1", outward):
    try:
        socket.create_connection((host, port), timeout=5).close()
        answers[host] = "open"
    except OSError as error:
        answers[host] = type(error).__name__
print("RESULT " + json.dumps({"outward": outward, "answers": answers}), flush=True)
os._exit(0)  # the JVM goes with its gateway's process; no need to wait for a clean stop
"""


@pytest.mark.spark
def test_a_local_session_keeps_sparks_ui_on_loopback(tmp_path):
    """Spark's UI and its REST API (every job, its tags and description) listen on
    ``SPARK_LOCAL_IP``, else on every interface."""
    import json

    env = {k: v for k, v in os.environ.items() if k != "SPARK_LOCAL_IP"}
    done = subprocess.run(
        [sys.executable, "-c", LOCAL_UI_SCRIPT],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=180,
    )  # fmt: skip
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    found = json.loads(lines[0][len("RESULT ") :])
    if found["outward"].startswith("127."):
        pytest.skip("this host has no address beyond loopback")
    assert found["answers"] == {"127.0.0.1": "open", found["outward"]: "ConnectionRefusedError"}


@task(task_config=HorovodSpark(num_proc=2, mlflow=True))
def tracked(x: int) -> str:
    import mlflow

    import flyte_hvd.core as hvd
    from flyte_hvd.launch import progress

    if hvd.rank() == 0:  # as MetricAverageCallback does on rank 0 after each epoch
        for epoch in (1, 2):
            progress.record_epoch(epoch, 2, {"loss": x / epoch}, 0.25)
        mlflow.log_param("logged_by", "the body")
    return os.environ.get("MLFLOW_RUN_ID", "")


@pytest.mark.mpi
@pytest.mark.spark
def test_a_task_is_an_mlflow_run_and_shows_its_epochs_in_a_deck(
    spark_local2, tmp_path, monkeypatch, capfd, no_leftover_ranks
):
    mlflow = pytest.importorskip("mlflow")
    from flytekit import FlyteContextManager
    from flytekit.core.data_persistence import FileAccessProvider

    uri = f"file://{tmp_path}/mlruns"
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's file store opt-in
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "tasks")
    access = FileAccessProvider(
        local_sandbox_dir=str(tmp_path / "flyte"), raw_output_prefix=str(tmp_path / "raw")
    )
    with FlyteContextManager.with_context(
        FlyteContextManager.current_context().with_file_access(access)
    ):
        run_id = tracked(x=3)

    assert run_id  # rank 0's body ran inside the run, and returned its id
    client = mlflow.MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "tasks"
    assert run.data.params["x"] == "3" and run.data.params["num_proc"] == "2"
    assert run.data.params["logged_by"] == "the body"
    losses = {m.step: m.value for m in client.get_metric_history(run_id, "loss")}
    assert losses == {0: 3.0, 1: 1.5}

    out = capfd.readouterr()
    lines = [line for line in (out.out + out.err).splitlines() if "flyte-hvd: epoch " in line]
    assert [line.split("flyte-hvd: ")[1] for line in lines] == [
        "epoch 1/2 · loss 3 · 0.2 s/epoch · ~0 s left",
        "epoch 2/2 · loss 1.5 · 0.2 s/epoch",
    ]

    decks = list((tmp_path / "flyte").rglob("deck.html"))
    assert len(decks) == 1, decks
    page = decks[0].read_text(encoding="utf-8")
    assert run_id in page and "<td>2</td>" in page  # the run's facts: its id, 2 ranks
    rows = re.findall(r"<tr><td>(\d)</td><td>([^<]*)</td><td>([^<]*)</td></tr>", page)
    assert rows == [("1", "3", "0.2"), ("2", "1.5", "0.2")]
