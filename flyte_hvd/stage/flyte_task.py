"""A Flyte task whose body runs on every rank of a Spark barrier stage: what both Flyte SDKs'
plugins share (``flyte_hvd.flyte`` for flytekit, ``flyte_hvd.flyte2`` for ``flyte``).

The config's Spark settings and their preflight (``BarrierTaskConfig``), the sessions a task
runs on (a local one, or a Spark Connect one), launching the body on the ranks and what each
rank runs around it. What differs between the SDKs is how rank 0's return value becomes the
task's outputs: each plugin hands ``run_rank`` an output spec whose ``rank_context()`` sets up
the SDK's task context on the rank and yields the function that turns rank 0's value into
bytes the driver decodes.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import importlib.resources
import inspect
import os
import reprlib
import shutil
import socket
import sys
import tempfile
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

import cloudpickle

from flyte_hvd.core.checks import require_int
from flyte_hvd.core.log import get_logger
from flyte_hvd.core.types import UserValue
from flyte_hvd.launch import progress
from flyte_hvd.launch.supervisor import check_start_timeout
from flyte_hvd.stage import worker_daemon

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from pyspark.sql.connect.session import SparkSession as ConnectSparkSession

logger = get_logger(__name__)

Number = TypeVar("Number", int, float)  # a Spark setting read as a number
T = TypeVar("T")  # what an awaited body gives back

GPU_VENDOR = "nvidia.com"
# GPU executors select nodes by the label NVIDIA's GPU feature discovery (and GPU operator)
# puts on GPU nodes; where they carry another, `spark_conf={GPU_NODE_SELECTOR: None}` removes
# it (and a `spark.kubernetes.executor.node.selector.<label>` key names theirs).
GPU_NODE_SELECTOR = "spark.kubernetes.executor.node.selector.nvidia.com/gpu.present"
# What a GPU executor pod gets besides its GPUs, as Spark's own Kubernetes settings: Flyte's
# Spark plugin copies no volumes from a pod template, so a memory-backed /dev/shm (NCCL and
# TensorFlow's input pipeline use it beyond the container default of 64 MiB) and the GPU node
# selector are Spark settings. Tolerations of GPU nodes' taints have no Spark setting; the
# ExtendedResourceToleration admission plugin adds them to pods that request nvidia.com/gpu.
GPU_EXECUTOR_CONF = {
    "spark.kubernetes.executor.volumes.emptyDir.dshm.mount.path": "/dev/shm",
    "spark.kubernetes.executor.volumes.emptyDir.dshm.options.medium": "Memory",
    "spark.kubernetes.executor.volumes.emptyDir.dshm.options.sizeLimit": "8Gi",
    GPU_NODE_SELECTOR: "true",
    "spark.executorEnv.TF_FORCE_GPU_ALLOW_GROWTH": "true",
}

# Spark's JVM talks to its Python workers over Unix domain sockets instead of TCP on loopback
# (Spark 4.1+; off by default): `transform`'s Arrow batches go both ways through them, and
# measured 1.25x the rows/s of TCP on 2 cores (430k -> 540k rows/s, 1 M rows, 20 features).
# The workers import pyspark from its installed package rather than from the archives Spark
# puts first on their path, which cost 0.11 s of CPU per task (see `worker_daemon`).
PYTHON_WORKER_CONF = {
    "spark.python.unix.domain.socket.enabled": "true",
    "spark.python.daemon.module": "flyte_hvd.stage.worker_daemon",
}

SPARK_LOG_ENV = worker_daemon.SPARK_LOG_ENV  # "warn" (any value but "error"): Spark as it is


def quiet_local_conf() -> dict[str, str]:
    """Settings that keep the console of a local session (one whose JVM starts here) to what
    matters: Spark's own log at errors (``log4j2-quiet.properties``, in this package: Spark's
    default WARN prints a start-up banner, truncated plans and task-size advice around every
    run), and Spark's Python workers started by ``worker_daemon``, which keeps TensorFlow's
    import notices out of their stderr. Not for a cluster's sessions, whose JVMs do not see
    this file. ``FLYTE_HVD_SPARK_LOG=warn`` keeps Spark's default; a
    ``spark.driver.extraJavaOptions`` of the caller's replaces it."""
    setting = os.environ.get(SPARK_LOG_ENV, "").strip().lower() or "error"
    if setting not in ("error", "warn"):
        raise ValueError(
            f"{SPARK_LOG_ENV}={os.environ[SPARK_LOG_ENV]!r}: expected 'error' (the default: "
            f"Spark's errors only on a local session's console) or 'warn' (Spark's own default)."
        )
    if setting == "warn":
        return {}
    path = importlib.resources.files("flyte_hvd.stage") / "log4j2-quiet.properties"
    return {
        "spark.driver.extraJavaOptions": f"-Dlog4j2.configurationFile=file:{path}",
        **PYTHON_WORKER_CONF,
    }


@dataclass(frozen=True)
class BarrierTaskConfig:
    """Task config for ``num_proc`` ranks in one Spark barrier stage, for either Flyte SDK.

    It mirrors the SDK's ``Spark`` config field for field (``Spark`` is not frozen, so a
    frozen config cannot extend it) and derives the Spark settings a barrier stage needs from
    ``num_proc``: one executor per rank with ``cores_per_rank`` cores, ``spark.task.cpus`` of
    the same, dynamic allocation off, Python workers on Unix domain sockets that import
    pyspark from its installed package (``PYTHON_WORKER_CONF``), and ``gpus_per_rank`` GPUs
    per executor and task. Keys in ``spark_conf`` override the derived ones, and a key set to
    ``None`` (or ``""``) removes a derived one (e.g. ``GPU_NODE_SELECTOR``); a ``spark_conf``
    that leaves fewer than ``num_proc`` task slots is refused here rather than at run time.

    For GPUs on Kubernetes also set ``spark.executor.resource.gpu.discoveryScript`` (the path
    in your Spark image) in ``spark_conf``; the executors get a memory-backed ``/dev/shm`` and
    a GPU node selector (``GPU_EXECUTOR_CONF``) as Spark settings, since Flyte's Spark plugin
    copies no volumes from ``executor_pod``. Where GPU nodes carry another label, replace the
    selector (``{GPU_NODE_SELECTOR: None, "spark.kubernetes.executor.node.selector.<label>":
    "<value>"}``) or remove it. Locally the GPU settings are left out unless
    ``spark_conf`` names them, so a laptop without GPUs runs the same task.

    With ``connect_url`` the task runs on an existing cluster through Spark Connect
    (``sc://host:15002``) instead of starting a session: locally and in its pod alike it
    connects there, and the ranks run in that cluster's executors. The cluster's settings are
    fixed when its server starts, so the derived settings are not applied; ``spark_conf`` may
    name only runtime settings (``spark.sql.*``) there. Pass the token through the
    ``SPARK_CONNECT_AUTHENTICATE_TOKEN`` environment variable rather than in the URL, which is
    part of the task's serialized config.

    Attributes:
        num_proc: number of ranks (Spark barrier tasks).
        spark_conf: Spark settings; override the derived ones (``None`` or ``""``: remove the
            derived setting).
        removed_spark_conf: the derived settings left out: the keys ``spark_conf`` sets to
            ``None`` or ``""`` are moved here, so that ``spark_conf`` holds only strings, as
            the SDK's Spark plugin reads it.
        hadoop_conf, executor_path, applications_path, driver_pod, executor_pod: as in the
            SDK's ``Spark`` config (pod templates of that SDK).
        start_timeout: seconds for scheduling plus rendezvous (``flyte_hvd.spark.run``).
        cores_per_rank: CPU cores reserved per rank.
        gpus_per_rank: GPUs per rank; 0 requests none.
        connect_url: a Spark Connect endpoint (``sc://...``) to run on instead of a session
            of the task's own.
    """

    # The SDK's pod template class and how an error names it; set by each SDK's config.
    pod_template_type: ClassVar[type] = object
    pod_template_name: ClassVar[str] = "PodTemplate"

    num_proc: int
    spark_conf: dict[str, str] | None = None
    hadoop_conf: dict[str, str] | None = None
    executor_path: str | None = None
    applications_path: str | None = None
    driver_pod: Any = None  # the SDK's pod template (``pod_template_type``), or None
    executor_pod: Any = None  # the SDK's pod template (``pod_template_type``), or None
    start_timeout: float | None = None
    cores_per_rank: int = 1
    gpus_per_rank: int = 0
    connect_url: str | None = None
    removed_spark_conf: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        require_int("num_proc", self.num_proc, minimum=1)
        require_int("cores_per_rank", self.cores_per_rank, minimum=1)
        require_int("gpus_per_rank", self.gpus_per_rank, minimum=0)
        if self.start_timeout is not None:  # None: the launcher's default
            check_start_timeout(self.start_timeout)
        for name in ("executor_path", "applications_path"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"`{name}` must be a str or None; found {type(value).__name__}.")
        for name in ("driver_pod", "executor_pod"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, self.pod_template_type):
                raise ValueError(
                    f"`{name}` must be a {self.pod_template_name} or None; found "
                    f"{type(value).__name__}."
                )
        url = self.connect_url
        if url is not None and (not isinstance(url, str) or not url.startswith("sc://")):
            raise ValueError(
                f"`connect_url` must be a Spark Connect URL such as 'sc://host:15002' or None; "
                f"found {url!r}."
            )
        # Frozen: normalize through object.__setattr__, on copies the caller cannot mutate.
        spark_conf = _string_map("spark_conf", self.spark_conf, removable=True)
        removed = {key for key, value in spark_conf.items() if value is None}
        removed.update(_string_keys("removed_spark_conf", self.removed_spark_conf))
        object.__setattr__(self, "removed_spark_conf", tuple(sorted(removed)))
        object.__setattr__(
            self, "spark_conf", {k: v for k, v in spark_conf.items() if v is not None}
        )
        object.__setattr__(self, "hadoop_conf", _string_map("hadoop_conf", self.hadoop_conf))
        _check_feasible(self.num_proc, self.effective_spark_conf)

    def derived_spark_conf(self, gpus: bool = True) -> dict[str, str]:
        """The settings a barrier stage of ``num_proc`` ranks needs, before overrides."""
        conf = {
            "spark.executor.instances": str(self.num_proc),
            "spark.executor.cores": str(self.cores_per_rank),
            "spark.task.cpus": str(self.cores_per_rank),
            "spark.dynamicAllocation.enabled": "false",
            **PYTHON_WORKER_CONF,
        }
        if gpus and self.gpus_per_rank:
            conf["spark.executor.resource.gpu.amount"] = str(self.gpus_per_rank)
            conf["spark.task.resource.gpu.amount"] = str(self.gpus_per_rank)
            conf["spark.executor.resource.gpu.vendor"] = GPU_VENDOR
            conf.update(GPU_EXECUTOR_CONF)
        return conf

    @property
    def effective_spark_conf(self) -> dict[str, str]:
        """Derived settings with ``spark_conf`` on top: what the SparkApplication gets."""
        return self._overlay(self.derived_spark_conf())

    def _overlay(self, derived: dict[str, str]) -> dict[str, str]:
        """``derived`` less ``removed_spark_conf``, with ``spark_conf`` on top."""
        kept = {k: v for k, v in derived.items() if k not in self.removed_spark_conf}
        return {**kept, **(self.spark_conf or {})}

    @property
    def local_spark_conf(self) -> dict[str, str]:
        """Settings for a local SparkSession: GPU settings only where ``spark_conf`` names
        them, a ``local[N]`` master with a task slot per rank unless it names one, and Spark's
        console at errors (``quiet_local_conf``)."""
        conf = self._overlay({**self.derived_spark_conf(gpus=False), **quiet_local_conf()})
        task_cpus = int(conf["spark.task.cpus"])
        conf.setdefault("spark.master", f"local[{self.num_proc * task_cpus}]")
        return conf


def _string_keys(name: str, value: object) -> list[str]:
    """Setting names given as a tuple (or list or set) of str."""
    if not isinstance(value, tuple | list | set | frozenset) or not all(
        isinstance(key, str) for key in value
    ):
        raise ValueError(f"`{name}` must be a tuple of setting names (str); found {value!r}.")
    return list(value)


def _string_map(name: str, value: object, removable: bool = False) -> dict[str, Any]:
    """Spark and Hadoop settings are strings; numbers and booleans are written as Spark
    spells them (``2``, ``true``) so ``{"spark.executor.cores": 2}`` works. Where settings
    are ``removable``, ``None`` and ``""`` are kept as ``None``: remove the setting."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(
            f"`{name}` must be a dict of setting names to values; found {type(value).__name__}."
        )
    out: dict[str, Any] = {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise ValueError(f"`{name}` keys must be str; found {key!r} ({type(key).__name__}).")
        if removable and (item is None or item == ""):
            out[key] = None
        elif isinstance(item, bool):
            out[key] = "true" if item else "false"
        elif isinstance(item, str | int | float):
            out[key] = str(item)
        else:
            raise ValueError(
                f"`{name}[{key!r}]` must be a str, int, float or bool"
                f"{' (None removes a derived setting)' if removable else ''}; found {item!r} "
                f"({type(item).__name__})."
            )
    return out


def _conf_number(
    conf: dict[str, str], key: str, kind: type[Number], default: str, minimum: float
) -> Number:
    raw = conf.get(key, default)
    try:
        number = kind(raw)
    except ValueError:
        number = None
    if number is None or number < minimum:
        raise ValueError(
            f"`spark_conf[{key!r}]` must be a number >= {minimum}; found {raw!r}. Fix or remove "
            f"the setting."
        )
    return number


def _check_feasible(num_proc: int, conf: dict[str, str]) -> None:
    """Refuse settings under which a barrier stage of ``num_proc`` tasks can never start."""
    if conf.get("spark.dynamicAllocation.enabled", "false").strip().lower() != "false":
        raise ValueError(
            f"`spark_conf` sets spark.dynamicAllocation.enabled="
            f"{conf['spark.dynamicAllocation.enabled']!r}, but a Spark barrier stage needs "
            f"'false' (all {num_proc} ranks start together). Remove the override."
        )
    instances = _conf_number(conf, "spark.executor.instances", int, "1", 1)
    cores = _conf_number(conf, "spark.executor.cores", int, "1", 1)
    task_cpus = _conf_number(conf, "spark.task.cpus", int, "1", 1)
    per_executor = cores // task_cpus
    limit = f"spark.executor.cores={cores} // spark.task.cpus={task_cpus}"
    task_gpus = _conf_number(conf, "spark.task.resource.gpu.amount", float, "0", 0)
    if task_gpus > 0:
        executor_gpus = _conf_number(conf, "spark.executor.resource.gpu.amount", int, "0", 0)
        # Spark allows fractions (0.5: two tasks per GPU); 1e-9 absorbs float rounding.
        gpu_slots = int(executor_gpus / task_gpus + 1e-9)
        if gpu_slots < per_executor:
            per_executor = gpu_slots
            limit = (
                f"spark.executor.resource.gpu.amount={executor_gpus} / "
                f"spark.task.resource.gpu.amount={conf['spark.task.resource.gpu.amount']}"
            )
    slots = instances * per_executor
    if slots < num_proc:
        raise ValueError(
            f"`num_proc`={num_proc} needs {num_proc} task slots, but `spark_conf` leaves "
            f"{slots}: spark.executor.instances={instances} x {per_executor} per executor "
            f"({limit}). Remove the overrides, or raise spark.executor.instances or the "
            f"per-executor resources."
        )


# -- the driver: sessions and the launch -----------------------------------------------------


class OutputSpec(Protocol):
    """What a rank needs to turn rank 0's return value into the task's outputs (each SDK's
    plugin has one): plain values, picklable, not the task object."""

    def rank_context(self) -> AbstractContextManager[Callable[[Any], bytes]]:
        """The SDK's task context on the rank; yields the encoder of rank 0's value."""
        ...


def pickle_body(
    task_name: str, fn: Callable[..., Any], kwargs: dict[str, Any], spec: OutputSpec
) -> bytes:
    """The body, its inputs and the output spec, pickled apart from the launcher's job so
    that a rank unpickles them only after it can import what the driver imports."""
    try:
        return cloudpickle.dumps((fn, kwargs, spec))
    except Exception as error:
        raise ValueError(
            f"the body of `{task_name}` or its inputs cannot be pickled "
            f"({type(error).__name__}: {error}); they travel to the ranks with cloudpickle. "
            f"Create objects such as locks, sockets, sessions or open files inside the task."
        ) from error


@dataclass(frozen=True)
class BodyResult:
    """What a task's launch gives back: rank 0's encoded outputs, every rank's host, and the
    epochs rank 0 recorded (``flyte_hvd.launch.progress``) for the task's report."""

    outputs: bytes
    hosts: list[str]
    epochs: list[progress.Epoch]


def launch_body(
    task_name: str,
    fn: Callable[..., Any],
    kwargs: dict[str, Any],
    spec: OutputSpec,
    config: BarrierTaskConfig,
    session: ConnectSparkSession | None = None,
) -> BodyResult:
    """Run ``fn(**kwargs)`` on ``config.num_proc`` ranks of the active session. ``session``,
    a Spark Connect session the task made active, stops being the active one afterwards
    (``release``)."""
    from flyte_hvd.stage.dispatch import run

    try:
        payload = pickle_body(task_name, fn, kwargs, spec)
        with launching_on(session):
            results = run(
                run_rank,
                args=(payload,),
                num_proc=config.num_proc,
                start_timeout=config.start_timeout,
            )
    finally:
        if session is not None:
            release(session)
    first = results[0]
    if not isinstance(first, dict) or first.get("outputs") is None:
        raise RuntimeError(
            "rank 0 sent back no outputs (found None where its encoded outputs were "
            "expected); the launcher's results are not in rank order. Report this as a bug."
        )
    return BodyResult(first["outputs"], [r["host"] for r in results], first["epochs"])


# How long ``release`` waits for the server to release a session before it closes the client.
RELEASE_SECONDS = 10.0


def connect_session(
    url: str, config: BarrierTaskConfig, code_dir: str | None = None
) -> ConnectSparkSession:
    """The Spark Connect session of ``url``, active in this thread, with the task's runtime
    settings and, when the task runs from shipped code (``code_dir``), that code as an
    artifact (Connect's ``addPyFile``). The session is the task's own, new even where the
    process has one active (``getOrCreate`` would hand back that one, whatever its URL), and
    ``release`` stops it: at the task's end (the plugins' ``execute``, the launch's end), or
    here when its settings are refused. Like
    any new session it becomes the active and default one where there is none."""
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    session = ConnectSession.builder.remote(url).create()
    try:
        _apply_runtime_settings(session, url, config, code_dir)
    except BaseException:
        release(session)
        raise
    return session


def _apply_runtime_settings(
    session: ConnectSparkSession, url: str, config: BarrierTaskConfig, code_dir: str | None
) -> None:
    """``connect_session``'s settings and shipped code on ``session``."""
    fixed = []
    for key, value in (config.spark_conf or {}).items():
        if session.conf.isModifiable(key):
            session.conf.set(key, value)
        else:
            fixed.append(key)
    if fixed:
        raise RuntimeError(
            f"`spark_conf` sets {sorted(fixed)}, which a Spark Connect session cannot change: "
            f"the cluster behind {url} fixed them when its server started. Set "
            f"them on that server, or remove them from `spark_conf` (only runtime settings "
            f"such as spark.sql.* apply over Spark Connect)."
        )
    if code_dir is not None:
        archive = shutil.make_archive(os.path.join(tempfile.mkdtemp(), "flyte_wf"), "zip", code_dir)
        session.addArtifacts(archive, pyfile=True)


def release(session: ConnectSparkSession) -> None:
    """The end of a task's Connect session (``connect_session``'s): it stops being the
    active one (``deactivate``), the server releases it and its client closes. Again on a
    released session: nothing more.

    Bounded: a client left open sends the server a clean-up at the process's exit, and
    pyspark retries that for about 10 minutes where the server is gone (a cluster that
    ended with the task's failure), so a task whose server was gone would hang at exit.
    Here the release gets ``RELEASE_SECONDS``; then the client closes without it (the server
    drops idle sessions itself) and the exit sends nothing."""
    deactivate(session)
    client = session.client
    if client.is_closed:  # released already (the launch's end, then the task's)
        return
    # In a thread of its own: pyspark's retries of an unanswered release are not bounded here.
    releasing = threading.Thread(
        target=_release_quietly, args=(client,), name="flyte-hvd-connect-release", daemon=True
    )
    releasing.start()
    releasing.join(RELEASE_SECONDS)
    if releasing.is_alive():
        logger.warning(
            "the Spark Connect server did not release this task's session within %.0f s "
            "(unreachable?); its client is closed without it, and the server drops the "
            "session when it times out.",
            RELEASE_SECONDS,
        )
    try:
        client.close()
    except Exception as error:  # a closed or broken channel: nothing left to close
        logger.debug("closing the Spark Connect client: %s", error)


def _release_quietly(client: Any) -> None:
    """``release``'s call to the server; its failure changes nothing for the task."""
    try:
        # The client releases each finished query's results in the background; a session
        # released before those arrive makes the server log an error per query.
        pending = list(getattr(client, "_release_futures", ()))
        concurrent.futures.wait(pending, timeout=RELEASE_SECONDS)
        client.release_session()
    except Exception as error:
        logger.debug("releasing the Spark Connect session: %s", error)


@contextmanager
def launching_on(session: ConnectSparkSession | None) -> Iterator[None]:
    """``session`` (when given) as this thread's active Connect session meanwhile, which is
    the one ``run`` launches on: Flyte 2 launches from a thread of its own, and a session the
    process already had stays the active one where it was."""
    if session is None:
        yield
        return
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    local = ConnectSession._active_session
    before = getattr(local, "session", None)
    local.session = session
    try:
        yield
    finally:
        local.session = before


def deactivate(session: ConnectSparkSession) -> None:
    """The Connect session a task made active stops being this thread's active one, so a
    later task in this process launches on its own session."""
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    if getattr(ConnectSession._active_session, "session", None) is session:
        ConnectSession._active_session.session = None
    if ConnectSession._default_session is session:
        ConnectSession._default_session = None


def start_local_session(app_name: str, config: BarrierTaskConfig) -> None:
    """Locally, the SparkSession the SDK would start, with a task slot per rank and this
    interpreter for Spark's Python workers; an active session is kept as it is (the
    launcher's preflight says if it has too few slots). A session started here serves the
    process's later tasks too and is stopped when the process exits: Spark's Python worker
    daemons then remove their Unix domain sockets, which a JVM ending with its process
    leaves in the temporary folder."""
    from pyspark.sql import SparkSession

    if SparkSession.getActiveSession() is not None:
        return
    conf = config.local_spark_conf
    builder = SparkSession.builder.appName(app_name).master(conf.pop("spark.master"))
    # As the SDKs do locally: bind to loopback, hand PYTHONPATH to the Python workers. Also
    # advertise loopback: the host's own address is not bound, so block fetches would fail.
    builder = builder.config("spark.driver.bindAddress", "127.0.0.1")
    builder = builder.config("spark.driver.host", "127.0.0.1")
    if "PYTHONPATH" in os.environ:
        builder = builder.config("spark.executorEnv.PYTHONPATH", os.environ["PYTHONPATH"])
    for key, value in conf.items():
        builder = builder.config(key, value)
    with _local_jvm_environment(sys.executable):
        session = builder.getOrCreate()
    atexit.register(_stop_at_exit, session)


def _stop_at_exit(session: SparkSession) -> None:
    """Stop ``session`` unless it was stopped already (and another perhaps started)."""
    from pyspark import SparkContext

    if SparkContext._active_spark_context is session.sparkContext:
        session.stop()


@contextmanager
def _local_jvm_environment(python: str) -> Iterator[None]:
    """The environment a local session's JVM and SparkContext start with. The SparkContext
    reads ``PYSPARK_PYTHON`` once, when it starts: its Python workers (and so the ranks) must
    be this interpreter, which has flyte_hvd, mpi4py and the user's code. The JVM binds
    Spark's UI (and its REST API, which lists every job) to ``SPARK_LOCAL_IP``, else to every
    interface: a local session keeps it on loopback, unless the variable is set already."""
    before = {name: os.environ.get(name) for name in ("PYSPARK_PYTHON", "SPARK_LOCAL_IP")}
    os.environ["PYSPARK_PYTHON"] = python
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# -- the ranks -------------------------------------------------------------------------------


def run_rank(payload: bytes) -> dict[str, Any]:
    """What every rank runs: init, the body (awaited if it is a coroutine function) inside the
    SDK's rank context, and its host; rank 0 also its outputs, encoded by the SDK's output
    spec, and the epochs it recorded. (The rank imports what the body needs through the
    import path the launcher gives it.)"""
    import flyte_hvd.core as hvd

    fn, kwargs, spec = cloudpickle.loads(payload)
    hvd.init()
    progress.reset()
    mine: dict[str, Any] = {"host": socket.gethostname()}
    with spec.rank_context() as encode:
        value = fn(**kwargs)
        if inspect.isawaitable(value):
            value = asyncio.run(_result(value))
        if hvd.rank() == 0:
            mine.update(outputs=encode(value), epochs=progress.epochs())
    return mine


async def _result(awaitable: Awaitable[T]) -> T:
    return await awaitable


def split_outputs(
    task_name: str, names: tuple[str, ...], value: UserValue, tuple_output: bool
) -> dict[str, UserValue]:
    """Rank 0's return value by output name; a wrong count names the outputs."""
    if not names:
        return {}
    if len(names) == 1:
        return {names[0]: value[0] if tuple_output and isinstance(value, tuple) else value}
    if not isinstance(value, tuple | list) or len(value) != len(names):
        raise ValueError(
            f"`{task_name}` declares {len(names)} outputs ({', '.join(names)}), but "
            f"rank 0 returned {type(value).__name__} {reprlib.repr(value)}; return a tuple of "
            f"{len(names)} values."
        )
    return dict(zip(names, value, strict=True))


def output_error(
    task_name: str, name: str, item: object, python_type: object, error: Exception
) -> ValueError:
    """The error for an output rank 0 returned that does not convert to its declared type."""
    return ValueError(
        f"output `{name}` of `{task_name}`: rank 0 returned "
        f"{type(item).__name__} {reprlib.repr(item)}, which does not convert to the "
        f"declared {python_type!r} ({type(error).__name__}: {error}). Return a value "
        f"of the declared type."
    )
