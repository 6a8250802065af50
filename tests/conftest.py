"""Shared fixtures. Heavy ones (rank processes, Spark) are session-scoped and named after
what they start."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Spark's Python workers must be this interpreter (the venv with flyte_hvd, mpi4py, mpich).
os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
# Every process this test session starts inherits this mark, so the leftover checks below
# count only this session's processes, not those of other runs on the same machine.
SESSION_MARK = f"TEST_SESSION_MARK={uuid.uuid4().hex}".encode()
os.environ.update([SESSION_MARK.decode().split("=", 1)])


def _ours(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return SESSION_MARK in f.read().split(b"\0")
    except OSError:
        return False


def rank_processes() -> list[str]:
    """Command lines of rank processes (and their mpiexec) this test session started."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [
        line
        for line in out.splitlines()
        if ("flyte_hvd.core.bootstrap" in line or "hydra_pmi_proxy" in line or "mpiexec" in line)
        and _ours(line.split()[0])
    ]


@pytest.fixture
def no_leftover_ranks():
    """Fails the test if it leaves a rank process or mpiexec behind."""
    before = set(rank_processes())
    yield
    import time

    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        left = set(rank_processes()) - before
        if not left:
            return
        time.sleep(0.1)
    pytest.fail(f"rank processes outlived the run: {sorted(left)}")


@pytest.fixture
def cli():
    """Runs ``flyte-hvd-run`` as a user would, from the repo root."""

    def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        exe = os.path.join(os.path.dirname(sys.executable), "flyte-hvd-run")
        return subprocess.run(
            [exe, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO
        )

    return run


# -- Spark -----------------------------------------------------------------------------------
# One SparkContext per process: the fixtures below switch between a local[2] session (most
# tests) and a local-cluster one (separate executor processes); tests that need the cluster
# run last, so each kind starts at most once.

_spark: dict = {"kind": None, "session": None}


def _spark_session(kind: str, configure):
    if _spark["kind"] != kind:
        if _spark["session"] is not None:
            _spark["session"].stop()
        from pyspark.sql import SparkSession

        builder = (
            SparkSession.builder.appName(f"flyte-hvd-tests-{kind}")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.shuffle.partitions", "4")
        )
        _spark["session"] = configure(builder).getOrCreate()
        _spark["session"].sparkContext.setLogLevel("ERROR")
        _spark["kind"] = kind
    return _spark["session"]


@pytest.fixture
def spark_local2():
    """A SparkSession on local[2] (two task slots in the driver JVM)."""
    return _spark_session("local2", lambda b: b.master("local[2]"))


FAKE_GPU_SCRIPT = r"""#!/usr/bin/env bash
# Hands out one fake GPU address per caller (0, 1, ...), like a host with several GPUs.
exec 9>"$(dirname "$0")/gpus.lock"
flock 9
n=$(cat "$(dirname "$0")/gpus.next" 2>/dev/null || echo 0)
echo $((n + 1)) > "$(dirname "$0")/gpus.next"
printf '{"name": "gpu", "addresses": ["%s"]}\n' "$n"
"""


@pytest.fixture
def spark_cluster(tmp_path_factory):
    """local-cluster[2,1,1024]: two executor processes with one core and one fake GPU each;
    a failed task may be retried once."""

    def configure(builder):
        folder = tmp_path_factory.mktemp("gpus")
        script = folder / "discover_gpus.sh"
        script.write_text(FAKE_GPU_SCRIPT)
        script.chmod(0o755)
        return (
            builder.master("local-cluster[2,1,1024]")
            .config("spark.task.maxFailures", "2")
            .config("spark.worker.resource.gpu.amount", "1")
            .config("spark.worker.resource.gpu.discoveryScript", str(script))
            .config("spark.executor.resource.gpu.amount", "1")
            .config("spark.task.resource.gpu.amount", "1")
            .config("spark.executorEnv.PYSPARK_PYTHON", sys.executable)
        )

    return _spark_session("cluster", configure)


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: "spark_cluster" in getattr(item, "fixturenames", ()))


def pytest_sessionfinish(session, exitstatus):
    if _spark["session"] is not None:
        _spark["session"].stop()


# -- S3 (moto server) ------------------------------------------------------------------------
# A real S3 HTTP endpoint on 127.0.0.1 (moto's server mode, in a thread of this process) with
# authentication on: the fixture's access key works, any other key or secret is refused, as on
# AWS. Tests talk to it through s3fs/boto3 with `endpoint_url`; nothing is mocked.

S3_BUCKET = "flyte-hvd-test"


class S3Server:
    """Where the test S3 endpoint is and how to sign in to it."""

    def __init__(self, endpoint_url: str, key: str, secret: str, bucket: str):
        self.endpoint_url = endpoint_url
        self.key = key
        self.secret = secret
        self.bucket = bucket

    def storage_options(self, **overrides) -> dict:
        """fsspec/s3fs options for this endpoint (override `key`/`secret` to test failures)."""
        options = {
            "key": self.key,
            "secret": self.secret,
            "endpoint_url": self.endpoint_url,
            "client_kwargs": {"region_name": "us-east-1"},
        }
        options.update(overrides)
        return options

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.key,
            aws_secret_access_key=self.secret,
            region_name="us-east-1",
        )


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on 127.0.0.1 (a free port) with one bucket and one IAM user."""
    import logging

    import boto3
    import requests
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    iam = boto3.client(
        "iam",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="bootstrap",
        aws_secret_access_key="bootstrap",
    )
    iam.create_user(UserName="flyte-hvd-tests")
    iam.put_user_policy(
        UserName="flyte-hvd-tests",
        PolicyName="all",
        PolicyDocument='{"Version": "2012-10-17", "Statement": '
        '[{"Effect": "Allow", "Action": "*", "Resource": "*"}]}',
    )
    access = iam.create_access_key(UserName="flyte-hvd-tests")["AccessKey"]
    # From here on every request must be signed with a known key and the right secret.
    requests.post(f"{endpoint}/moto-api/reset-auth", data=b"0", timeout=10).raise_for_status()
    info = S3Server(endpoint, access["AccessKeyId"], access["SecretAccessKey"], S3_BUCKET)
    info.client().create_bucket(Bucket=S3_BUCKET)
    try:
        yield info
    finally:
        requests.post(f"{endpoint}/moto-api/reset-auth", data=b"inf", timeout=10)
        server.stop()
