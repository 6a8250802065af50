"""``HorovodSpark``: a Flyte Spark task whose function body runs on every rank.

``@task(task_config=HorovodSpark(num_proc=2))`` makes a flytekitplugins-spark task: on
Kubernetes it becomes a SparkApplication (the Spark operator reads ``get_custom``), under
``pyflyte run`` it gets a local SparkSession. Its body does not run on the Spark driver: the
driver starts ``num_proc`` ranks in one Spark barrier stage (``flyte_hvd.spark.run``), each
rank calls ``flyte_hvd.core.init()`` and then the body, and the task's outputs are rank 0's
return values. This module is the driver half; ``rank.py`` is what runs on the ranks.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import cloudpickle
from flytekit import FlyteContextManager, PodTemplate
from flytekit.configuration import SerializationSettings
from flytekit.core.context_manager import ExecutionParameters, ExecutionState, FlyteContext
from flytekit.extend import TaskPlugins
from flytekit.models.literals import LiteralMap
from flytekitplugins.spark.task import PysparkFunctionTask

from flyte_hvd.core.checks import require_int
from flyte_hvd.flyte.rank import RankSpec, literal_map_from_bytes, run_rank
from flyte_hvd.launch.supervisor import check_start_timeout

GPU_VENDOR = "nvidia.com"
# What a GPU executor pod gets besides its GPUs, as Spark's own Kubernetes settings: Flyte's
# Spark plugin copies no volumes from a pod template, so a memory-backed /dev/shm (NCCL and
# TensorFlow's input pipeline use it beyond the container default of 64 MiB) and the GPU node
# selector are Spark settings. Tolerations of GPU nodes' taints have no Spark setting; the
# ExtendedResourceToleration admission plugin adds them to pods that request nvidia.com/gpu.
GPU_EXECUTOR_CONF = {
    "spark.kubernetes.executor.volumes.emptyDir.dshm.mount.path": "/dev/shm",
    "spark.kubernetes.executor.volumes.emptyDir.dshm.options.medium": "Memory",
    "spark.kubernetes.executor.volumes.emptyDir.dshm.options.sizeLimit": "8Gi",
    "spark.kubernetes.executor.node.selector.nvidia.com/gpu.present": "true",
    "spark.executorEnv.TF_FORCE_GPU_ALLOW_GROWTH": "true",
}

# Spark's JVM talks to its Python workers over Unix domain sockets instead of TCP on loopback
# (Spark 4.1+; off by default): `transform`'s Arrow batches go both ways through them, and
# measured 1.25x the rows/s of TCP on 2 cores (430k -> 540k rows/s, 1 M rows, 20 features).
# The workers import pyspark from its installed package rather than from the archives Spark
# puts first on their path, which cost 0.11 s of CPU per task (see `worker_daemon`).
PYTHON_WORKER_CONF = {
    "spark.python.unix.domain.socket.enabled": "true",
    "spark.python.daemon.module": "flyte_hvd.spark.worker_daemon",
}


@dataclass(frozen=True)
class HorovodSpark:
    """Task config for ``num_proc`` ranks in one Spark barrier stage.

    It mirrors ``flytekitplugins.spark.Spark`` field for field (``Spark`` is not frozen, so a
    frozen config cannot extend it) and derives the Spark settings a barrier stage needs from
    ``num_proc``: one executor per rank with ``cores_per_rank`` cores, ``spark.task.cpus`` of
    the same, dynamic allocation off, Python workers on Unix domain sockets that import
    pyspark from its installed package (``PYTHON_WORKER_CONF``), and ``gpus_per_rank`` GPUs
    per executor and task. Keys in ``spark_conf`` override the derived ones; a ``spark_conf``
    that leaves fewer than ``num_proc`` task slots is refused here rather than at run time.

    For GPUs on Kubernetes also set ``spark.executor.resource.gpu.discoveryScript`` (the path
    in your Spark image) in ``spark_conf``; the executors get a memory-backed ``/dev/shm`` and
    a GPU node selector (``GPU_EXECUTOR_CONF``) as Spark settings, since Flyte's Spark plugin
    copies no volumes from ``executor_pod``. Locally the GPU settings are left out unless
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
        spark_conf: Spark settings; override the derived ones.
        hadoop_conf, executor_path, applications_path, driver_pod, executor_pod: as in
            ``flytekitplugins.spark.Spark``.
        start_timeout: seconds for scheduling plus rendezvous (``flyte_hvd.spark.run``).
        cores_per_rank: CPU cores reserved per rank.
        gpus_per_rank: GPUs per rank; 0 requests none.
        connect_url: a Spark Connect endpoint (``sc://...``) to run on instead of a session
            of the task's own.
    """

    num_proc: int
    spark_conf: dict[str, str] | None = None
    hadoop_conf: dict[str, str] | None = None
    executor_path: str | None = None
    applications_path: str | None = None
    driver_pod: PodTemplate | None = None
    executor_pod: PodTemplate | None = None
    start_timeout: float | None = None
    cores_per_rank: int = 1
    gpus_per_rank: int = 0
    connect_url: str | None = None

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
            if value is not None and not isinstance(value, PodTemplate):
                raise ValueError(
                    f"`{name}` must be a flytekit.PodTemplate or None; found "
                    f"{type(value).__name__}."
                )
        url = self.connect_url
        if url is not None and (not isinstance(url, str) or not url.startswith("sc://")):
            raise ValueError(
                f"`connect_url` must be a Spark Connect URL such as 'sc://host:15002' or None; "
                f"found {url!r}."
            )
        # Frozen: normalize through object.__setattr__, on copies the caller cannot mutate.
        object.__setattr__(self, "spark_conf", _string_map("spark_conf", self.spark_conf))
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
        return {**self.derived_spark_conf(), **(self.spark_conf or {})}

    @property
    def local_spark_conf(self) -> dict[str, str]:
        """Settings for a local SparkSession: GPU settings only where ``spark_conf`` names
        them, and a ``local[N]`` master with a task slot per rank unless it names one."""
        conf = {**self.derived_spark_conf(gpus=False), **(self.spark_conf or {})}
        task_cpus = int(conf["spark.task.cpus"])
        conf.setdefault("spark.master", f"local[{self.num_proc * task_cpus}]")
        return conf


def _string_map(name: str, value: Any) -> dict[str, str]:
    """Spark and Hadoop settings are strings; numbers and booleans are written as Spark
    spells them (``2``, ``true``) so ``{"spark.executor.cores": 2}`` works."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(
            f"`{name}` must be a dict of setting names to values; found {type(value).__name__}."
        )
    out: dict[str, str] = {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise ValueError(f"`{name}` keys must be str; found {key!r} ({type(key).__name__}).")
        if isinstance(item, bool):
            out[key] = "true" if item else "false"
        elif isinstance(item, str | int | float):
            out[key] = str(item)
        else:
            raise ValueError(
                f"`{name}[{key!r}]` must be a str, int, float or bool; found {item!r} "
                f"({type(item).__name__})."
            )
    return out


def _conf_number(conf: dict[str, str], key: str, kind: type, default: str, minimum: float) -> Any:
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


# -- the task --------------------------------------------------------------------------------


class HorovodSparkFunctionTask(PysparkFunctionTask):
    """A Spark task whose body runs on ``num_proc`` ranks; outputs are rank 0's."""

    def __init__(
        self, task_config: HorovodSpark, task_function: Callable[..., Any], **kwargs: Any
    ) -> None:
        if not isinstance(task_config, HorovodSpark):
            raise ValueError(
                f"`task_config` must be a HorovodSpark; found {type(task_config).__name__}."
            )
        super().__init__(task_config=task_config, task_function=task_function, **kwargs)

    def get_custom(self, settings: SerializationSettings) -> dict[str, Any]:
        """The SparkJob of flytekitplugins-spark, with the derived barrier settings."""
        custom = super().get_custom(settings)
        custom["sparkConf"] = self.task_config.effective_spark_conf
        return custom

    def pre_execute(self, user_params: ExecutionParameters) -> ExecutionParameters:
        """Locally, start the SparkSession flytekit would start, with a task slot per rank
        and this interpreter for Spark's Python workers; an active session is reused as it
        is (the launcher's preflight says if it has too few slots). Then flytekit's own
        ``pre_execute`` picks the session up."""
        ctx = FlyteContextManager.current_context()
        state = ctx.execution_state
        url = self.task_config.connect_url
        if url is not None:
            self.sess = _connect_session(url, self.task_config, ctx)
            return user_params.builder().add_attr("SPARK_SESSION", self.sess).build()
        if not (state and state.mode == ExecutionState.Mode.TASK_EXECUTION):
            _start_local_session(f"FlyteSpark: {user_params.execution_id}", self.task_config)
        return super().pre_execute(user_params)

    def execute(self, **kwargs: Any) -> LiteralMap:
        """Run the body on every rank and return rank 0's outputs as Flyte literals."""
        from flyte_hvd.spark import run
        from flyte_hvd.spark.pipeline import logged_interrupt

        ctx = FlyteContextManager.current_context()
        try:
            payload = _pickle_body(self, kwargs, RankSpec.of(self, ctx))
            results = run(
                run_rank,
                args=(payload,),
                num_proc=self.task_config.num_proc,
                start_timeout=self.task_config.start_timeout,
            )
        except KeyboardInterrupt as interrupt:
            if not logged_interrupt(interrupt):
                raise
            # Ctrl-C stopped the ranks and said so: end as a command ends on Ctrl-C (130),
            # where click (`pyflyte run`) would print "Aborted!" and exit 1.
            raise SystemExit(130) from None
        finally:
            if self.task_config.connect_url is not None:
                _deactivate(self.sess)
        return literal_map_from_bytes(results[0])


def _pickle_body(task: HorovodSparkFunctionTask, kwargs: dict[str, Any], spec: RankSpec) -> bytes:
    """The body, its inputs and the output spec, pickled apart from the launcher's job so
    that a rank unpickles them only after it can import what the driver imports."""
    try:
        return cloudpickle.dumps((task._task_function, kwargs, spec))
    except Exception as error:
        raise ValueError(
            f"the body of `{task.name}` or its inputs cannot be pickled "
            f"({type(error).__name__}: {error}); they travel to the ranks with cloudpickle. "
            f"Create objects such as locks, sockets, sessions or open files inside the task."
        ) from error


def _connect_session(url: str, config: HorovodSpark, ctx: FlyteContext) -> Any:
    """The Spark Connect session of ``url``, active in this thread, with the
    task's runtime settings and, in a fast-registered pod, the task's code as an artifact
    (Connect's ``addPyFile``)."""
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    session = ConnectSession.builder.remote(url).getOrCreate()
    ConnectSession._set_default_and_active_session(session)
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
    fast = ctx.serialization_settings and ctx.serialization_settings.fast_serialization_settings
    state = ctx.execution_state
    if fast and fast.enabled and state and state.mode == ExecutionState.Mode.TASK_EXECUTION:
        archive = shutil.make_archive(
            os.path.join(tempfile.mkdtemp(), "flyte_wf"), "zip", os.getcwd()
        )
        session.addArtifacts(archive, pyfile=True)
    return session


def _deactivate(session: Any) -> None:
    """The Connect session a task made active stops being this thread's active one, so a
    later task in this process launches on its own session."""
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    if getattr(ConnectSession._active_session, "session", None) is session:
        ConnectSession._active_session.session = None
    if ConnectSession._default_session is session:
        ConnectSession._default_session = None


def _start_local_session(app_name: str, config: HorovodSpark) -> None:
    from pyspark.sql import SparkSession

    if SparkSession.getActiveSession() is not None:
        return
    conf = config.local_spark_conf
    builder = SparkSession.builder.appName(app_name).master(conf.pop("spark.master"))
    # As flytekit does locally: bind to loopback, hand PYTHONPATH to the Python workers. Also
    # advertise loopback: the host's own address is not bound, so block fetches would fail.
    builder = builder.config("spark.driver.bindAddress", "127.0.0.1")
    builder = builder.config("spark.driver.host", "127.0.0.1")
    if "PYTHONPATH" in os.environ:
        builder = builder.config("spark.executorEnv.PYTHONPATH", os.environ["PYTHONPATH"])
    for key, value in conf.items():
        builder = builder.config(key, value)
    with _pyspark_python(sys.executable):
        builder.getOrCreate()


@contextmanager
def _pyspark_python(executable: str) -> Iterator[None]:
    """The SparkContext reads ``PYSPARK_PYTHON`` once, when it starts: its Python workers (and
    so the ranks) must be this interpreter, which has flyte_hvd, mpi4py and the user's code."""
    before = os.environ.get("PYSPARK_PYTHON")
    os.environ["PYSPARK_PYTHON"] = executable
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PYSPARK_PYTHON", None)
        else:
            os.environ["PYSPARK_PYTHON"] = before


# Inject the plugin into flytekit's dynamic plugin loading, as flytekitplugins-spark does.
TaskPlugins.register_pythontask_plugin(HorovodSpark, HorovodSparkFunctionTask)
