"""Horovod's TensorFlow collectives on ``tf.Tensor``, on the numpy core.

Each collective returns ``tf.Tensor`` and works eagerly and inside ``tf.function``. Eagerly the
tensor's numpy view goes straight to the core; in a graph the same code runs through one
``tf.numpy_function`` op (stateful, so it is never pruned or reordered across other
collectives). ``tf.numpy_function`` cannot be compiled by XLA: a ``tf.function`` that calls a
collective must not set ``jit_compile=True`` (Keras' ``model.fit`` already runs the optimizer
step outside XLA when ``DistributedOptimizer`` is used; see the README).

Gradients follow Horovod's registrations: allreduce -> allreduce of the gradient (same op and
scaling), allgather -> averaged gradient sliced back to this rank's rows, broadcast ->
averaged gradient on the root and zeros elsewhere, alltoall -> alltoall back, reducescatter ->
allgather of the gradient (times size for Sum).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from flyte_hvd.core import collectives, model_sync, state
from flyte_hvd.core.compression import Compression, Compressor
from flyte_hvd.core.errors import CollectiveMismatchError
from flyte_hvd.core.process_sets import ProcessSet
from flyte_hvd.core.reduce_ops import Average, ReduceOp, Sum
from flyte_hvd.core.types import UserValue


def check_process_set(process_set: object) -> None:
    """Only the global process set is supported here; ``None`` means it."""
    if process_set is None or getattr(process_set, "process_set_id", None) == 0:
        return
    raise ValueError(
        f"`process_set`={process_set!r}: flyte_hvd.tensorflow reduces over all ranks only; "
        f"pass `process_set=None` (or hvd.global_process_set)."
    )


def numpy_call(
    fn: Callable[..., Sequence[np.ndarray]],
    tensors: Sequence[tf.Tensor],
    dtypes: Sequence[tf.DType],
    name: str | None = None,
) -> list[tf.Tensor]:
    """``fn(*arrays) -> list of arrays`` on ``tensors``, as a list of tensors.

    Eagerly, ``fn`` gets the tensors' numpy views directly (no op, no copy on the CPU); in a
    graph it runs as one stateful ``tf.numpy_function``. Either way the result is a list, also
    for one output (``tf.numpy_function`` returns a bare tensor then).
    """
    fn = _tensorflow_errors(fn)
    if tf.executing_eagerly():
        arrays = fn(*[np.asarray(t) for t in tensors])
        return [tf.convert_to_tensor(a, dtype=d) for a, d in zip(arrays, dtypes, strict=True)]
    graph = tf.compat.v1.get_default_graph()
    # tf.function runs stateful ops in program order; a TF1 graph does not, so there each
    # collective waits for the one built before it (every rank builds the same graph).
    previous = None if tf.inside_function() else _LAST_COLLECTIVE.get(graph)
    with tf.control_dependencies([previous] if previous is not None else []):
        out = tf.numpy_function(
            lambda *arrays: list(fn(*arrays)),
            list(tensors),
            list(dtypes),
            stateful=True,
            name=_op_name(name),
        )
    out = list(out) if isinstance(out, list | tuple) else [out]
    if not tf.inside_function():
        _LAST_COLLECTIVE[graph] = out[0].op
    return out


_LAST_COLLECTIVE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class InvalidArgumentError(tf.errors.InvalidArgumentError, ValueError):
    """A collective's bad argument (e.g. rows that do not split evenly): TensorFlow's
    ``InvalidArgumentError``, as Horovod's ops raise eagerly and as a graph reports a
    ``ValueError``, and still a ``ValueError``."""


def _tensorflow_errors(
    fn: Callable[..., Sequence[np.ndarray]],
) -> Callable[..., Sequence[np.ndarray]]:
    """The core's errors as Horovod's TensorFlow ops raise them: ranks that disagree on a
    collective's arguments get ``FailedPreconditionError`` (with the core's one-line-per-rank
    message), a bad argument ``InvalidArgumentError``."""

    def call(*arrays):
        try:
            return fn(*arrays)
        except CollectiveMismatchError as error:
            raise tf.errors.FailedPreconditionError(None, None, str(error)) from error
        except ValueError as error:
            if isinstance(error, tf.errors.OpError):
                raise
            raise InvalidArgumentError(None, None, str(error)) from error

    return call


def _op_name(name: str | None) -> str | None:
    if not name:
        return None
    cleaned = "".join(c if c.isalnum() or c in "_-." else "_" for c in name)
    return cleaned if cleaned[:1].isalnum() else f"hvd_{cleaned}"


def resolve_op(average: bool | None, op: ReduceOp | None) -> ReduceOp:
    """Horovod's deprecated ``average=`` and ``op=`` are exclusive; neither means Average."""
    if average is not None and op is not None:
        raise ValueError("pass either `op` or the deprecated `average`, not both.")
    if op is not None:
        return ReduceOp(op)
    return Average if average is None or average else Sum


def _dtype(tensor: tf.Tensor) -> tf.DType:
    if tensor.dtype == tf.bfloat16:
        raise ValueError(
            "flyte_hvd.tensorflow collectives cannot take bfloat16 tensors (numpy has no "
            "bfloat16); cast first, e.g. `tf.cast(x, tf.float32)`."
        )
    return tensor.dtype


def allreduce(
    tensor: tf.Tensor,
    average: bool | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] = Compression.none,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: str | None = None,
    process_set: ProcessSet | None = None,
    ignore_name_scope: bool = False,
) -> tf.Tensor | tf.IndexedSlices:
    """Reduce ``tensor`` across ranks (``tf.IndexedSlices`` are gathered, as in Horovod)."""
    check_process_set(process_set)
    op = resolve_op(average, op)
    if isinstance(tensor, tf.IndexedSlices):
        # NotImplementedError, as Horovod raises for these.
        if op not in (Average, Sum):
            raise NotImplementedError(
                f"allreduce of IndexedSlices supports hvd.Average and hvd.Sum; found {op!r}. "
                f"Densify first (`tf.convert_to_tensor(slices)`) for other ops."
            )
        if prescale_factor != 1.0 or postscale_factor != 1.0:
            raise NotImplementedError(
                "allreduce of IndexedSlices takes no `prescale_factor`/`postscale_factor`; "
                "scale the values yourself or densify first."
            )
        values = allgather(tensor.values, name=name)
        indices = allgather(tensor.indices, name=name)
        if op == Average:
            values = values / tf.cast(state.size(), values.dtype)
        return tf.IndexedSlices(values, indices, dense_shape=tensor.dense_shape)
    return grouped_allreduce(
        [tensor],
        op=op,
        compression=compression,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        name=name,
    )[0]


def grouped_allreduce(
    tensors: Sequence[tf.Tensor],
    average: bool | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] = Compression.none,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: str | None = None,
    process_set: ProcessSet | None = None,
    ignore_name_scope: bool = False,
) -> list[tf.Tensor]:
    """Reduce many tensors in as few fused reductions as ``HOROVOD_FUSION_THRESHOLD`` allows."""
    check_process_set(process_set)
    op = resolve_op(average, op)
    tensors = list(tensors)
    out: list[tf.Tensor] = list(tensors)
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    for i, t in enumerate(tensors):
        if isinstance(t, tf.IndexedSlices):  # gathered, one by one, as Horovod does
            out[i] = allreduce(
                t,
                op=op,
                prescale_factor=prescale_factor,
                postscale_factor=postscale_factor,
                name=name,
            )
    if dense:
        arrays = [tf.convert_to_tensor(tensors[i]) for i in dense]
        reduced = _grouped_allreduce(
            arrays, op, compression, prescale_factor, postscale_factor, name
        )
        for i, t in zip(dense, reduced, strict=True):
            out[i] = t
    return out


def _grouped_allreduce(tensors, op, compression, prescale, postscale, name) -> list[tf.Tensor]:
    @tf.custom_gradient
    def forward(*xs):
        def reduce(*arrays):
            if all(a.dtype.kind in "fc" for a in arrays):
                return collectives.grouped_allreduce(
                    list(arrays),
                    op=op,
                    name=name,
                    compression=compression,
                    prescale_factor=prescale,
                    postscale_factor=postscale,
                )
            # Integers are scaled in floating point and cast back, as Horovod does.
            out = collectives.grouped_allreduce(
                [_scaled(a, prescale) for a in arrays], op=op, name=name, compression=compression
            )
            return [_scaled(a, postscale) for a in out]

        out = numpy_call(reduce, xs, [_dtype(x) for x in xs], name or "HorovodAllreduce")
        for y, x in zip(out, xs, strict=True):
            y.set_shape(x.shape)

        def grad(*dys):
            filled = [tf.zeros_like(x) if d is None else d for d, x in zip(dys, xs, strict=True)]
            return _grouped_allreduce(filled, op, Compression.none, prescale, postscale, name)

        return out, grad

    return list(forward(*tensors))


def allgather(
    tensor: tf.Tensor,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet | None = None,
) -> tf.Tensor:
    """Concatenate every rank's tensor along the first dimension (which may differ)."""
    check_process_set(process_set)
    return _bool_as_uint8(lambda t: _allgather(t, name), tf.convert_to_tensor(tensor))


def grouped_allgather(
    tensors: Sequence[tf.Tensor],
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet | None = None,
) -> list[tf.Tensor]:
    check_process_set(process_set)
    return [allgather(t, name) for t in tensors]


def _allgather(tensor: tf.Tensor, name: str | None) -> tf.Tensor:
    @tf.custom_gradient
    def forward(x):
        (y,) = numpy_call(
            lambda a: [collectives.allgather(a, name=name)],
            [x],
            [_dtype(x)],
            name or "HorovodAllgather",
        )
        y.set_shape(tf.TensorShape([None]).concatenate(x.shape[1:]) if x.shape.rank else [None])

        def grad(dy):
            rows = _allgather(tf.reshape(tf.shape(x, out_type=tf.int64)[:1], [1]), name)
            if x.shape.rank == 0:
                rows = tf.ones_like(rows)
            reduced = _grouped_allreduce([dy], Average, Compression.none, 1.0, 1.0, name)[0]
            start = tf.reduce_sum(rows[: state.rank()])
            mine = reduced[start : start + rows[state.rank()]]
            return tf.reshape(mine, tf.shape(x))

        return y, grad

    return forward(tensor)


def broadcast(
    tensor: tf.Tensor,
    root_rank: int,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet | None = None,
) -> tf.Tensor:
    """Every rank gets ``root_rank``'s tensor."""
    check_process_set(process_set)
    return _bool_as_uint8(lambda t: _broadcast(t, root_rank, name), tf.convert_to_tensor(tensor))


def _bool_as_uint8(collective: Callable[[tf.Tensor], tf.Tensor], tensor: tf.Tensor) -> tf.Tensor:
    """Booleans travel as uint8 (the core reduces numbers only); gather and broadcast
    take them as Horovod does."""
    if tensor.dtype != tf.bool:
        return collective(tensor)
    return tf.cast(collective(tf.cast(tensor, tf.uint8)), tf.bool)


def _broadcast(tensor: tf.Tensor, root_rank: int, name: str | None) -> tf.Tensor:
    @tf.custom_gradient
    def forward(x):
        (y,) = numpy_call(
            lambda a: [collectives.broadcast(a, root_rank, name=name)],
            [x],
            [_dtype(x)],
            name or "HorovodBroadcast",
        )
        y.set_shape(x.shape)

        def grad(dy):
            reduced = _grouped_allreduce([dy], Average, Compression.none, 1.0, 1.0, name)[0]
            return reduced if state.rank() == root_rank else reduced * 0

        return y, grad

    return forward(tensor)


def broadcast_(
    variables: Sequence[tf.Variable],
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet | None = None,
) -> list[tf.Tensor]:
    """Broadcast ``variables`` in place; returns their new values (in a graph, the
    assignments' values: evaluating them runs the broadcasts)."""
    check_process_set(process_set)
    if not tf.executing_eagerly():
        return [v.assign(broadcast(tf.convert_to_tensor(v), root_rank, name)) for v in variables]
    broadcast_variables(variables, root_rank)
    return [tf.convert_to_tensor(v) for v in variables]


def alltoall(
    tensor: tf.Tensor,
    splits: tf.Tensor | Sequence[int] | None = None,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet | None = None,
) -> tf.Tensor | tuple[tf.Tensor, tf.Tensor]:
    """Send ``splits[i]`` rows to rank ``i``; returns ``(received, received_splits)`` when
    ``splits`` is given, else the received rows only (Horovod's convention)."""
    check_process_set(process_set)
    tensor = tf.convert_to_tensor(tensor)
    wire = tf.cast(tensor, tf.uint8) if tensor.dtype == tf.bool else tensor
    out, received = _alltoall(wire, None if splits is None else tf.cast(splits, tf.int32), name)
    out = tf.cast(out, tf.bool) if tensor.dtype == tf.bool else out
    return (out, received) if splits is not None else out


def _alltoall(tensor: tf.Tensor, splits: tf.Tensor | None, name: str | None):
    def run(x, s):
        def exchange(a, *sp):
            out, rows = collectives.alltoall(a, None if not sp else sp[0], name=name)
            return [out, rows.astype(np.int32)]

        inputs = [x] if s is None else [x, s]
        y, rows = numpy_call(exchange, inputs, [_dtype(x), tf.int32], name or "HorovodAlltoall")
        y.set_shape(tf.TensorShape([None]).concatenate(x.shape[1:]))
        rows.set_shape([state.size()])
        return y, rows

    @tf.custom_gradient
    def forward(x):
        y, rows = run(x, splits)

        def grad(dy, _drows=None):
            return _alltoall(dy, rows, name)[0]

        return (y, rows), grad

    return forward(tensor)


def reducescatter(
    tensor: tf.Tensor,
    device_dense: str = "",
    compression: type[Compressor] = Compression.none,
    op: ReduceOp = Average,
    name: str | None = None,
    process_set: ProcessSet | None = None,
    ignore_name_scope: bool = False,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> tf.Tensor:
    """Reduce across ranks and give each rank its share of the first dimension."""
    check_process_set(process_set)
    return _reducescatter(
        tf.convert_to_tensor(tensor), ReduceOp(op), prescale_factor, postscale_factor, name
    )


def grouped_reducescatter(
    tensors: Sequence[tf.Tensor],
    device_dense: str = "",
    compression: type[Compressor] = Compression.none,
    op: ReduceOp = Average,
    name: str | None = None,
    process_set: ProcessSet | None = None,
    ignore_name_scope: bool = False,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[tf.Tensor]:
    check_process_set(process_set)
    op = ReduceOp(op)
    return [
        _reducescatter(tf.convert_to_tensor(t), op, prescale_factor, postscale_factor, name)
        for t in tensors
    ]


def _reducescatter(tensor, op, prescale, postscale, name) -> tf.Tensor:
    @tf.custom_gradient
    def forward(x):
        def scatter(a):
            out = collectives.reducescatter(_scaled(a, prescale), op=op, name=name)
            return [_scaled(out, postscale)]

        (y,) = numpy_call(scatter, [x], [_dtype(x)], name or "HorovodReducescatter")
        y.set_shape(tf.TensorShape([None]).concatenate(x.shape[1:]))

        def grad(dy):
            # As Horovod registers it: every rank's output gradient, gathered; scaled by
            # size for Sum.
            g = _allgather(dy, name)
            factor = prescale * postscale * (state.size() if op == Sum else 1)
            return g if factor == 1.0 else g * tf.cast(factor, g.dtype)

        return y, grad

    return forward(tensor)


def _scaled(array: np.ndarray, factor: float) -> np.ndarray:
    """``array * factor`` in the array's dtype; integers (and float16) are scaled in float64
    (float32) and cast back, as Horovod does."""
    if factor == 1.0:
        return array
    if array.dtype.kind in "iu":
        return (array.astype(np.float64) * factor).astype(array.dtype)
    if array.dtype == np.float16:
        return (array.astype(np.float32) * np.float32(factor)).astype(np.float16)
    return array * np.asarray(factor, array.dtype)


def broadcast_variables(
    variables: Sequence[tf.Variable],
    root_rank: int = 0,
    process_set: ProcessSet | None = None,
    inplace: bool = False,
) -> tf.Operation | None:
    """Set ``variables`` on every rank to ``root_rank``'s values.

    Eagerly: one broadcast per dtype, after checking that every rank passes the same shapes
    (an error names both ranks' variables). Inside ``tf.function``: one broadcast per
    variable, returned as a grouped op.
    """
    check_process_set(process_set)
    variables = list(variables)
    if not tf.executing_eagerly():
        return tf.group(
            *[v.assign(broadcast(tf.convert_to_tensor(v), root_rank)) for v in variables]
        )
    described = [(getattr(v, "path", v.name), tuple(v.shape), str(v.dtype)) for v in variables]
    # Shapes and dtypes must agree; names may not (Keras numbers layers per process).
    model_sync.check_same_tensors(described, root_rank, compare_names=False, noun="variable")
    values = [np.asarray(v.numpy()) for v in variables]
    model_sync.broadcast_by_dtype(
        values, root_rank, "broadcast_variables", lambda i, value: variables[i].assign(value)
    )
    return None


def broadcast_global_variables(root_rank: int) -> tf.Operation | None:
    """Broadcast ``tf.compat.v1.global_variables()`` (TF1 graphs only, as in Horovod)."""
    if tf.executing_eagerly():
        raise RuntimeError(
            "hvd.broadcast_global_variables() does not support eager execution (TF2 keeps no "
            "global variable collection); use `hvd.broadcast_variables(model.variables, "
            "root_rank)` or `hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank)`."
        )
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def broadcast_object(
    obj: UserValue,
    root_rank: int = 0,
    session: tf.compat.v1.Session | None = None,
    name: str | None = None,
    process_set: ProcessSet | None = None,
) -> UserValue:
    """Every rank gets ``root_rank``'s Python object (cloudpickled)."""
    check_process_set(process_set)
    return collectives.broadcast_object(obj, root_rank=root_rank, name=name)


def broadcast_object_fn(
    root_rank: int = 0,
    session: tf.compat.v1.Session | None = None,
    name: str | None = None,
    process_set: ProcessSet | None = None,
) -> Callable[[UserValue], UserValue]:
    check_process_set(process_set)
    return lambda obj: collectives.broadcast_object(obj, root_rank=root_rank, name=name)


def allgather_object(
    obj: UserValue,
    session: tf.compat.v1.Session | None = None,
    name: str | None = None,
    process_set: ProcessSet | None = None,
) -> list[UserValue]:
    """Every rank's Python object, in rank order."""
    check_process_set(process_set)
    return collectives.allgather_object(obj, name=name)


def join() -> tf.Tensor:
    """Wait for every rank; returns the rank that arrived last, as a tensor."""
    return tf.constant(collectives.join(), dtype=tf.int32)


def size_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    return tf.constant(state.size(), dtype=tf.int32, name=name)


def local_size_op(name: str | None = None) -> tf.Tensor:
    return tf.constant(state.local_size(), dtype=tf.int32, name=name)


def rank_op(name: str | None = None) -> tf.Tensor:
    return tf.constant(state.rank(), dtype=tf.int32, name=name)


def local_rank_op(name: str | None = None) -> tf.Tensor:
    return tf.constant(state.local_rank(), dtype=tf.int32, name=name)


def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    return tf.constant(1 if process_set_id == 0 else 0, dtype=tf.int32, name=name)
