"""A Spark standalone cluster of simulated hosts on this machine, sharing nothing but S3.

    python tests/cluster_harness.py          # `make cluster`: start, print how to use, wait

Each host is one process tree in its own mount and UTS namespaces (``unshare``, as root):

| host           | address     | runs                                                     |
|----------------|-------------|----------------------------------------------------------|
| ``sim-master`` | 127.0.0.10  | the Spark standalone Master                              |
| ``sim-worker-N`` | 127.0.0.1N | a Spark Worker with 1 core; its executors and ranks     |
| ``sim-driver`` | 127.0.0.1   | the driver: ``pyflyte run`` (or a shell), from ``/tmp/driver`` |

What each host has of its own: a hostname; a private ``/tmp`` (a tmpfs: Spark's work and
scratch directories, flytekit's working directories, the driver's downloads and its current
directory); its own ``/etc/hosts`` naming every host. On workers and the master the
project's checkout is hidden (an empty tmpfs over it): the workflow's code reaches executors
and ranks only as the zip the driver ships (``addPyFile``). The library itself comes from
``<root>/image`` on ``PYTHONPATH``, a copy of ``flyte_hvd`` standing in for the image's
installed package. Spark binds every host's services to its own address (``SPARK_LOCAL_IP``,
``--host``). The driver's address is 127.0.0.1 because flytekit binds a local Spark driver to
127.0.0.1 (``spark.driver.bindAddress``).

MPI crosses hosts over TCP: MPICH's shared-memory transport is off (``MPIR_CVAR_NOLOCAL=1``)
and its netmod is libfabric (``MPIR_CVAR_CH4_NETMOD=ofi``) with the ``tcp`` provider
(``FI_PROVIDER=tcp``) on the loopback interface (``FI_TCP_IFACE=lo``). libfabric binds an
interface, not an address, so rank-to-rank connections use 127.0.0.1 on every host. (The
``mpich`` wheel's default netmod, UCX, would choose shared memory, or TCP on the machine's
external interface.)

Storage. S3 is a moto server on 127.0.0.1, the only store the hosts share: the Store
(``--work_dir s3://…``), the dataset, checkpoints, and Flyte's raw outputs (flytekit's raw
output prefix ``s3://<raw bucket>/…``) through s3fs/boto3. THE ONE SUBSTITUTION: Spark's JVM
has no S3 client here (the ``s3a`` jars cannot be installed on these machines), so Spark's
own reads and writes of Flyte's DataFrames (flytekitplugins-spark writes a DataFrame output
as Parquet at an ``s3://<raw bucket>/…`` URI with Spark, and reads it back with Spark) go to
one directory, ``<root>/objstore``, bind-mounted at ``/tmp/flyte-hvd-objstore`` on every host:
Hadoop's ``ViewFileSystemOverloadScheme`` maps ``s3://<raw bucket>/`` there. Every other
``s3://`` bucket maps to S3A, which is absent, so Spark cannot reach the Store and flyte_hvd
uploads through s3fs, as it does wherever Spark has no S3 client. On Kubernetes the
propeller's Spark defaults map ``s3://`` to S3A instead (k8s/flytepropeller).

Start-up and tear-down: ``SimCluster`` is a context manager; leaving it (also on an error or
Ctrl-C) kills every process of every host (each host is its own session; anything left in a
host's mount namespace is found through /proc and killed), which ends the namespaces and
their mounts, stops moto and removes ``<root>``. ``leftovers()`` reports anything that
remains.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
VENV_BIN = Path(PYTHON).parent
OBJSTORE = "/tmp/flyte-hvd-objstore"
RAW_BUCKET = "flyte-raw"
STORE_BUCKET = "flyte-hvd-store"
SUITE_SPARK_DEFAULTS = REPO / "tests" / "spark-defaults.conf"
ACCESS_KEY, SECRET_KEY = "cluster-key", "cluster-secret"
# MPICH across simulated hosts: no shared memory, libfabric's TCP provider on loopback.
MPI_TCP_ENV = {
    "MPIR_CVAR_NOLOCAL": "1",
    "MPIR_CVAR_CH4_NETMOD": "ofi",
    "FI_PROVIDER": "tcp",
    "FI_TCP_IFACE": "lo",
}


# hydra's ssh launcher runs `LAUNCHER [ssh options] HOST COMMAND...`: this one starts the
# command as a host named after HOST's last octet (its own UTS namespace; the files stay
# this machine's, so a checkout and venv anywhere are seen as they are).
RANK_HOST_LAUNCHER = """#!/bin/sh
while [ "${1#-}" != "$1" ]; do shift; done
host=$1; shift
exec unshare --uts sh -c 'hostname "sim-host-$0"; exec sh -c "$*"' "${host##*.}" "$@"
"""


def mpiexec_on_hosts(
    launcher_dir: Path, hosts: int, per_host: int, command: list[str]
) -> list[str]:
    """An ``mpiexec`` command line running ``command`` as ``per_host`` ranks on each of
    ``hosts`` simulated hosts (127.0.0.21, .22, ...); MPICH takes shared memory within a host
    and TCP between hosts (run it with ``MPI_TCP_ENV`` less ``MPIR_CVAR_NOLOCAL``)."""
    launcher = launcher_dir / "rank-host-launcher.sh"
    launcher.write_text(RANK_HOST_LAUNCHER)
    launcher.chmod(0o755)
    addresses = ",".join(f"127.0.0.{21 + i}" for i in range(hosts))
    mpiexec = VENV_BIN / "mpiexec"
    return [
        str(mpiexec), "-n", str(hosts * per_host), "-launcher", "ssh", "-launcher-exec",
        str(launcher), "-hosts", addresses, "-ppn", str(per_host), *command,
    ]  # fmt: skip


def namespaces_unavailable() -> str | None:
    """Why simulated hosts cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "simulated hosts need root (unshare --mount --uts)"
    if not shutil.which("unshare") or not shutil.which("nsenter"):
        return "unshare/nsenter (util-linux) not found"
    try:
        probe = subprocess.run(
            ["unshare", "--mount", "--uts", "sh", "-c", "hostname sim-probe && "
             "mount -t tmpfs tmpfs /tmp && hostname"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"unshare failed: {error}"
    if probe.returncode != 0 or probe.stdout.strip() != "sim-probe":
        return f"mount/UTS namespaces unavailable: {probe.stderr.strip() or probe.stdout.strip()}"
    return None


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class Host:
    name: str
    address: str
    process: subprocess.Popen | None = None
    log: Path | None = None

    @property
    def mnt_ns(self) -> str | None:
        try:
            return os.readlink(f"/proc/{self.process.pid}/ns/mnt")
        except (OSError, AttributeError):
            return None


@dataclass
class SimCluster:
    """Master, ``workers`` Spark workers and a driver host; moto S3 on 127.0.0.1."""

    workers: int = 2
    worker_memory: str = "6g"
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(
        prefix="flyte-hvd-cluster-", dir="/var/tmp")))  # fmt: skip
    hosts: dict[str, Host] = field(default_factory=dict)
    namespaces: set[str] = field(default_factory=set)
    s3_endpoint: str = ""
    master_url: str = ""

    # -- life cycle ----------------------------------------------------------------------------

    def __enter__(self) -> SimCluster:
        self._previous_sigterm = signal.getsignal(signal.SIGTERM)
        if self._previous_sigterm in (signal.SIG_DFL, None):
            # `kill` of the test run tears the cluster down too, as Ctrl-C does.
            signal.signal(signal.SIGTERM, _interrupt)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _start(self) -> None:
        for sub in ("image", "objstore", "logs", "conf"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        shutil.copytree(
            REPO / "flyte_hvd", self.root / "image" / "flyte_hvd",
            ignore=shutil.ignore_patterns("__pycache__"),
        )  # fmt: skip
        self._start_s3()
        names = [("sim-master", "127.0.0.10")]
        names += [(f"sim-worker-{i}", f"127.0.0.{10 + i}") for i in range(1, self.workers + 1)]
        names += [("sim-driver", "127.0.0.1")]
        self.hosts = {name: Host(name, address) for name, address in names}
        (self.root / "hosts").write_text(
            "127.0.0.1 localhost\n"
            + "".join(f"{h.address} {h.name}\n" for h in self.hosts.values())
        )
        master = self.hosts["sim-master"]
        port = _free_port(master.address)
        self.master_url = f"spark://{master.address}:{port}"
        self._write_driver_conf()
        self._launch(master, [
            str(VENV_BIN / "spark-class"), "org.apache.spark.deploy.master.Master",
            "--host", master.address, "--port", str(port),
            "--webui-port", str(_free_port(master.address)),
        ])  # fmt: skip
        self._wait_for_port(master.address, port, master, 120)
        for i in range(1, self.workers + 1):
            worker = self.hosts[f"sim-worker-{i}"]
            self._launch(worker, [
                str(VENV_BIN / "spark-class"), "org.apache.spark.deploy.worker.Worker",
                "--host", worker.address, "--cores", "1", "--memory", self.worker_memory,
                "--work-dir", "/tmp/spark-work",
                "--webui-port", str(_free_port(worker.address)), self.master_url,
            ])  # fmt: skip
        self._wait_for_workers(180)

    def _start_s3(self) -> None:
        """moto on a free loopback port (which every simulated host shares), in a process of its
        own: moto keeps its authentication switch per process, and the suite's signed S3
        server (``s3_server``) turns it on for the rest of the session."""
        self._moto, self.s3_endpoint, self.s3 = start_moto(
            "127.0.0.1", (RAW_BUCKET, STORE_BUCKET), ACCESS_KEY, SECRET_KEY
        )

    def stop(self) -> None:
        """Kill every host's processes, stop moto, remove ``root``; safe to call twice."""
        for host in self.hosts.values():
            ns = host.mnt_ns
            if ns:
                self.namespaces.add(ns)
        for host in self.hosts.values():
            if host.process and host.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(host.process.pid, signal.SIGKILL)
        self._kill_in_namespaces()
        for host in self.hosts.values():
            if host.process:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    host.process.wait(timeout=30)
        if getattr(self, "_moto", None) is not None:
            self._moto.kill()
            self._moto.wait()
            self._moto = None
        if os.environ.get("FLYTE_HVD_CLUSTER_KEEP_LOGS"):
            keep = Path(os.environ["FLYTE_HVD_CLUSTER_KEEP_LOGS"])
            shutil.copytree(self.root / "logs", keep, dirs_exist_ok=True)
        shutil.rmtree(self.root, ignore_errors=True)
        if getattr(self, "_previous_sigterm", None) in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def _kill_in_namespaces(self) -> None:
        """Processes that left a host's session (a daemon, ``setsid``) still sit in its mount
        namespace: find them through /proc and kill them."""
        for _ in range(20):
            pids = self._pids_in_namespaces()
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.25)

    def _pids_in_namespaces(self) -> list[int]:
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if os.readlink(entry / "ns" / "mnt") in self.namespaces:
                    found.append(int(entry.name))
            except OSError:
                continue
        return found

    def leftovers(self) -> list[str]:
        """What a stopped cluster left behind: processes in its namespaces, mounts of its
        folders in this namespace, its root folder."""
        left = [f"process {pid} in a host namespace" for pid in self._pids_in_namespaces()]
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
        left += [f"mount {line}" for line in mounts if str(self.root) in line or OBJSTORE in line]
        if self.root.exists():
            left.append(f"folder {self.root}")
        return left

    # -- hosts ---------------------------------------------------------------------------------

    def host_env(self, host: Host) -> dict[str, str]:
        """The environment every process of ``host`` starts with: no checkout on any path."""
        env = {
            key: value for key, value in os.environ.items()
            if not key.startswith(("SPARK_", "PYSPARK_", "FLYTE_", "AWS_", "PYTHON"))
        }  # fmt: skip
        env.update(MPI_TCP_ENV)
        env.update(
            PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
            HOME="/tmp/home",
            TMPDIR="/tmp",
            PYTHONPATH=str(self.root / "image"),
            PYSPARK_PYTHON=PYTHON,
            PYSPARK_DRIVER_PYTHON=PYTHON,
            SPARK_LOCAL_IP=host.address,
            SPARK_LOCAL_DIRS="/tmp/spark-local",
            SPARK_LOG_DIR="/tmp/spark-logs",
            SPARK_WORKER_DIR="/tmp/spark-work",
            SPARK_NO_DAEMONIZE="1",
            AWS_ACCESS_KEY_ID=ACCESS_KEY,
            AWS_SECRET_ACCESS_KEY=SECRET_KEY,
            AWS_ENDPOINT_URL=self.s3_endpoint,
            AWS_DEFAULT_REGION="us-east-1",
            FLYTE_AWS_ENDPOINT=self.s3_endpoint,
            FLYTE_AWS_ACCESS_KEY_ID=ACCESS_KEY,
            FLYTE_AWS_SECRET_ACCESS_KEY=SECRET_KEY,
            FLYTE_HVD_LOG_LEVEL="INFO",
            TF_CPP_MIN_LOG_LEVEL="3",
            PYTHONUNBUFFERED="1",
        )
        return env

    def _namespace_script(self, host: Host) -> str:
        venv = Path(sys.prefix)
        on_driver = host.name == "sim-driver"
        # Each host mounts a /tmp of its own. What lives under the machine's /tmp and must stay
        # (the venv; on the driver also the checkout, say a clone in /tmp) is held at a mount
        # point outside /tmp meanwhile, then put back at its own path.
        keep = [REPO, venv] if on_driver else [venv]
        hold, restore = "", ""
        for i, path in enumerate(p for p in keep if p.is_relative_to("/tmp")):
            held = self.root / "held" / host.name / str(i)
            held.mkdir(parents=True, exist_ok=True)
            hold += f"mount --bind {path} {held}\n"
            restore += f"mkdir -p {path} && mount --bind {held} {path}\n"
        hide = ""
        if not on_driver and not REPO.is_relative_to("/tmp"):  # under /tmp it is gone already
            hide = f"mount -t tmpfs -o size=1m tmpfs {REPO}\n"
            if venv.is_relative_to(REPO):
                # A venv inside the checkout (as `make setup` makes it) is the hosts' Python
                # installation, as an image's would be: it stays, at the same path; the rest of
                # the checkout is hidden.
                hide = (
                    f"mkdir -p /tmp/.python-env && mount --bind {venv} /tmp/.python-env\n"
                    + hide
                    + f"mkdir -p {venv} && mount --bind /tmp/.python-env {venv}\n"
                )
        return (
            f"set -e\nhostname {host.name}\n"
            + hold
            + "mount -t tmpfs -o size=8g tmpfs /tmp\n"
            + restore
            + textwrap.dedent(f"""\
            mkdir -p {OBJSTORE} /tmp/home /tmp/spark-local /tmp/spark-work /tmp/driver
            mount --bind {self.root / "objstore"} {OBJSTORE}
            mount --bind {self.root / "hosts"} /etc/hosts
            """)
            + hide
            + 'cd /tmp/driver\nexec "$@"\n'
        )

    def _launch(self, host: Host, command: list[str], env: dict | None = None) -> Host:
        host.log = self.root / "logs" / f"{host.name}.log"
        with open(host.log, "ab") as log:
            host.process = subprocess.Popen(
                ["unshare", "--mount", "--uts", "--propagation", "private", "sh", "-c",
                 self._namespace_script(host), host.name, *command],
                env=env or self.host_env(host), stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        for _ in range(100):
            ns = host.mnt_ns
            if ns and ns != os.readlink("/proc/self/ns/mnt"):
                self.namespaces.add(ns)
                break
            time.sleep(0.05)
        return host

    def _wait_for_port(self, address: str, port: int, host: Host, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if host.process.poll() is not None:
                raise RuntimeError(f"{host.name} exited: {host.log.read_text()[-3000:]}")
            with socket.socket() as s:
                s.settimeout(1)
                if s.connect_ex((address, port)) == 0:
                    return
            time.sleep(0.5)
        raise RuntimeError(f"{host.name} did not listen on {address}:{port} in {timeout}s")

    def _wait_for_workers(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        registered: set[str] = set()
        while time.monotonic() < deadline:
            for i in range(1, self.workers + 1):
                host = self.hosts[f"sim-worker-{i}"]
                if host.process.poll() is not None:
                    raise RuntimeError(f"{host.name} exited: {host.log.read_text()[-3000:]}")
                if "Successfully registered with master" in host.log.read_text():
                    registered.add(host.name)
            if len(registered) == self.workers:
                return
            time.sleep(0.5)
        raise RuntimeError(f"workers registered in {timeout}s: {sorted(registered)}")

    def _write_driver_conf(self) -> None:
        """spark-defaults.conf of the driver host: the master, and the one substitution."""
        (self.root / "conf" / "spark-defaults.conf").write_text(
            driver_spark_defaults(self.master_url)
        )

    def driver_env(self) -> dict[str, str]:
        env = self.host_env(self.hosts["sim-driver"])
        env["SPARK_CONF_DIR"] = str(self.root / "conf")
        return env

    def run_on_driver(self, command: list[str], timeout: float) -> subprocess.CompletedProcess:
        """Run ``command`` on the driver host (cwd ``/tmp/driver``), wait, return its output."""
        host = self.hosts["sim-driver"]
        self._launch(host, command, env=self.driver_env())
        try:
            host.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(host.process.pid, signal.SIGKILL)
            host.process.wait()
        output = host.log.read_text()
        return subprocess.CompletedProcess(command, host.process.returncode, output, "")

    def on_host(self, name: str, command: list[str]) -> subprocess.CompletedProcess:
        """Run ``command`` inside the namespaces of a running host (``nsenter``)."""
        pid = self.hosts[name].process.pid
        return subprocess.run(
            ["nsenter", "-t", str(pid), "-m", "-u", "--", *command],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    def describe(self) -> dict:
        return {
            "master": self.master_url,
            "s3_endpoint": self.s3_endpoint,
            "buckets": {"raw_output": RAW_BUCKET, "store": STORE_BUCKET},
            "hosts": {h.name: h.address for h in self.hosts.values()},
            "root": str(self.root),
            "spark_conf_dir": str(self.root / "conf"),
            "credentials": {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY},
        }


def main() -> int:
    """`make cluster`: start the cluster, open a shell on the driver host, tear down on exit."""
    reason = namespaces_unavailable()
    if reason:
        print(f"cannot start the cluster: {reason}", file=sys.stderr)
        return 2
    with SimCluster() as cluster:
        print(json.dumps(cluster.describe(), indent=2))
        print(
            "\nA shell on the driver host (sim-driver, cwd /tmp/driver). Try:\n"
            f"  pyflyte run --raw-output-data-prefix s3://{RAW_BUCKET}/raw {REPO}/workflows/"
            f"rossmann.py horovod_spark_wf --work_dir s3://{STORE_BUCKET}/rossmann\n"
            "Exit the shell to stop the cluster.\n",
            flush=True,
        )
        driver = cluster.hosts["sim-driver"]
        shell = subprocess.run(
            ["unshare", "--mount", "--uts", "--propagation", "private", "sh", "-c",
             cluster._namespace_script(driver), driver.name, os.environ.get("SHELL", "bash")],
            env=cluster.driver_env(),
        )  # fmt: skip
        return shell.returncode


if __name__ == "__main__":
    sys.exit(main())


def start_moto(host: str, buckets: tuple[str, ...], key: str, secret: str):
    """moto's S3 server in a process of its own on a free port of ``host``, with ``buckets``
    made: the process, its endpoint and a boto3 client signed with ``key`` and ``secret``."""
    import boto3
    from botocore.exceptions import EndpointConnectionError

    with socket.socket() as probe:
        probe.bind((host, 0))
        port = probe.getsockname()[1]
    moto = os.path.join(os.path.dirname(sys.executable), "moto_server")
    process = subprocess.Popen(
        [moto, "-H", host, "-p", str(port)], stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    endpoint = f"http://{host}:{port}"
    client = boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id=key, aws_secret_access_key=secret,
        region_name="us-east-1",
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while True:
        try:
            client.create_bucket(Bucket=buckets[0])
            break
        except EndpointConnectionError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise
            time.sleep(0.2)
    for bucket in buckets[1:]:
        client.create_bucket(Bucket=bucket)
    return process, endpoint, client


def driver_spark_defaults(master_url: str) -> str:
    """spark-defaults.conf of a driver: the master, and the one substitution (Spark's own
    Parquet of Flyte DataFrames at ``s3://RAW_BUCKET/...`` goes to ``OBJSTORE``, which every
    host mounts, since no S3A jars are here), after the suite's defaults in a test run
    (``tests/spark-defaults.conf``: these drivers and executors are the suite's JVMs too)."""
    conf = {
        "spark.master": master_url,
        "spark.ui.enabled": "false",
        "spark.hadoop.fs.s3.impl": "org.apache.hadoop.fs.viewfs.ViewFileSystemOverloadScheme",
        f"spark.hadoop.fs.viewfs.mounttable.{RAW_BUCKET}.linkFallback":
            f"file://{OBJSTORE}/{RAW_BUCKET}",
        "spark.hadoop.fs.viewfs.overload.scheme.target.s3.impl":
            "org.apache.hadoop.fs.s3a.S3AFileSystem",
        "spark.hadoop.fs.s3.impl.disable.cache": "true",
    }  # fmt: skip
    own = "".join(f"{key} {value}\n" for key, value in conf.items())
    suite = os.environ.get("FLYTE_HVD_TEST_SESSION")  # set by conftest; not for `make cluster`
    return (SUITE_SPARK_DEFAULTS.read_text() if suite else "") + own
