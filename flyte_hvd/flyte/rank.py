"""The rank half of a ``HorovodSpark`` task: what runs on every rank, and how rank 0 turns
its return value into the task's outputs.

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
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import cloudpickle
from flytekit import FlyteContextManager
from flytekit.core.context_manager import ExecutionParameters, ExecutionState, FlyteContext
from flytekit.models.literals import LiteralMap

from flyte_hvd.estimators import tracking
from flyte_hvd.launch import progress


@dataclass(frozen=True)
class RankSpec:
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
    def of(cls, task: Any, ctx: FlyteContext) -> RankSpec:
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


def run_rank(payload: bytes, mlflow_run: tracking.MlflowRun | None = None) -> dict[str, Any]:
    """What every rank runs: init, the body, and on rank 0 its outputs as literals. Every rank
    returns its host; rank 0 also the epochs it recorded (``flyte_hvd.launch.progress``), for
    the task's Deck. With MLflow tracking the run is rank 0's active run while the body runs.
    (The rank imports what the body needs through the import path the launcher gives it.)"""
    import flyte_hvd.core as hvd

    fn, kwargs, spec = cloudpickle.loads(payload)
    hvd.init()
    progress.reset()
    mine: dict[str, Any] = {"rank": hvd.rank(), "host": socket.gethostname()}
    mlflow = tracking.enter_rank(mlflow_run, hvd.rank()) if mlflow_run else None
    failed = True
    try:
        with _rank_context(spec) as ctx:
            value = fn(**kwargs)
            if hvd.rank() == 0:
                outputs = _to_literal_map(ctx, value, spec).to_flyte_idl().SerializeToString()
                mine.update(outputs=outputs, epochs=progress.epochs())
        failed = False
    finally:
        tracking.leave_rank(mlflow, failed)
    return mine


@contextmanager
def _rank_context(spec: RankSpec) -> Iterator[FlyteContext]:
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


def _to_literal_map(ctx: FlyteContext, value: Any, spec: RankSpec) -> LiteralMap:
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


def literal_map_from_bytes(payload: bytes | None) -> LiteralMap:
    from flyteidl.core import literals_pb2

    if payload is None:
        raise RuntimeError(
            "rank 0 sent back no outputs (found None where a serialized LiteralMap was "
            "expected); the launcher's results are not in rank order. Report this as a bug."
        )
    return LiteralMap.from_flyte_idl(literals_pb2.LiteralMap.FromString(payload))
