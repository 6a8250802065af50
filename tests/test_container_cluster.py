"""The Rossmann workflow on a Spark standalone cluster of containers of the project's image.

Each role is a container of the image (built by ``scripts/build_image.sh`` when it is absent or
older than the files it is built from), started through the image's entrypoint, with its own
network namespace and address on an internal podman network that the test creates (no route
leaves it):

| container   | runs                                                                     |
|-------------|--------------------------------------------------------------------------|
| ``master``  | the Spark standalone Master                                              |
| ``worker-N``| a Spark Worker with 1 core: its executor and one rank                    |
| ``driver``  | ``pyflyte run`` of the workflow from the fast-registration bundle        |

The driver has no checkout: flytekit's ``fast_package`` (what ``pyflyte register`` uses) packs
the workflow's code into a bundle, which goes to S3 and is unpacked into the driver's working
directory by flytekit's ``download_distribution``, as ``pyflyte-fast-execute`` does. Ranks on
the two workers talk MPI over their own addresses (``MPIR_CVAR_CH4_NETMOD=ofi``,
``FI_PROVIDER=tcp`` on ``eth0``: the pod-to-pod choice).

Storage: moto's S3 server in a process of its own on this machine, listening on the network's
gateway address (the only address of this machine that the containers reach), holds the
bundle, the Store (``--work_dir s3://…``), the dataset, checkpoints and Flyte's raw outputs
(through s3fs and boto3). The image here has no S3A jars (Maven Central cannot be reached:
``S3A_JARS=false``), so Spark's JVM has no S3 client, and Spark's own Parquet of Flyte's
DataFrames goes, as in ``tests/cluster_harness.py``, to one directory mounted into the driver
and the workers, mapped by Hadoop's ``ViewFileSystemOverloadScheme`` (the one substitution).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest
from cluster_harness import OBJSTORE, RAW_BUCKET, driver_spark_defaults, start_moto
from needs import image_tools, require

pytestmark = [pytest.mark.container, pytest.mark.e2e]

REPO = Path(__file__).resolve().parent.parent
IMAGE = os.environ.get("FLYTE_HVD_TEST_IMAGE", "localhost/flyte-hvd:latest")
# A bucket of its own, as the simulated-host test's store is "flyte-hvd-store".
STORE_BUCKET = "flyte-hvd-container-store"
ACCESS_KEY, SECRET_KEY = "container-key", "container-secret"
SPARK_CONF_DIR = "/opt/flyte-hvd-conf"
WORKERS = 2
# podman here: runc (crun fails on this kernel) and the caller's ulimits (podman's defaults are
# set with setrlimit, which this kernel refuses).
PODMAN_CONF = str(REPO / "docker" / "containers.conf")
RUN_OPTIONS = ["--runtime", "runc", "--ulimit", "host"]
# MPICH's debug summary makes rank 0 print the libfabric providers and addresses it chose.
MPI_ENV = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": "eth0",
           "MPIR_CVAR_DEBUG_SUMMARY": "1"}  # fmt: skip
RANK_LINE = re.compile(
    r"rank (\d+) of (\d+) on host (\S+): local_rank (\d+) of (\d+), cross_rank (\d+) of (\d+)"
)
# What the ranks and their launchers run as; none may outlive a run in a container.
RANK_PROCESSES = ("flyte_hvd.launch", "mpiexec", "hydra_pmi_proxy")


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "CONTAINERS_CONF": PODMAN_CONF}
    result = subprocess.run(
        ["podman", *args], capture_output=True, text=True, timeout=timeout, env=env
    )
    if check and result.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args)}: {result.stderr.strip()}")
    return result


class ContainerCluster:
    """The network, the containers, moto and a host folder; ``stop`` removes all of them."""

    def __init__(self) -> None:
        self.tag = f"flyte-hvd-test-{os.getpid()}"
        self.root = Path(tempfile.mkdtemp(prefix="flyte-hvd-containers-", dir="/var/tmp"))
        self.addresses: dict[str, str] = {}
        self.moto = None

    # -- start ---------------------------------------------------------------------------------

    def start(self) -> None:
        podman("network", "create", "--internal", "--label", self.tag, self.tag)
        (network,) = json.loads(podman("network", "inspect", self.tag).stdout)
        subnet = network["subnets"][0]
        self.gateway = subnet["gateway"]
        prefix = self.gateway.rsplit(".", 1)[0]
        self.addresses = {"master": f"{prefix}.10", "driver": f"{prefix}.20"}
        self.addresses |= {f"worker-{i}": f"{prefix}.{10 + i}" for i in range(1, WORKERS + 2)}
        for sub in ("objstore", "conf", "logs"):
            (self.root / sub).mkdir()
        (self.root / "objstore").chmod(0o777)  # the image's user (uid 185) writes there
        self.master_url = f"spark://{self.addresses['master']}:7077"
        self._write_driver_conf()
        self.run("master", [
            "/opt/venv/bin/spark-class", "org.apache.spark.deploy.master.Master",
            "--host", self.addresses["master"], "--port", "7077", "--webui-port", "8080",
        ])  # fmt: skip
        # The network's bridge, and so its gateway address on this machine, exists from the
        # first container on: moto listens there and nowhere else.
        self._start_s3()
        self.wait_for_log("master", "I have been elected leader", 180)
        for i in range(1, WORKERS + 1):
            self.start_worker(f"worker-{i}")
        for i in range(1, WORKERS + 1):
            self.wait_for_log(f"worker-{i}", "Successfully registered with master", 180)

    def _start_s3(self) -> None:
        """moto on the gateway address, in a process of its own: as a thread of this test's
        process, a rank's S3 call after the killed worker's loss waited 25-30 s in about half
        the runs (the killed worker's uploads were cut mid-request)."""
        self.moto, self.s3_endpoint, self.s3 = start_moto(
            self.gateway, (RAW_BUCKET, STORE_BUCKET), ACCESS_KEY, SECRET_KEY
        )
        assert not self.keys(STORE_BUCKET, ""), f"s3://{STORE_BUCKET} is not empty"

    def _write_driver_conf(self) -> None:
        (self.root / "conf" / "spark-defaults.conf").write_text(
            driver_spark_defaults(self.master_url)
        )

    def env(self, role: str) -> dict[str, str]:
        return {
            **MPI_ENV,
            "SPARK_LOCAL_IP": self.addresses[role],
            "SPARK_NO_DAEMONIZE": "1",
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_ENDPOINT_URL": self.s3_endpoint if self.moto else "",
            "AWS_DEFAULT_REGION": "us-east-1",
            "FLYTE_AWS_ENDPOINT": self.s3_endpoint if self.moto else "",
            "FLYTE_AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "FLYTE_AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "FLYTE_HVD_LOG_LEVEL": "INFO",
            "TF_CPP_MIN_LOG_LEVEL": "3",
        }

    def run(self, role: str, command: list[str], env: dict | None = None, mounts=()) -> None:
        """Start the container ``role`` (detached; its output is its log)."""
        environment = {**self.env(role), **(env or {})}
        options = [f"--env={key}={value}" for key, value in environment.items()]
        for source, target in mounts:
            options += ["--volume", f"{source}:{target}"]
        # Every role by name, as a cluster's DNS would give it (the network has no DNS):
        # Spark advertises a driver and workers by host name.
        options += [f"--add-host={name}:{address}" for name, address in self.addresses.items()]
        podman(
            "run", "--detach", *RUN_OPTIONS, "--name", self.name(role), "--label", self.tag,
            "--hostname", role, "--network", self.tag, "--ip", self.addresses[role],
            *options, IMAGE, *command,
        )  # fmt: skip

    def start_worker(self, role: str) -> None:
        self.run(role, [
            "/opt/venv/bin/spark-class", "org.apache.spark.deploy.worker.Worker",
            "--host", self.addresses[role], "--cores", "1", "--memory", "6g",
            "--work-dir", "/tmp/spark-work", "--webui-port", "8081", self.master_url,
        ], mounts=[(self.root / "objstore", OBJSTORE)])  # fmt: skip

    def name(self, role: str) -> str:
        return f"{self.tag}-{role}"

    def log(self, role: str, timestamps: bool = False) -> str:
        """The container's output, its stdout and stderr interleaved as written."""
        env = {**os.environ, "CONTAINERS_CONF": PODMAN_CONF}
        stamps = ["--timestamps"] if timestamps else []
        return subprocess.run(
            ["podman", "logs", *stamps, self.name(role)], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, timeout=60, env=env,
        ).stdout  # fmt: skip

    def wait_for_log(self, role: str, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.log(role):
                return
            if self.status(role) == "exited":
                raise RuntimeError(f"{role} exited: {self.log(role)[-3000:]}")
            time.sleep(1)
        raise RuntimeError(f"{role}: no {text!r} in {timeout}s: {self.log(role)[-3000:]}")

    def status(self, role: str) -> str:
        return podman("inspect", "--format", "{{.State.Status}}", self.name(role)).stdout.strip()

    def exec(self, role: str, command: list[str]) -> subprocess.CompletedProcess:
        return podman("exec", self.name(role), *command, check=False, timeout=60)

    def processes(self, role: str) -> list[str]:
        return self.exec(role, ["ps", "-eo", "args"]).stdout.splitlines()[1:]

    def keys(self, bucket: str, prefix: str = "") -> set[str]:
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return {o["Key"] for page in pages for o in page.get("Contents", [])}

    # -- stop ----------------------------------------------------------------------------------

    def stop(self) -> None:
        """Remove every container and the network, stop moto, remove the folder."""
        if os.environ.get("FLYTE_HVD_CLUSTER_KEEP_LOGS"):
            keep = Path(os.environ["FLYTE_HVD_CLUSTER_KEEP_LOGS"])
            keep.mkdir(parents=True, exist_ok=True)
            for name in self.containers():
                (keep / f"{name}.log").write_text(
                    self.log(name.removeprefix(f"{self.tag}-"), timestamps=True)
                )
        names = self.containers()
        if names:
            podman("rm", "--force", "--time", "0", *names, check=False, timeout=300)
        podman("network", "rm", "--force", self.tag, check=False)
        if self.moto is not None:
            self.moto.terminate()
            try:
                self.moto.wait(10)
            except subprocess.TimeoutExpired:
                self.moto.kill()
                self.moto.wait()
            self.moto = None
        shutil.rmtree(self.root, ignore_errors=True)

    def containers(self) -> list[str]:
        listed = podman("ps", "--all", "--filter", f"label={self.tag}", "--format", "{{.Names}}")
        return listed.stdout.split()

    def leftovers(self) -> list[str]:
        left = [f"container {name}" for name in self.containers()]
        if podman("network", "exists", self.tag, check=False).returncode == 0:
            left.append(f"network {self.tag}")
        if self.root.exists():
            left.append(f"folder {self.root}")
        return left


def _build_image() -> str:
    """The image, built by the script `make image` runs, unless it is current; what the build
    said, for the test's output."""
    started = time.monotonic()
    build = subprocess.run(
        [str(REPO / "scripts" / "build_image.sh"), "--if-stale", IMAGE],
        capture_output=True, text=True, timeout=3600, cwd=REPO,
    )  # fmt: skip
    assert build.returncode == 0, f"image build failed: {build.stderr[-6000:]}"
    said = build.stderr.strip().splitlines()[-1]
    return f"image {IMAGE}: {said} ({time.monotonic() - started:.0f}s)"


def _fast_registration_bundle(out: Path) -> Path:
    """The workflow's code as `pyflyte register` packs it (flytekit's fast_package), from a
    project folder holding ``workflows/``."""
    from flytekit.tools.fast_registration import fast_package

    source = out / "project"
    shutil.copytree(
        REPO / "workflows", source / "workflows", ignore=shutil.ignore_patterns("__pycache__")
    )
    (out / "bundle").mkdir()
    return Path(fast_package(source, out / "bundle"))


# Enough epochs that the kill lands mid-training on a quiet machine too (an epoch takes 3-7 s
# here; the first one's state.json is seen within a second, and the kill follows it): two
# epochs after the first are 6-14 s of margin.
EPOCHS = 3
WORK = "/home/spark/work"


class KilledWorkerRun:
    """The workflow run the test asserts on: the cluster started, the workflow run in the
    driver container from its fast-registration bundle, worker-1 killed once the first epoch is
    recorded and a replacement worker started, the driver waited for.

    It runs in a thread of its own, so that the suite can run it beside the tests that leave a
    core idle (``start_beside_other_tests``, called by tests/conftest.py); the thread only waits
    on podman, moto and S3, and keeps its output for the test (nothing printed or logged
    while other tests run). ``result`` waits for it; ``close`` removes everything it made."""

    def __init__(self) -> None:
        self.cluster = ContainerCluster()
        self.error: BaseException | None = None
        self.image_note = ""
        self.state: tuple[str, dict] | None = None  # the run's path and state.json at the kill
        self.driver_ran_past_the_kill = False
        self.status = ""  # the driver container's exit status
        self.started = self.killed_at = self.ran = 0.0
        self._closing = self._closed = False
        # Packed here, not in the thread: flytekit's import and logging stay out of it.
        try:
            self._bundle = _fast_registration_bundle(self.cluster.root)
        except BaseException:
            shutil.rmtree(self.cluster.root, ignore_errors=True)
            raise
        self._thread = threading.Thread(target=self._run, name="container run", daemon=True)

    def start(self) -> KilledWorkerRun:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self.image_note = _build_image()
            if not self._closing:
                self.cluster.start()
            if not self._closing:
                self._workflow()
        except BaseException as error:  # raised again by result(), in the test
            self.error = error

    def _workflow(self) -> None:
        cluster = self.cluster
        self.started = time.monotonic()
        fast_key = f"fast/{self._bundle.name}"
        cluster.s3.upload_file(str(self._bundle), RAW_BUCKET, fast_key)
        hp = {"num_proc": 2, "epochs": EPOCHS, "sample_rate": 0.3, "batch_size": 128}
        unpack = (
            "import sys; from flytekit.tools.fast_registration import download_distribution; "
            "download_distribution(sys.argv[1], sys.argv[2])"
        )
        then_run = 'mkdir -p "$1" && cd "$1" && python -c "$2" "$3" "$1" && shift 3 && exec "$@"'
        cluster.run("driver", [
            "sh", "-c", then_run, "driver", WORK, unpack, f"s3://{RAW_BUCKET}/{fast_key}",
            "pyflyte", "run", "--raw-output-data-prefix", f"s3://{RAW_BUCKET}/raw",
            "workflows/rossmann.py", "horovod_spark_wf",
            "--hp", json.dumps(hp), "--work_dir", f"s3://{STORE_BUCKET}/rossmann",
        ], env={
            "SPARK_CONF_DIR": SPARK_CONF_DIR,
            "SPARK_DRIVER_BIND_ADDRESS": cluster.addresses["driver"],
        }, mounts=[(cluster.root / "conf", f"{SPARK_CONF_DIR}:ro"),
                   (cluster.root / "objstore", OBJSTORE)])  # fmt: skip

        # Mid-training: once the first epoch is recorded, worker-1 dies (a node lost) and a
        # fresh worker takes its place, as a replaced pod would.
        deadline = time.monotonic() + 1500
        polls = 0
        while time.monotonic() < deadline and self.state is None and not self._closing:
            # podman inspect costs a process start: asked once a second, S3 five times.
            if polls % 5 == 0 and cluster.status("driver") == "exited":
                break
            polls += 1
            self.state = _state(cluster)
            time.sleep(0.2)
        if self.state is None:
            return  # the test names what the driver printed
        self.killed_at = time.monotonic()
        podman("kill", cluster.name("worker-1"))
        self.driver_ran_past_the_kill = cluster.status("driver") != "exited"
        cluster.start_worker(f"worker-{WORKERS + 1}")
        self.status = podman("wait", cluster.name("driver"), timeout=1500).stdout.strip()
        self.ran = time.monotonic()

    def result(self, timeout: float) -> KilledWorkerRun:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the container run did not end within {timeout:.0f}s")
        if self.error is not None:
            raise self.error
        return self

    def close(self) -> None:
        """Removes the containers, the network, moto and the folder, also while the run is
        still going (an interrupted session): its podman calls then fail and it ends."""
        if self._closed:
            return
        self._closing = True
        self.cluster.stop()
        self._thread.join(120)
        self.cluster.stop()  # whatever the run made while the first stop went on
        self._closed = True


_beside_other_tests: KilledWorkerRun | None = None


def start_beside_other_tests() -> KilledWorkerRun | None:
    """Starts the run in the background, when this machine can run it (else the test says
    why, as without this); the test then waits for this run instead of starting one."""
    global _beside_other_tests
    if image_tools() is None and _beside_other_tests is None:
        # What fails here fails again in the test's own start, which reports it there.
        with contextlib.suppress(Exception):
            _beside_other_tests = KilledWorkerRun().start()
    return _beside_other_tests


@pytest.fixture(scope="module")
def container_cluster():
    require(image_tools())
    run = _beside_other_tests or KilledWorkerRun().start()
    try:
        yield run.result(timeout=2000)
    finally:
        run.close()
    assert run.cluster.leftovers() == []


def _attempt_lines(log: str) -> str:
    """The lines of a driver log that tell its stage attempts apart: ranks starting, Spark's
    and flyte_hvd's retries and errors, epochs."""
    wanted = re.compile(r"rank \d+ of \d+ on host|retries the stage|Lost executor|ERROR|"
                        r"Error|failed|Epoch \d+/")  # fmt: skip
    return "\n".join(line[:300] for line in log.splitlines() if wanted.search(line))[-8000:]


def _state(cluster: ContainerCluster) -> tuple[str, dict] | None:
    """The run's path and its state.json, once a first epoch has been recorded."""
    for key in cluster.keys(STORE_BUCKET, "rossmann/runs/"):
        if key.endswith("/state.json"):
            body = cluster.s3.get_object(Bucket=STORE_BUCKET, Key=key)["Body"].read()
            return key.rsplit("/", 1)[0], json.loads(body)
    return None


@pytest.mark.timeout(2400)
def test_rossmann_on_containers_survives_a_killed_worker(container_cluster):
    """Two ranks on two worker containers; after the first epoch's checkpoint, one worker
    container is killed: Spark runs the stage again on the survivor and a replacement worker,
    and the fit resumes after the recorded epoch. The artefacts land in S3; the containers
    that remain run no rank process."""
    run = container_cluster
    cluster, epochs, work = run.cluster, EPOCHS, WORK
    print(run.image_note)
    state = run.state
    assert state, f"no state.json in S3: {cluster.log('driver')[-6000:]}"
    assert 1 <= state[1]["epoch"] < epochs, state
    assert run.driver_ran_past_the_kill, "the run ended before worker-1 was killed"
    output = cluster.log("driver")
    assert run.status == "0", f"driver exit {run.status}: {output[-8000:]}"

    # Spark lost worker-1's executor and ran the stage again on the survivor and the
    # replacement (Spark's own line; flyte_hvd adds `Spark retries the stage (attempt 2 of 4)`
    # when a rank reports the failure before Spark notices the lost executor).
    plain = re.sub(r"\x1b\[[0-9;]*m", "", output)  # Keras colours its progress bar
    lost = re.search(rf"Lost executor \d+ on {re.escape(cluster.addresses['worker-1'])}", plain)
    assert lost, plain[-8000:]
    replacement = f"worker-{WORKERS + 1}"
    retry = plain[lost.end() :]
    ranks = [m.groups() for m in RANK_LINE.finditer(retry)]
    # Spark may take more than one attempt after the loss (each one logged; one CI run took
    # two): every one runs on the survivor and the replacement only, and the last, whose two
    # ranks are the last to start, trains to the end.
    attempts = _attempt_lines(retry)
    assert len(ranks) >= 2, attempts
    assert sorted(int(r[0]) for r in ranks[-2:]) == [0, 1], attempts
    assert {r[2] for r in ranks[-2:]} == {"worker-2", replacement}, attempts
    assert {r[2] for r in ranks} <= {"worker-2", replacement}, attempts
    for _, size, _, local_rank, local_size, _, cross_size in ranks:
        assert (size, local_rank, local_size, cross_size) == ("2", "0", "1", "2")
    # The retried fit resumed after the recorded epoch(s): it never started at epoch 1.
    assert not re.search(r"Epoch 1/", retry), attempts
    assert re.search(rf"Epoch {epochs}/{epochs}", retry), retry[-6000:]
    # MPI between the containers: libfabric's tcp provider on a worker's own address, no UCX.
    worker_addresses = {cluster.addresses[r] for r in ("worker-2", replacement)}
    chosen = set(re.findall(r"provider: tcp;ofi_rxm, .* FI_SOCKADDR_IN \[16\] (\S+)", retry))
    assert chosen and chosen <= worker_addresses, (chosen, worker_addresses)
    assert "UCX" not in retry, [line for line in retry.splitlines() if "UCX" in line][:5]

    # Checkpoint, state, logs and submission are in S3, with every epoch in the state.
    (model,) = re.findall(r"model:\s+(s3://\S+)", output)
    run_path = model.removeprefix(f"s3://{STORE_BUCKET}/").rsplit("/", 1)[0]
    stored = cluster.keys(STORE_BUCKET, run_path)
    for name in ("checkpoint.keras", "state.json", "submission.csv"):
        assert f"{run_path}/{name}" in stored, sorted(stored)
    assert any(key.startswith(f"{run_path}/logs/") for key in stored), sorted(stored)
    final = json.loads(
        cluster.s3.get_object(Bucket=STORE_BUCKET, Key=f"{run_path}/state.json")["Body"].read()
    )
    assert final["epoch"] == epochs, final

    # The driver's workflow came from the bundle, unpacked into its working directory; the
    # workers have no copy of it.
    copied = podman("cp", f"{cluster.name('driver')}:{work}/workflows/rossmann.py",
                    str(cluster.root / "from-driver.py"), check=False)  # fmt: skip
    assert copied.returncode == 0, copied.stderr
    assert (cluster.root / "from-driver.py").read_bytes() == (
        REPO / "workflows" / "rossmann.py"
    ).read_bytes()
    for role in ("worker-2", f"worker-{WORKERS + 1}"):
        assert cluster.exec(role, ["test", "-e", f"{work}/workflows"]).returncode == 1
        deadline = time.monotonic() + 10  # the last executors may still be stopping
        while True:
            ps = cluster.processes(role)
            left = [p for p in ps if any(r in p for r in RANK_PROCESSES)]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert ps and left == [], f"{role}: {left or 'no ps output'}"
        scratch = cluster.exec(role, ["find", "/tmp", "-name", "flyte-hvd-run-*"]).stdout
        assert scratch.strip() == "", f"{role}: {scratch}"
    print(
        f"container cluster: workflow {run.ran - run.started:.0f}s (killed at "
        f"{run.killed_at - run.started:.0f}s), {len(ranks)} rank starts after the loss, "
        f"{len(output)} bytes of driver output"
    )
