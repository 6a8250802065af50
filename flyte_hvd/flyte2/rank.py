"""The rank half of a Flyte 2 ``HorovodSpark`` task: Flyte 2's task context on each rank, and
how rank 0's return value becomes the task's outputs.

Rank 0 may run in an executor pod whose disk the driver cannot see, so it must not send back
a local path. Every rank runs the body in a task context like the driver's (the same action,
raw data path and checkpoint paths), so ``flyte.io.File.from_local_sync`` and
``File.new_remote`` on a rank write to the run's raw data path as they do in any task.
Rank 0 converts its return value to Flyte literals with the task's output types (a value of a
type Flyte pickles is uploaded from the rank); only the serialized ``LiteralMap`` travels back
to the driver, which turns it into Python values again for Flyte's runtime to record.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flyte_hvd.core.types import UserValue
from flyte_hvd.stage.flyte_task import output_error, split_outputs

if TYPE_CHECKING:
    from flyte.extend import AsyncFunctionTaskTemplate
    from flyte.storage import Storage

# The task context fields a rank's context copies from the driver's (the rest are the
# driver's own: its report, call counter, code bundle, controller data).
_CONTEXT_FIELDS = (
    "action",
    "version",
    "raw_data_path",
    "output_path",
    "run_base_dir",
    "checkpoint_paths",
    "mode",
    "custom_context",
    "run_start_time",
)


@dataclass(frozen=True)
class RankSpec:
    """What a rank needs to run the body in Flyte 2's task context and to turn rank 0's
    return value into the task's outputs: plain values, not the task object."""

    task_name: str
    output_types: dict[str, Any]  # output name -> its Python type (a class or typing form)
    context: dict[str, Any]  # the driver's TaskContext fields (`_CONTEXT_FIELDS`) by name
    storage: Storage | None  # ``flyte.init``'s blob store settings on the driver

    @classmethod
    def of(cls, task: AsyncFunctionTaskTemplate) -> RankSpec:
        import flyte
        from flyte._initialize import get_init_config

        tctx = flyte.ctx()
        init = get_init_config() if flyte.extend.is_initialized() else None
        return cls(
            task_name=task.name,
            output_types=dict(task.interface.outputs),
            context={k: getattr(tctx, k) for k in _CONTEXT_FIELDS} if tctx else {},
            storage=init.storage if init else None,
        )

    @contextmanager
    def rank_context(self) -> Iterator[Callable[[UserValue], bytes]]:
        """Flyte 2's task context on the rank (after ``flyte.init`` with the driver's storage
        settings); yields the encoder of rank 0's value: a serialized ``LiteralMap``."""
        import flyte
        from flyte._context import internal_ctx
        from flyte.models import TaskContext
        from flyte.report import Report

        if not flyte.extend.is_initialized():
            flyte.init(root_dir=os.getcwd(), storage=self.storage)
        if not self.context:  # the body was called outside a Flyte run
            yield self._encode
            return
        tctx = TaskContext(**self.context, report=Report(name=self.context["action"].name))
        with internal_ctx().replace_task_context(tctx):
            yield self._encode

    def _encode(self, value: UserValue) -> bytes:
        from flyteidl2.core import literals_pb2

        values = split_outputs(self.task_name, tuple(self.output_types), value, True)
        values = {name: _uploaded(item) for name, item in values.items()}
        literals = asyncio.run(self._to_literals(values))
        return literals_pb2.LiteralMap(literals=literals).SerializeToString()

    async def _to_literals(self, values: dict[str, Any]) -> dict[str, Any]:
        from flyte.types import TypeEngine

        literals = {}
        for name, item in values.items():
            python_type = self.output_types[name]
            try:
                literal_type = TypeEngine.to_literal_type(python_type)
                literals[name] = await TypeEngine.to_literal(item, python_type, literal_type)
            except Exception as error:
                raise output_error(self.task_name, name, item, python_type, error) from error
        return literals


def _uploaded(value: UserValue) -> UserValue:
    """``value`` with every ``flyte.io.File``/``Dir`` on this host's disk (outside the raw data
    path) copied to the run's raw data path, in dataclasses, pydantic models and containers
    too: Flyte references a local file in place when the raw data path is local, and the
    rank's folders are removed when it ends (in a pod, the driver could not read them)."""
    from flyte._context import internal_ctx
    from flyte.io import Dir, File
    from flyte.storage import is_remote
    from pydantic import BaseModel

    if isinstance(value, File | Dir):
        raw = internal_ctx().raw_data
        if is_remote(value.path) or os.path.abspath(value.path).startswith(raw.path):
            return value
        destination = raw.get_random_remote_path(os.path.basename(value.path.rstrip("/")))
        return type(value).from_local_sync(value.path, remote_destination=destination)
    if isinstance(value, BaseModel):
        changed = _changed(value, type(value).model_fields)
        return value.model_copy(update=changed) if changed else value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changed = _changed(value, [f.name for f in dataclasses.fields(value) if f.init])
        return dataclasses.replace(value, **changed) if changed else value
    if isinstance(value, dict):
        return {k: _uploaded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_uploaded(v) for v in value]
    if isinstance(value, tuple):
        items = [_uploaded(v) for v in value]
        return type(value)._make(items) if hasattr(value, "_make") else tuple(items)
    return value


def _changed(value: object, names: Iterable[str]) -> dict[str, UserValue]:
    updated = {name: _uploaded(getattr(value, name)) for name in names}
    return {name: v for name, v in updated.items() if v is not getattr(value, name)}


async def outputs_from_bytes(spec: RankSpec, payload: bytes) -> UserValue:
    """Rank 0's outputs as the task returns them: None, one value, or a tuple in the order
    of the declared outputs."""
    from flyte.types import TypeEngine
    from flyteidl2.core import literals_pb2

    literal_map = literals_pb2.LiteralMap.FromString(payload)
    values = await TypeEngine.literal_map_to_kwargs(literal_map, spec.output_types)
    if not values:
        return None
    if len(values) == 1:
        return next(iter(values.values()))
    return tuple(values[name] for name in spec.output_types)
