"""Flyte retries: what a failure is (``flyte_hvd.launch.failures``), the run a task's fits
train in every attempt (``flyte_hvd.launch.task_identity``, ``estimators.runs``), the stall
bound in a task, and MLflow's defaults. The end-to-end cases run tasks of
``tests/retry_tasks.py`` through flytekit's container entrypoint, ``pyflyte-execute``, with the
variables, inputs and output prefixes Flyte gives a pod: one shared run per case."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flyte_hvd.core.errors import RanksFailedError
from flyte_hvd.data.lease import stale
from flyte_hvd.estimators import tracking
from flyte_hvd.launch import failures, stall
from flyte_hvd.launch.failures import FailureKind, classify, classify_text

REPO = Path(__file__).resolve().parent.parent
PYFLYTE_EXECUTE = Path(sys.executable).parent / "pyflyte-execute"

VALUE_ERROR = """Traceback (most recent call last):
  File "train.py", line 3, in main
    raise ValueError("the input has no column `price`")
ValueError: the input has no column `price`"""
TF_WRAPPED_PEER = (
    "tensorflow.python.framework.errors_impl.UnknownError: {{function_node __wrapped}} "
    "PeerExitedError: rank 1 (pid 42) exited while rank 0 waited for it in `allreduce`"
)
STALL = (
    "ranks [0] waited 5s in `allreduce` for rank 1, at retry_tasks.py:29 in collective. The "
    "run was stopped after 5s (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS)."
)


# -- what a failure is --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("rank 1 died: Killed (signal 9)", FailureKind.SYSTEM),
        ("rank 1 died: Terminated (signal 15)", FailureKind.SYSTEM),
        (VALUE_ERROR, FailureKind.USER),
        (
            "StoreTimeoutError: uploading runs/x/checkpoint.keras did not finish within 50s",
            FailureKind.SYSTEM,
        ),
        ("StoreUnreachableError: cannot reach the store at http://127.0.0.1:9", FailureKind.SYSTEM),
        (STALL, FailureKind.SYSTEM),
        (TF_WRAPPED_PEER, FailureKind.SYSTEM),
        ("RuntimeError: Connection closed by peer [127.0.0.1]:4242", FailureKind.SYSTEM),
        ("mpi4py.MPI.Exception: MPI_ERR_OTHER: known error not in list", FailureKind.SYSTEM),
        ("Traceback (most recent call last):\nMemoryError", FailureKind.OOM),
        ("KeyError: 'label'", FailureKind.USER),
        ("NonFiniteLossError: the loss is NaN at epoch 3", FailureKind.USER),
        (
            "rank 1 ended (returned normally) while ranks [0] wait for it in `allreduce`",
            FailureKind.USER,
        ),
    ],
)
def test_a_rank_failure_is_classified_by_its_cause(text, kind):
    assert classify_text(text) is kind


def test_a_run_is_what_its_cause_is_not_what_its_peers_then_raised():
    killed = RanksFailedError({1: "rank 1 died: Killed (signal 9)", 0: VALUE_ERROR})
    assert classify(killed) is FailureKind.SYSTEM  # the death is the cause
    raised = RanksFailedError({0: VALUE_ERROR, 1: TF_WRAPPED_PEER})
    assert classify(raised) is FailureKind.USER
    lost = RuntimeError(
        "the Spark barrier stage of 2 ranks failed before any rank reported an error (an "
        "executor was lost, or the stage was cancelled): ExecutorLostFailure"
    )
    assert classify(lost) is FailureKind.SYSTEM
    broken = RuntimeError(lost.args[0].replace("ExecutorLostFailure", "collectAndServe."))
    broken.__cause__ = RuntimeError(
        "Job aborted: org.apache.spark.api.python.PythonException: An exception was thrown "
        "from the Python worker: ModuleNotFoundError: No module named 'flyte_hvd'"
    )
    assert classify(broken) is FailureKind.USER  # the workers' environment: every attempt
    assert classify(ValueError("`epochs` must be a positive int")) is FailureKind.USER
    assert classify(ConnectionResetError("reset")) is FailureKind.SYSTEM
    wrapped = RuntimeError("fit failed")
    wrapped.__cause__ = TimeoutError("the store does not answer")
    assert classify(wrapped) is FailureKind.SYSTEM


def test_flytekit_gets_a_recoverable_exception_with_the_same_message():
    from flytekit.exceptions.user import FlyteRecoverableException

    error = RanksFailedError({1: "rank 1 died: Killed (signal 9)"})
    converted = failures.for_flytekit(error)
    assert isinstance(converted, FlyteRecoverableException)
    assert "rank 1 died: Killed (signal 9)" in str(converted)
    user = RanksFailedError({0: VALUE_ERROR})
    assert failures.for_flytekit(user) is user  # flytekit's default: non-recoverable


def test_flyte2_gets_the_kind_its_runtime_retries():
    import flyte.errors
    from flyte._internal.runtime.convert import convert_from_native_to_error

    user = failures.for_flyte2(RanksFailedError({0: VALUE_ERROR}))
    assert isinstance(user, flyte.errors.NonRecoverableError)
    assert convert_from_native_to_error(user).recoverable is False
    oom = failures.for_flyte2(RanksFailedError({1: "Traceback:\nMemoryError"}))
    assert isinstance(oom, flyte.errors.OOMError) and "MemoryError" in str(oom)
    system = failures.for_flyte2(RanksFailedError({1: "rank 1 died: Killed (signal 9)"}))
    assert isinstance(system, flyte.errors.RuntimeSystemError)
    assert "rank 1 died" in str(system)
    assert convert_from_native_to_error(system).recoverable is True
    assert convert_from_native_to_error(oom).recoverable is True


@pytest.mark.parametrize(
    ("failure", "kind", "code"),
    [
        ({0: VALUE_ERROR}, "NON_RECOVERABLE", "RanksFailedError"),
        ({1: "rank 1 died: Killed (signal 9)"}, "RECOVERABLE", "RanksFailedError"),
        ({1: "Traceback:\nMemoryError"}, "RECOVERABLE", "OOMError"),
    ],
)
def test_flyte2s_error_document_has_the_kind(tmp_path, failure, kind, code):
    """The error document Flyte 2's runtime entrypoint (``a0``) writes for what a task
    raised: its own conversion and writer, as on a pod."""
    import asyncio

    from flyte._internal.runtime.convert import convert_from_native_to_error
    from flyte._internal.runtime.io import upload_error
    from flyteidl2.core import execution_pb2

    error = convert_from_native_to_error(failures.for_flyte2(RanksFailedError(failure)))
    asyncio.run(upload_error(error.err, str(tmp_path), recoverable=error.recoverable))
    document = execution_pb2.ErrorDocument.FromString((tmp_path / "error.pb").read_bytes())
    assert execution_pb2.ContainerError.Kind.Name(document.error.kind) == kind
    assert code in document.error.code and next(iter(failure.values()))[-10:] in str(
        document.error.message
    )


def test_a_user_error_gets_no_second_spark_attempt_and_a_death_gets_one():
    from flyte_hvd.stage.pipeline import on_rank_failure

    cancels: list[float] = []
    handle = on_rank_failure(max_attempts=4, cancel=lambda: cancels.append(1.0), grace=0)
    assert handle(1, 1, "rank 1 died: Killed (signal 9)") is False  # Spark retries
    assert handle(2, 0, VALUE_ERROR) is True  # final at once: every attempt would raise it
    assert cancels == [1.0]


def test_outside_flyte_nothing_is_converted():
    from flyte_hvd.launch import task_identity

    assert task_identity.current() is None and task_identity.next_fit_key() is None
    with pytest.raises(RanksFailedError), failures.as_flyte_errors():
        raise RanksFailedError({1: "rank 1 died: Killed (signal 9)"})


# -- the stall bound in a task ------------------------------------------------------------------


def test_the_stall_shutdown_defaults_to_a_bound_in_a_flyte_task_only():
    check = {stall.CHECK_TIME_ENV: "2"}
    assert stall.StallConfig.from_env(check).shutdown_s == 0  # outside a task: never
    assert stall.StallConfig.from_env(check, in_task=True).shutdown_s == 10
    assert stall.StallConfig.from_env({}, in_task=True).shutdown_s == 300
    never = {**check, stall.SHUTDOWN_TIME_ENV: "0"}
    assert stall.StallConfig.from_env(never, in_task=True).shutdown_s == 0
    own = {**check, stall.SHUTDOWN_TIME_ENV: "7"}
    assert stall.StallConfig.from_env(own, in_task=True).shutdown_s == 7


# -- the lease of an earlier attempt --------------------------------------------------------------


def _lease(attempt, execution="p/d/exec1", node="/o/exec1/n0/data", pid=None, space="elsewhere"):
    return {
        "owner": "host:1", "pid": pid or 1, "pid_space": space, "expires": time.time() + 60,
        "flyte": {"execution": execution, "node": node, "attempt": attempt},
    }  # fmt: skip


def test_the_next_attempt_takes_over_the_lease_of_the_one_before_at_once():
    me = {"execution": "p/d/exec1", "node": "/o/exec1/n0/data", "attempt": 1}
    why = stale(_lease(0), me)
    assert why is not None and "attempt 0 of this Flyte task" in why
    assert stale(_lease(1), me) is None  # the same attempt: not an earlier one
    assert stale(_lease(0, execution="p/d/exec2"), me) is None  # another execution
    assert stale(_lease(0, node="/o/exec1/n1/data"), me) is None  # another node
    assert stale(_lease(0), None) is None  # outside Flyte: the lease protects its fit


def test_a_live_holder_keeps_its_lease_even_against_a_later_attempt():
    from flyte_hvd.data.lease import pid_space

    me = {"execution": "p/d/exec1", "node": "/o/exec1/n0/data", "attempt": 1}
    assert stale(_lease(0, pid=os.getpid(), space=pid_space()), me) is None


# -- MLflow: defaults that work, and every error path ---------------------------------------------


@pytest.fixture
def empty_cwd(tmp_path, monkeypatch):
    for name in [k for k in os.environ if k.startswith("MLFLOW_")]:
        monkeypatch.delenv(name)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # restored (unset) after
    folder = tmp_path / "cwd"
    folder.mkdir()
    monkeypatch.chdir(folder)
    return folder


def _has_sqlalchemy() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(name) for name in ("sqlalchemy", "alembic"))


def test_mlflow_defaults_from_an_empty_directory_open_a_run(empty_cwd, caplog):
    import mlflow

    if _has_sqlalchemy():  # MLflow's own default, as an absolute path
        assert tracking.default_tracking_uri(mlflow) == f"sqlite:///{empty_cwd}/mlflow.db"
        return
    # A URI the user set is theirs, whatever it is.
    os.environ["MLFLOW_TRACKING_URI"] = "sqlite:///own.db"
    try:
        assert tracking.default_tracking_uri(mlflow) == "sqlite:///own.db"
    finally:
        del os.environ["MLFLOW_TRACKING_URI"]
    caplog.set_level(logging.WARNING, logger="flyte_hvd")
    run = tracking.start_run(tracking.MlflowConfig(), "fit-1", {"epochs": 2})
    assert run.tracking_uri == (empty_cwd / "mlruns").as_uri()
    assert run.env["MLFLOW_TRACKING_URI"] == run.tracking_uri
    assert "needs SQLAlchemy" in caplog.text and "mlflow-skinny" in caplog.text
    found = mlflow.MlflowClient(tracking_uri=run.tracking_uri).get_run(run.run_id)
    assert found.data.params == {"epochs": "2"}
    # Once ./mlruns holds runs, MLflow's own default is that folder: a second fit (a retry)
    # opens it too, without the SQL store's notice.
    del os.environ["MLFLOW_ALLOW_FILE_STORE"]
    caplog.clear()
    again = tracking.start_run(tracking.MlflowConfig(), "fit-2", {})
    assert again.tracking_uri == run.tracking_uri and "needs SQLAlchemy" not in caplog.text


@pytest.mark.skipif(_has_sqlalchemy(), reason="SQLAlchemy is installed here")
def test_a_sqlite_store_without_sqlalchemy_says_what_to_install(empty_cwd):
    config = tracking.MlflowConfig(tracking_uri="sqlite:///own.db")
    with pytest.raises(RuntimeError, match=r"sqlite:///own.db.*sqlalchemy.*pip install mlflow"):
        tracking.start_run(config, "fit-1", {})


def test_a_refused_run_names_the_experiment_id_not_an_unbound_variable(empty_cwd, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", "424242")
    config = tracking.MlflowConfig(tracking_uri=(empty_cwd / "mlruns").as_uri())
    with pytest.raises(RuntimeError, match="did not open a run in experiment id '424242'"):
        tracking.start_run(config, "fit-1", {})


def test_a_closed_tracking_port_fails_at_once():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="is not reachable"):
        tracking.start_run(tracking.MlflowConfig(tracking_uri=f"http://127.0.0.1:{port}"), "x", {})
    assert time.monotonic() - started < tracking.CONNECT_TIMEOUT


def test_ending_a_run_on_a_store_that_fails_only_warns(empty_cwd, caplog):
    caplog.set_level(logging.WARNING, logger="flyte_hvd")
    gone = tracking.MlflowRun("sqlite:///gone.db", "0123", "0", None, {})
    tracking.end_run(gone, failed=True)
    assert "could not mark MLflow run 0123 FAILED" in caplog.text
    tracking.end_run(None, failed=True)  # no run: nothing to do
    tracking.leave_rank(None, failed=True)


def test_a_retried_fit_finds_the_mlflow_run_of_the_attempt_before(empty_cwd, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = mlflow.MlflowClient(tracking_uri=(empty_cwd / "mlruns").as_uri())
    assert tracking._earlier_attempts_run(client, "0", "p/d/e/1a2b3c4d/fit") is None
    first = client.create_run("0", tags={tracking.TASK_RUN_TAG: "p/d/e/1a2b3c4d/fit"})
    client.set_terminated(first.info.run_id, "FAILED")
    again = tracking._earlier_attempts_run(client, "0", "p/d/e/1a2b3c4d/fit")
    assert again == first.info.run_id
    assert client.get_run(again).info.status == "RUNNING"
    assert tracking._earlier_attempts_run(client, "0", None) is None  # outside Flyte


# -- through pyflyte-execute ----------------------------------------------------------------------


def _inputs(path: Path, **values: object) -> Path:
    from flytekit.models.literals import Literal, LiteralMap, Primitive, Scalar

    def literal(value: object) -> Literal:
        if isinstance(value, int):
            return Literal(scalar=Scalar(primitive=Primitive(integer=value)))
        return Literal(scalar=Scalar(primitive=Primitive(string_value=str(value))))

    literals = LiteralMap({k: literal(v) for k, v in values.items()})
    path.write_bytes(literals.to_flyte_idl().SerializeToString())
    return path


class Attempt:
    """One attempt of a node of a Flyte execution, as a pod runs it: ``pyflyte-execute`` with
    Flyte's variables and the node's output prefix ``<root>/<execution>/<node>/data/<attempt>``."""

    def __init__(self, root: Path, task: str, node: str, attempt: int, cwd: Path,
                 env: dict[str, str] | None = None, **inputs: object):  # fmt: skip
        self.output = root / "exec1" / node / "data" / str(attempt)
        self.output.mkdir(parents=True)
        cwd.mkdir(exist_ok=True)
        inputs_pb = _inputs(root / f"inputs-{node}-{attempt}.pb", **inputs)
        variables = {
            k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "HOROVOD_"))
        }
        variables.update(
            PYTHONPATH=str(REPO / "tests"),
            FLYTE_INTERNAL_EXECUTION_ID="exec1",
            FLYTE_INTERNAL_EXECUTION_PROJECT="flytesnacks",
            FLYTE_INTERNAL_EXECUTION_DOMAIN="development",
            FLYTE_INTERNAL_TASK_PROJECT="flytesnacks",
            FLYTE_INTERNAL_TASK_DOMAIN="development",
            FLYTE_INTERNAL_TASK_NAME=f"retry_tasks.{task}",
            FLYTE_INTERNAL_TASK_VERSION="1",
            FLYTE_ATTEMPT_NUMBER=str(attempt),
            PYSPARK_SUBMIT_ARGS="--master local[2] --conf spark.ui.enabled=false pyspark-shell",
            **(env or {}),
        )
        command = [
            str(PYFLYTE_EXECUTE), "--inputs", str(inputs_pb), "--output-prefix",
            str(self.output), "--raw-output-data-prefix", str(root / "raw"),
            "--resolver", "flytekit.core.python_auto_container.default_task_resolver", "--",
            "task-module", "retry_tasks", "task-name", task,
        ]  # fmt: skip
        self.log = open(root / f"output-{node}-{attempt}.log", "w+")  # noqa: SIM115
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            command, cwd=cwd, env=variables, stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, as a pod's processes are
        )  # fmt: skip
        self.seconds = 0.0
        self.ended = 0.0

    def wait(self, timeout: float = 300) -> Attempt:
        try:
            self.process.wait(timeout)
        finally:
            self.seconds = time.monotonic() - self.started
            self.ended = time.time()
            if self.process.poll() is None:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        return self

    def kill_group(self) -> None:
        """What a preempted pod gets: every process of the task killed at once."""
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.seconds = time.monotonic() - self.started
        self.ended = time.time()

    @property
    def text(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def error(self):
        from flyteidl.core import errors_pb2

        path = self.output / "error.pb"
        assert path.exists(), self.text[-6000:]
        return errors_pb2.ErrorDocument.FromString(path.read_bytes()).error

    def output_string(self) -> str:
        from flyteidl.core import literals_pb2

        path = self.output / "outputs.pb"
        assert path.exists(), self.text[-6000:]
        literals = literals_pb2.LiteralMap.FromString(path.read_bytes())
        return literals.literals["o0"].scalar.primitive.string_value


def _kind(error) -> str:
    from flyteidl.core import errors_pb2

    return errors_pb2.ContainerError.Kind.Name(error.kind)


# Seconds each end-to-end case took (printed at the end of the module, for the fault matrix).
TIMES: dict[str, float] = {}


@pytest.fixture(scope="module")
def collective_failures(tmp_path_factory):
    """The HorovodSpark task failing as user code (ValueError on every rank) and stuck (rank 1
    never joins rank 0's allreduce; the stall bound in a task, 5 check times of 1 s). Two
    nodes of one execution, run side by side as Flyte runs them: each mostly starts up or
    waits."""
    root = tmp_path_factory.mktemp("collective")

    def started(node: str) -> dict[str, str]:
        return {"RETRY_TEST_STARTED": str(root / f"started-{node}")}

    raising = Attempt(root, "collective", "n0", 0, root / "cwd-n0", started("n0"), mode="raise")
    stall_env = {stall.CHECK_TIME_ENV: "1", **started("n1")}
    stuck = Attempt(root, "collective", "n1", 0, root / "cwd-n1", stall_env, mode="stall")
    raised = raising.wait()
    stuck.wait()
    TIMES["ValueError on every rank: task"] = raised.seconds
    TIMES["ValueError on every rank: body to exit"] = raised.ended - _started(root, "n0")
    TIMES["stuck rank (check 1 s, bound 5 s): task"] = stuck.seconds
    TIMES["stuck rank: body to exit"] = stuck.ended - _started(root, "n1")
    return raised, stuck


def _started(root: Path, node: str) -> float:
    path = root / f"started-{node}"
    return float(path.read_text()) if path.exists() else float("nan")


@pytest.mark.spark
@pytest.mark.mpi
@pytest.mark.flyte
@pytest.mark.e2e
def test_a_user_error_is_non_recoverable_for_flyte(collective_failures):
    raised, _ = collective_failures
    error = raised.error()
    assert _kind(error) == "NON_RECOVERABLE", error.message[-3000:]
    assert "ValueError" in error.message and "the input has no column `price`" in error.message
    assert "Spark retries the stage" not in raised.text


@pytest.mark.spark
@pytest.mark.mpi
@pytest.mark.flyte
@pytest.mark.e2e
def test_a_stuck_rank_ends_by_the_default_bound_and_flyte_may_retry_it(collective_failures):
    _, stuck = collective_failures
    error = stuck.error()
    assert _kind(error) == "RECOVERABLE", error.message[-3000:]
    assert "The run was stopped after 5s (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS)" in error.message
    assert "rank 1" in error.message and "allreduce" in error.message
    assert stuck.seconds < 120  # not the rank's 600 s


def _epochs(log: Path) -> list[tuple[int, int]]:
    if not log.exists():
        return []
    return [tuple(map(int, line.split())) for line in log.read_text().split("\n") if line]


@pytest.fixture(scope="module")
def retried_fit(tmp_path_factory):
    """Node n0 of execution exec1 fits 4 epochs; attempt 0 is killed as a whole process group
    while epoch 3 starts (after epoch 2's checkpoint), attempt 1 runs to the end. Node n1 of
    the same execution fits with the same Store beside attempt 1."""
    root = tmp_path_factory.mktemp("fit")
    store, log = root / "store", root / "epochs-n0.log"
    inputs = {"epochs": 4, "work_dir": str(store), "log": str(log)}
    first = Attempt(root, "fit", "n0", 0, root / "cwd", **inputs)
    deadline = time.monotonic() + 300
    while (0, 2) not in _epochs(log) and first.process.poll() is None:
        assert time.monotonic() < deadline, first.text[-6000:]
        time.sleep(0.2)
    assert first.process.poll() is None, first.text[-6000:]
    first.kill_group()
    TIMES["attempt 0 to epoch 2's checkpoint"] = first.seconds
    time.sleep(1)  # its orphaned ranks stop once their supervisor is gone
    # Attempt 1 and node n1 side by side, as Flyte runs two nodes of one execution: n1 starts
    # with n0's run (epoch 2's checkpoint and state) in the Store, and must not resume it.
    second = Attempt(root, "fit", "n0", 1, root / "cwd", **inputs)
    other_log = root / "epochs-n1.log"
    other = Attempt(root, "fit", "n1", 0, root / "cwd-n1", epochs=1, work_dir=str(store),
                    log=str(other_log))  # fmt: skip
    second.wait()
    other.wait()
    TIMES["attempt 1 (resumes, 2 epochs)"] = second.seconds
    TIMES["another node (1 epoch), beside it"] = other.seconds
    return root, log, other_log, second, other


@pytest.mark.spark
@pytest.mark.mpi
@pytest.mark.flyte
@pytest.mark.e2e
def test_the_next_attempt_trains_only_the_remaining_epochs(retried_fit):
    root, log, _, second, _ = retried_fit
    assert _epochs(log) == [(0, 0), (0, 1), (0, 2), (1, 2), (1, 3)], second.text[-6000:]
    kind, run_id, epochs = second.output_string().split()
    assert kind == "KerasModel" and epochs == "4"
    assert run_id.startswith("keras_")
    state = json.loads((root / "store" / "runs" / run_id / "state.json").read_text())
    assert state["epoch"] == 4
    # Its lease, held by the killed attempt, was taken over at once (here its process is seen
    # gone; in a new pod, by the attempt number: test_the_next_attempt_takes_over_...).
    assert "taking over the lease" in second.text


@pytest.mark.spark
@pytest.mark.mpi
@pytest.mark.flyte
@pytest.mark.e2e
def test_another_node_of_the_execution_does_not_resume_it(retried_fit):
    _, _, other_log, second, other = retried_fit
    assert _epochs(other_log) == [(0, 0)], other.text[-6000:]
    assert other.output_string().split()[1] != second.output_string().split()[1]


@pytest.mark.spark
@pytest.mark.mpi
@pytest.mark.flyte
@pytest.mark.e2e
def test_mlflow_defaults_log_one_run_with_every_epoch_once_across_attempts(retried_fit):
    import mlflow

    root, _, _, second, _ = retried_fit
    uri = (root / "cwd" / "mlruns").as_uri()
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = mlflow.MlflowClient(tracking_uri=uri)
    runs = client.search_runs(["0"])
    assert len(runs) == 1, [r.info.run_name for r in runs]
    assert runs[0].info.run_name == second.output_string().split()[1]
    assert runs[0].info.status == "FINISHED"
    history = client.get_metric_history(runs[0].info.run_id, "loss")
    # Logging the model (MLflow 3) writes one record again, the same record: time and value.
    records = {(m.step, m.timestamp, m.value) for m in history}
    assert sorted(step for step, _, _ in records) == [0, 1, 2, 3]


def teardown_module(module):
    if TIMES:
        print("\nseconds per end-to-end case:", json.dumps(TIMES, indent=1))


# -- Flyte 2: the run of a task's fit in every attempt --------------------------------------------


@pytest.fixture
def flyte2_action():
    """The task context Flyte 2's runtime sets in a pod (``mode="remote"``) for an action."""
    import contextlib

    from flyte._context import internal_ctx
    from flyte.models import ActionID, RawDataPath, TaskContext
    from flyte.report import Report

    @contextlib.contextmanager
    def action(name: str, mode: str = "remote"):
        tctx = TaskContext(
            action=ActionID(name=name, run_name="run1", project="p", domain="d"),
            version="1", raw_data_path=RawDataPath(path="/tmp"), output_path="/tmp",
            run_base_dir="/tmp", report=Report(name="r"), mode=mode,
        )  # fmt: skip
        with internal_ctx().replace_task_context(tctx):
            yield

    return action


def test_a_flyte2_retry_resumes_its_run_and_takes_over_the_lease(
    flyte2_action, tmp_path, monkeypatch, caplog
):
    import flyte.errors

    from flyte_hvd.data.store import Store
    from flyte_hvd.estimators.runs import RunLease, leased_run
    from flyte_hvd.launch import task_identity

    caplog.set_level(logging.WARNING, logger="flyte_hvd")
    store = Store.create(str(tmp_path / "store"))
    monkeypatch.setenv("FLYTE_ATTEMPT_NUMBER", "0")
    with flyte2_action("a1"):
        identity = task_identity.current()
        assert identity is not None and identity.sdk == "flyte2"
        with leased_run(store, None, "keras") as first, leased_run(store, None, "keras") as second:
            assert first != second  # two fits of a task: two runs
            # The attempt dies here: its lease stays, as a dead pod's would.
            lease = RunLease(store, first)
            record = json.loads(lease._record())
            record.update(pid_space="another pod", token="dead")
            store.write_bytes(lease.path, json.dumps(record).encode())
        with pytest.raises(flyte.errors.RuntimeSystemError), failures.as_flyte_errors():
            raise RanksFailedError({1: "rank 1 died: Killed (signal 9)"})
    monkeypatch.setenv("FLYTE_ATTEMPT_NUMBER", "1")
    with flyte2_action("a1"), leased_run(store, None, "keras") as again:
        assert again == first  # attempt 1 resumes attempt 0's first fit's run
    assert "was attempt 0 of this Flyte task" in caplog.text
    with flyte2_action("a2"), leased_run(store, None, "keras") as other:
        assert other not in (first, second)  # another action: a run of its own
    with flyte2_action("a1", mode="local"):
        assert task_identity.current() is None  # a local run is not retried by Flyte


def test_a_flytekit_task_is_named_by_its_execution_and_its_node_never_its_attempt(
    monkeypatch, tmp_path
):
    """No variable names the node in a Flyte pod: the output prefix flytekit is given does,
    ``<metadata>/<execution>/<node>/data/<attempt>``."""
    import contextlib
    import datetime

    from flytekit import FlyteContextManager
    from flytekit.core.context_manager import ExecutionParameters, ExecutionState
    from flytekit.core.mock_stats import MockStats

    from flyte_hvd.launch import task_identity

    @contextlib.contextmanager
    def pod(prefix: str):
        params = ExecutionParameters(
            execution_date=datetime.datetime.now(datetime.UTC), tmp_dir=str(tmp_path),
            stats=MockStats(), logging=logging.getLogger("t"), raw_output_prefix=str(tmp_path),
            output_metadata_prefix=prefix, execution_id=None,
        )  # fmt: skip
        state = ExecutionState(working_dir=str(tmp_path), user_space_params=params,
                               mode=ExecutionState.Mode.TASK_EXECUTION)  # fmt: skip
        ctx = FlyteContextManager.current_context().with_execution_state(state)
        with FlyteContextManager.with_context(ctx):
            yield task_identity.current()

    base = "s3://bucket/metadata/propeller/flytesnacks-development-exec1"
    with pod(f"{base}/n3/data/0") as outside:
        assert outside is None  # no FLYTE_INTERNAL_EXECUTION_ID: not a Flyte pod
    monkeypatch.setenv("FLYTE_INTERNAL_EXECUTION_ID", "exec1")
    monkeypatch.setenv("FLYTE_INTERNAL_EXECUTION_PROJECT", "flytesnacks")
    monkeypatch.setenv("FLYTE_INTERNAL_EXECUTION_DOMAIN", "development")
    monkeypatch.delenv("FLYTE_ATTEMPT_NUMBER", raising=False)
    with pod(f"{base}/n3/data/0") as first, pod(f"{base}/n3/data/2/") as third:
        pass
    assert first is not None and third is not None
    assert (first.attempt, third.attempt) == (0, 2)  # from the prefix when no variable says
    assert first.execution == "flytesnacks/development/exec1" and first.sdk == "flytekit"
    assert first.node_key == third.node_key and first.fit_key(1) == third.fit_key(1)
    assert first.fit_key(1) != first.fit_key(2)
    with pod(f"{base}/n4/data/0") as other:
        assert other is not None and other.node_key != first.node_key
    monkeypatch.setenv("FLYTE_ATTEMPT_NUMBER", "1")
    with pod(f"{base}/n3/data/1") as named:
        assert named is not None and named.attempt == 1 and named.node_key == first.node_key


# -- a rank the kernel's OOM killer ended ----------------------------------------------------------


def test_the_oom_kill_count_is_read_from_the_process_memory_cgroup(tmp_path):
    own = tmp_path / "cgroup"
    own.write_text("12:memory:/kubepods/pod1/c1\n0::/kubepods/pod1/c1\n")
    v1 = tmp_path / "memory" / "c1"  # seen from inside the container: the host's path's tail
    v1.mkdir(parents=True)
    (v1 / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    assert failures.oom_kills(str(tmp_path), str(own)) == 3
    (v1 / "memory.oom_control").unlink()
    (tmp_path / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 2\noom_kill 2\n")
    assert failures.oom_kills(str(tmp_path), str(own)) == 2  # v2, at the container's root
    assert failures.oom_kills(str(tmp_path / "none"), str(tmp_path / "nothing")) is None
    died = f"rank 1 died: Killed (signal 9); {failures.OOM_KILLED_NOTE}"
    assert classify_text(died) is FailureKind.OOM
    assert classify(RanksFailedError({1: died, 0: TF_WRAPPED_PEER})) is FailureKind.OOM


def _memory_cgroup(limit: int) -> Path | None:
    """A new memory cgroup (v1) limited to ``limit`` bytes, or None where none can be made."""
    from needs import root

    base = Path("/sys/fs/cgroup/memory")
    if root() is not None or not (base / "memory.oom_control").exists():
        return None
    group = base / f"flyte-hvd-oom-{os.getpid()}"
    try:
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(limit))
    except OSError:
        return None
    return group


@pytest.mark.mpi
def test_a_rank_the_oom_killer_ended_is_named_so_and_flyte2_gets_an_oom_error():
    """``flyte-hvd-run`` in a memory cgroup of 600 MiB whose rank 1 asks for 2 GiB: the kernel
    kills it, and the run's error says it was the OOM killer."""
    from needs import require

    group = _memory_cgroup(600 << 20)
    require(None if group is not None else "root and a writable cgroup v1 memory controller")
    assert group is not None
    program = (
        "import flyte_hvd.core as hvd, numpy as np\n"
        "hvd.init()\n"
        "if hvd.rank() == 1:\n"
        "    block = np.ones(2 << 30, dtype=np.uint8)\n"
        "hvd.allreduce(np.ones(1))\n"
    )
    cli = Path(sys.executable).parent / "flyte-hvd-run"
    try:
        result = subprocess.run(
            ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh",
             str(cli), "-np", "2", sys.executable, "-c", program],
            capture_output=True, text=True, timeout=120, cwd=REPO,
        )  # fmt: skip
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        time.sleep(0.5)
        group.rmdir()
    assert result.returncode != 0
    assert "rank 1 died: Killed (signal 9); the kernel's OOM killer" in result.stderr, (
        result.stderr[-3000:]
    )
