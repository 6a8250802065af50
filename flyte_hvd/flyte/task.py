"""``HorovodSpark``: a Flyte Spark task whose function body runs on every rank.

``@task(task_config=HorovodSpark(num_proc=2))`` makes a flytekitplugins-spark task: on
Kubernetes it becomes a SparkApplication (the Spark operator reads ``get_custom``), under
``pyflyte run`` it gets a local SparkSession. Its body does not run on the Spark driver: the
driver starts ``num_proc`` ranks in one Spark barrier stage (``flyte_hvd.spark.run``), each
rank calls ``flyte_hvd.core.init()`` and then the body, and the task's outputs are rank 0's
return values.

How rank 0's return value becomes the task's outputs: rank 0 may run in an executor pod whose
disk the driver cannot see, so it must not send back a local path. Rank 0 converts its return
value to Flyte literals itself, with the task's output types and a ``FileAccessProvider`` on the
execution's raw output prefix: a ``FlyteFile``, ``FlyteDirectory``, DataFrame or pickle it
returns is uploaded there from the rank, as a non-Spark task's outputs are uploaded from its
container. Only the serialized ``LiteralMap`` travels back to the driver (through the
launcher's pickled result), and ``execute`` returns that map, which flytekit's
``dispatch_execute`` passes through unchanged. The rank's context runs in ``TASK_EXECUTION``
mode, so files are uploaded in local runs too (to the local raw output prefix) and a file left
in the rank's working directory, which is removed when the rank ends, is never referenced.
"""

from __future__ import annotations

import os
import reprlib
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import cloudpickle
from flytekit import FlyteContextManager, PodTemplate
from flytekit.configuration import SerializationSettings
from flytekit.core.context_manager import ExecutionParameters, ExecutionState, FlyteContext
from flytekit.extend import TaskPlugins
from flytekit.models.literals import LiteralMap
from flytekitplugins.spark.task import PysparkFunctionTask

GPU_VENDOR = "nvidia.com"


@dataclass(frozen=True)
class HorovodSpark:
    """Task config for ``num_proc`` ranks in one Spark barrier stage.

    It mirrors ``flytekitplugins.spark.Spark`` field for field (``Spark`` is not frozen, so a
    frozen config cannot extend it) and derives the Spark settings a barrier stage needs from
    ``num_proc``: one executor per rank with ``cores_per_rank`` cores, ``spark.task.cpus`` of
    the same, dynamic allocation off, and ``gpus_per_rank`` GPUs per executor and task. Keys in
    ``spark_conf`` override the derived ones; a ``spark_conf`` that leaves fewer than
    ``num_proc`` task slots is refused here rather than at run time.

    For GPUs on Kubernetes also set ``spark.executor.resource.gpu.discoveryScript`` (the path
    in your Spark image) in ``spark_conf``. Locally the GPU settings are left out unless
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
        _check_int("num_proc", self.num_proc, minimum=1)
        _check_int("cores_per_rank", self.cores_per_rank, minimum=1)
        _check_int("gpus_per_rank", self.gpus_per_rank, minimum=0)
        timeout = self.start_timeout
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0
        ):
            raise ValueError(
                f"`start_timeout` must be seconds > 0 or None; found {timeout!r}. "
                f"Pass e.g. start_timeout=120."
            )
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
        }
        if gpus and self.gpus_per_rank:
            conf["spark.executor.resource.gpu.amount"] = str(self.gpus_per_rank)
            conf["spark.task.resource.gpu.amount"] = str(self.gpus_per_rank)
            conf["spark.executor.resource.gpu.vendor"] = GPU_VENDOR
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


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(
            f"`{name}` must be an int >= {minimum}; found {value!r} ({type(value).__name__})."
        )
    if value < minimum:
        raise ValueError(f"`{name}` must be >= {minimum}; found {value}.")


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

        ctx = FlyteContextManager.current_context()
        try:
            payload = _pickle_body(self, kwargs, _RankSpec.of(self, ctx))
            results = run(
                _run_rank,
                args=(payload, _import_paths()),
                num_proc=self.task_config.num_proc,
                start_timeout=self.task_config.start_timeout,
            )
        finally:
            if self.task_config.connect_url is not None:
                _deactivate(self.sess)
        return _literal_map_from_bytes(results[0])


def _pickle_body(task: HorovodSparkFunctionTask, kwargs: dict[str, Any], spec: _RankSpec) -> bytes:
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


def _import_paths() -> list[str]:
    """The driver's import path beyond the interpreter's own (the project root that pyflyte
    or pytest added, the script's folder): without it a rank cannot import the module that
    defines the task's output types or helpers, which cloudpickle sends by reference."""
    own = tuple(os.path.abspath(p) for p in {sys.prefix, sys.base_prefix, sys.exec_prefix})
    paths = []
    for entry in sys.path:
        path = os.path.abspath(entry or os.getcwd())
        if not path.startswith(own) and path not in paths:
            paths.append(path)
    return paths


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


# -- inside a rank ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _RankSpec:
    """What a rank needs to turn rank 0's return value into the task's outputs: plain values
    (types and serialized literal types), not the task object."""

    task_name: str
    output_names: tuple[str, ...]
    output_types: dict[str, Any]
    literal_types: dict[str, bytes]
    tuple_output: bool
    raw_output_prefix: str
    execution_id: Any
    task_id: Any

    @classmethod
    def of(cls, task: HorovodSparkFunctionTask, ctx: FlyteContext) -> _RankSpec:
        params = ctx.user_space_params
        outputs = task.interface.outputs
        return cls(
            task_name=task.name,
            output_names=tuple(outputs),
            output_types=dict(task.python_interface.outputs),
            literal_types={
                k: v.type.to_flyte_idl().SerializeToString() for k, v in outputs.items()
            },
            tuple_output=bool(task.python_interface.output_tuple_name),
            raw_output_prefix=ctx.file_access.raw_output_prefix,
            execution_id=params.execution_id if params else None,
            task_id=params.task_id if params else None,
        )


def _run_rank(payload: bytes, import_paths: list[str]) -> bytes | None:
    """What every rank runs: init, the body, and on rank 0 its outputs as literals."""
    import flyte_hvd.core as hvd

    sys.path[:0] = [p for p in import_paths if p not in sys.path and os.path.isdir(p)]
    fn, kwargs, spec = cloudpickle.loads(payload)
    hvd.init()
    with _rank_context(spec) as ctx:
        value = fn(**kwargs)
        if hvd.rank() != 0:
            return None
        return _to_literal_map(ctx, value, spec).to_flyte_idl().SerializeToString()


@contextmanager
def _rank_context(spec: _RankSpec) -> Iterator[FlyteContext]:
    """A task-execution context in the rank: its own working directory (removed afterwards)
    and uploads to the execution's raw output prefix, with this host's data config."""
    from flytekit.core.data_persistence import FileAccessProvider
    from flytekit.core.mock_stats import MockStats
    from flytekit.loggers import user_space_logger

    sandbox = tempfile.mkdtemp(prefix="flyte-hvd-rank-")
    try:
        workdir = os.path.join(sandbox, "user_space")
        os.makedirs(workdir)
        file_access = FileAccessProvider(
            local_sandbox_dir=sandbox, raw_output_prefix=spec.raw_output_prefix
        )
        params = ExecutionParameters(
            execution_date=datetime.now(UTC),
            tmp_dir=workdir,
            stats=MockStats(),
            execution_id=spec.execution_id,
            logging=user_space_logger,
            raw_output_prefix=spec.raw_output_prefix,
            task_id=spec.task_id,
        )
        state = ExecutionState(
            working_dir=workdir,
            mode=ExecutionState.Mode.TASK_EXECUTION,
            user_space_params=params,
        )
        builder = (
            FlyteContextManager.current_context()
            .with_file_access(file_access)
            .with_execution_state(state)
        )
        with FlyteContextManager.with_context(builder) as ctx:
            yield ctx
    finally:
        shutil.rmtree(sandbox, ignore_errors=True)


def _to_literal_map(ctx: FlyteContext, value: Any, spec: _RankSpec) -> LiteralMap:
    from flyteidl.core import types_pb2
    from flytekit.core.type_engine import TypeEngine
    from flytekit.models.types import LiteralType

    names = spec.output_names
    if not names:
        values: dict[str, Any] = {}
    elif len(names) == 1:
        single = value[0] if spec.tuple_output and isinstance(value, tuple) else value
        values = {names[0]: single}
    else:
        if not isinstance(value, tuple | list) or len(value) != len(names):
            raise ValueError(
                f"`{spec.task_name}` declares {len(names)} outputs ({', '.join(names)}), but "
                f"rank 0 returned {type(value).__name__} {reprlib.repr(value)}; return a tuple of "
                f"{len(names)} values."
            )
        values = dict(zip(names, value, strict=True))
    literals = {}
    for name, item in values.items():
        python_type = spec.output_types[name]
        literal_type = LiteralType.from_flyte_idl(
            types_pb2.LiteralType.FromString(spec.literal_types[name])
        )
        try:
            literals[name] = TypeEngine.to_literal(ctx, item, python_type, literal_type)
        except Exception as error:
            raise ValueError(
                f"output `{name}` of `{spec.task_name}`: rank 0 returned "
                f"{type(item).__name__} {reprlib.repr(item)}, which does not convert to the "
                f"declared {python_type!r} ({type(error).__name__}: {error}). Return a value "
                f"of the declared type."
            ) from error
    return LiteralMap(literals=literals)


def _literal_map_from_bytes(payload: bytes | None) -> LiteralMap:
    from flyteidl.core import literals_pb2

    if payload is None:
        raise RuntimeError(
            "rank 0 sent back no outputs (found None where a serialized LiteralMap was "
            "expected); the launcher's results are not in rank order. Report this as a bug."
        )
    return LiteralMap.from_flyte_idl(literals_pb2.LiteralMap.FromString(payload))


# Inject the plugin into flytekit's dynamic plugin loading, as flytekitplugins-spark does.
TaskPlugins.register_pythontask_plugin(HorovodSpark, HorovodSparkFunctionTask)
