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
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from flytekit import FlyteContextManager
from flytekit.core.context_manager import ExecutionParameters, ExecutionState, FlyteContext
from flytekit.models.literals import LiteralMap

from flyte_hvd.core.types import UserValue

if TYPE_CHECKING:
    from flytekit.core.python_function_task import PythonFunctionTask
    from flytekit.models.core.identifier import Identifier, WorkflowExecutionIdentifier

from flyte_hvd.estimators import tracking
from flyte_hvd.stage.flyte_task import output_error, split_outputs


@dataclass(frozen=True)
class RankSpec:
    """What a rank needs to turn rank 0's return value into the task's outputs: plain values
    (types and serialized literal types), not the task object."""

    task_name: str
    output_names: tuple[str, ...]
    output_types: dict[str, Any]  # output name -> its Python type (a class or typing form)
    literal_types: dict[str, bytes]
    tuple_output: bool
    raw_output_prefix: str
    execution_id: WorkflowExecutionIdentifier | None
    task_id: Identifier | None
    # With MLflow tracking: the run rank 0 logs into (its active run while the body runs).
    mlflow_run: tracking.MlflowRun | None = None

    @classmethod
    def of(cls, task: PythonFunctionTask, ctx: FlyteContext) -> RankSpec:
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

    @contextmanager
    def rank_context(self) -> Iterator[Callable[[UserValue], bytes]]:
        """flytekit's task context on the rank, and the MLflow run when tracked; yields the
        encoder of rank 0's value: its outputs as a serialized ``LiteralMap``."""
        import flyte_hvd.core as hvd

        mlflow = tracking.enter_rank(self.mlflow_run, hvd.rank()) if self.mlflow_run else None
        failed = True
        try:
            with _rank_context(self) as ctx:
                yield (
                    lambda value: (
                        _to_literal_map(ctx, value, self).to_flyte_idl().SerializeToString()
                    )
                )
            failed = False
        finally:
            tracking.leave_rank(mlflow, failed)


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


def _to_literal_map(ctx: FlyteContext, value: UserValue, spec: RankSpec) -> LiteralMap:
    from flyteidl.core import types_pb2
    from flytekit.core.type_engine import TypeEngine
    from flytekit.models.types import LiteralType

    values = split_outputs(spec.task_name, spec.output_names, value, spec.tuple_output)
    literals = {}
    for name, item in values.items():
        python_type = spec.output_types[name]
        literal_type = LiteralType.from_flyte_idl(
            types_pb2.LiteralType.FromString(spec.literal_types[name])
        )
        try:
            literals[name] = TypeEngine.to_literal(ctx, item, python_type, literal_type)
        except Exception as error:
            raise output_error(spec.task_name, name, item, python_type, error) from error
    return LiteralMap(literals=literals)


def literal_map_from_bytes(payload: bytes) -> LiteralMap:
    from flyteidl.core import literals_pb2

    return LiteralMap.from_flyte_idl(literals_pb2.LiteralMap.FromString(payload))
