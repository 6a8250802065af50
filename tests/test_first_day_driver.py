"""What a new user meets on the driver on the first day: `pyflyte run` of a workflow from
another folder, with a helper module beside it; the socket files a local run's Spark session
leaves; Ctrl-C during `prepare_data` and a refit at once; `gs://` without a network; a store
that accepts connections and never answers, met by the run's lease."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from flyte_hvd.data.store import S3Store, Store, StoreTimeoutError, StoreUnreachableError

# -- `pyflyte run /path/to/wf.py` from another folder ------------------------------------------

WORKFLOW = """
from flytekit import task, workflow

from flyte_hvd.flyte import HorovodSpark

import helper  # beside this file, which pyflyte loads from another folder


@task(task_config=HorovodSpark(num_proc=2))
def doubled(x: int) -> int:
    import flyte_hvd.core as hvd

    return helper.double(x) * 10 + hvd.size()


@workflow
def wf(x: int = 3) -> int:
    return doubled(x=x)
"""


class PyflyteRun:
    """One `pyflyte run` of WORKFLOW, started in a folder other than the workflow's, with the
    JVM's temporary folder (where Spark's Python worker daemons put their sockets) its own."""

    def __init__(self, root: Path):
        self.workflow = root / "project" / "beside_wf.py"
        self.workflow.parent.mkdir()
        self.workflow.write_text(textwrap.dedent(WORKFLOW))
        (self.workflow.parent / "helper.py").write_text("def double(x):\n    return 2 * x\n")
        self.cwd = root / "elsewhere"
        self.cwd.mkdir()
        self.jvm_tmp = root / "jvm-tmp"
        self.jvm_tmp.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYSPARK_")}
        options = env.get("JAVA_TOOL_OPTIONS", "")
        env["JAVA_TOOL_OPTIONS"] = f"{options} -Djava.io.tmpdir={self.jvm_tmp}".strip()
        pyflyte = os.path.join(os.path.dirname(sys.executable), "pyflyte")
        self.done = subprocess.run(
            [pyflyte, "run", str(self.workflow), "wf", "--x", "4"],
            capture_output=True, text=True, timeout=300, cwd=self.cwd, env=env,
        )  # fmt: skip

    def output(self) -> str:
        return self.done.stdout[-3000:] + self.done.stderr[-3000:]


@pytest.fixture(scope="module")
def pyflyte_from_elsewhere(tmp_path_factory):
    return PyflyteRun(tmp_path_factory.mktemp("pyflyte-elsewhere"))


@pytest.mark.flyte
@pytest.mark.spark
@pytest.mark.mpi
@pytest.mark.e2e
def test_pyflyte_run_from_another_folder_lets_the_ranks_import_modules_beside_the_workflow(
    pyflyte_from_elsewhere,
):
    run = pyflyte_from_elsewhere
    assert run.done.returncode == 0, run.output()
    assert "ModuleNotFoundError" not in run.output()
    assert run.done.stdout.strip().splitlines()[-1] == "82"  # 2 * 4 * 10 + 2 ranks


@pytest.mark.flyte
@pytest.mark.spark
@pytest.mark.mpi
@pytest.mark.e2e
def test_a_local_pyflyte_run_leaves_no_socket_file(pyflyte_from_elsewhere):
    run = pyflyte_from_elsewhere
    assert run.done.returncode == 0, run.output()
    left = sorted(p.name for p in run.jvm_tmp.iterdir() if p.is_socket())
    assert left == [], left


# -- Ctrl-C during prepare_data, and a refit at once -------------------------------------------


class CtrlC:
    """SIGINT to this process, as a terminal or a notebook sends it, raising KeyboardInterrupt
    only while armed: a late one never reaches the test runner."""

    def __init__(self):
        self.armed = False
        self.before = signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame):
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt

    def press_when(self, ready) -> threading.Thread:
        def wait_and_press():
            deadline = time.monotonic() + 30
            while self.armed and not ready() and time.monotonic() < deadline:
                time.sleep(0.002)
            if self.armed:
                os.kill(os.getpid(), signal.SIGINT)

        self.armed = True
        thread = threading.Thread(target=wait_and_press, daemon=True)
        thread.start()
        return thread

    def restore(self):
        self.armed = False
        signal.signal(signal.SIGINT, self.before)


@pytest.mark.spark
def test_prepare_data_interrupted_leaves_no_job_and_no_files_and_a_refit_works(
    spark_local2, tmp_path
):
    from pyspark.sql import functions as F

    from flyte_hvd.data import get_dataset_metadata, prepare_data

    store = Store.create(str(tmp_path / "store"))
    df = spark_local2.range(4000).select(
        (F.col("id") / 7).alias("x"), (F.col("id") % 2).cast("double").alias("y")
    )
    data = Path(store.get_train_data_path())

    def writing():  # Spark's task folders of the write are there
        return any(data.parent.glob(f"{data.name}.*/_temporary/0/_temporary/*"))

    def after(seconds):
        started = time.monotonic()
        return lambda: time.monotonic() - started > seconds

    ctrl_c = CtrlC()
    interrupted = 0
    try:
        # While Spark writes (three times), and at two moments before or between its jobs.
        for moment in ("writing", "writing", "writing", 0.05, 0.4):
            presser = ctrl_c.press_when(writing if moment == "writing" else after(moment))
            try:
                with prepare_data(2, store, df, ["y"], partitions_per_process=2):
                    pass
            except KeyboardInterrupt:
                interrupted += 1
                # Nothing of the interrupted write goes on, and nothing half-written is left.
                tracker = spark_local2.sparkContext.statusTracker()
                assert tracker.getActiveJobsIds() == []
                assert list(data.parent.glob(f"{data.name}.*")) == []
            finally:
                ctrl_c.armed = False
                presser.join()
            with prepare_data(2, store, df, ["y"], partitions_per_process=2) as idx:  # at once
                train, _ = get_dataset_metadata(store, idx)
            assert train.rows == 4000
            store.delete(store.get_train_data_path(idx))
    finally:
        ctrl_c.restore()
    assert interrupted >= 3  # the write itself was interrupted each time


# -- gs:// without a network, a store that never answers ----------------------------------------


@pytest.fixture
def silent_endpoint():
    """An HTTP endpoint that accepts connections (the listen backlog) and never answers."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        yield f"http://127.0.0.1:{silent.getsockname()[1]}"


def test_gs_without_a_network_fails_at_once_saying_what_cannot_be_reached(monkeypatch):
    pytest.importorskip("gcsfs")
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.delenv("FLYTE_HVD_STORE_TIMEOUT_S", raising=False)  # the default, 50 s
    # A name that never resolves (RFC 2606), as storage.googleapis.com without a network.
    started = time.monotonic()
    with pytest.raises(StoreUnreachableError) as caught:
        Store.create("gs://bucket/exp", storage_options={"endpoint_url": "https://gcs.invalid"})
    assert time.monotonic() - started < 5
    message = str(caught.value)
    assert message.startswith("cannot reach the store at `gs://bucket/exp` while writing ")
    assert "Check that the store is up and reachable from every executor (endpoint " in message
    assert "https://gcs.invalid; it is `endpoint_url` in `storage_options`, or " in message
    assert "STORAGE_EMULATOR_HOST where the ranks run)" in message


def test_gs_against_an_endpoint_that_never_answers_ends_within_the_timeout(
    monkeypatch, silent_endpoint
):
    pytest.importorskip("gcsfs")
    monkeypatch.setenv("FLYTE_HVD_STORE_TIMEOUT_S", "1")
    started = time.monotonic()
    with pytest.raises(StoreTimeoutError, match=r"to gs://bucket/exp did not finish within 1s: "
                       r"the store does not answer \(endpoint http://127"):  # fmt: skip
        Store.create("gs://bucket/exp", storage_options={"endpoint_url": silent_endpoint})
    assert time.monotonic() - started < 5


def test_the_run_lease_against_a_store_that_never_answers_ends_within_the_timeout(
    silent_endpoint,
):
    pytest.importorskip("s3fs")
    from flyte_hvd.estimators import runs

    options = {"endpoint_url": silent_endpoint, "key": "user", "secret": "password"}
    store = S3Store("s3://bucket/exp", storage_options=options, timeout=1)  # no write check
    setting = "raise the Store's `timeout` or FLYTE_HVD_STORE_TIMEOUT_S (now 1s"
    cases = [
        (lambda: runs.leased_run(store, None, "keras").__enter__(), "looking for runs/keras_"),
        (lambda: runs.RunLease(store, "r1").acquire(), "writing runs/r1/lease.json to"),
        (lambda: runs.run_ids(store), "looking for runs in"),
        (lambda: runs._file_problem(store.to_remote("r1"), store.get_checkpoint_path("r1", ".pt")),
         "looking for runs/r1/checkpoint.pt in"),
    ]  # fmt: skip
    for call, doing in cases:
        started = time.monotonic()
        with pytest.raises(StoreTimeoutError) as caught:
            call()
        assert time.monotonic() - started < 4
        message = str(caught.value)
        assert message.startswith(doing), message
        assert "s3://bucket/exp did not finish within 1s: the store does not answer" in message
        assert setting in message
