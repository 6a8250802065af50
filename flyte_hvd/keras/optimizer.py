"""``DistributedOptimizer`` for Keras 3 (TensorFlow backend) and variable broadcast.

Gradients of a step are averaged across ranks before the wrapped optimizer applies them, in
one ``grouped_allreduce`` (fused up to ``HOROVOD_FUSION_THRESHOLD``) run through
``tf.numpy_function``, so it works in ``model.fit`` (graph mode) and in custom loops alike.
Sparse gradients (``IndexedSlices``, from embeddings) are densified before the reduction: the
result is exact, and on the data-parallel models this targets the dense size is small.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from flyte_hvd.core import collectives, state
from flyte_hvd.core.collectives import Average, ReduceOp, Sum
from flyte_hvd.core.compression import Compression, Compressor


@dataclass(frozen=True)
class _Settings:
    compression: type[Compressor]
    backward_passes_per_step: int
    average_aggregated_gradients: bool
    op: ReduceOp
    gradient_predivide_factor: float


class _Accumulators:
    """Local gradient sums for ``backward_passes_per_step > 1``. A plain holder, so Keras does
    not track these as optimizer variables (checkpoints stay loadable as the base class)."""

    def __init__(self) -> None:
        self.grads: list[tf.Variable] = []
        self.count: tf.Variable | None = None


class _DistributedMixin:
    _hvd: _Settings
    _hvd_acc: _Accumulators

    def build(self, variables):
        super().build(variables)
        self._hvd_accumulators(variables)

    def _hvd_accumulators(self, variables) -> _Accumulators:
        acc = self._hvd_acc
        if self._hvd.backward_passes_per_step > 1 and not acc.grads:
            acc.grads = [
                tf.Variable(tf.zeros_like(v), trainable=False, name="hvd_grad_sum")
                for v in variables
            ]
            acc.count = tf.Variable(0, dtype=tf.int64, trainable=False)
        return acc

    def apply(self, grads, trainable_variables=None):
        settings = self._hvd
        if settings.backward_passes_per_step == 1:
            return super().apply(_allreduce_gradients(grads, settings), trainable_variables)
        if trainable_variables is not None and not self.built:
            self.build(list(trainable_variables))
        acc = self._hvd_accumulators(
            self._trainable_variables if trainable_variables is None else trainable_variables
        )
        for g, a in zip(grads, acc.grads, strict=True):
            if g is not None:
                a.assign_add(tf.convert_to_tensor(g))
        acc.count.assign_add(1)

        def reduce_and_apply():
            summed = [a.read_value() for a in acc.grads]
            if settings.average_aggregated_gradients:
                summed = [s / settings.backward_passes_per_step for s in summed]
            reduced = _allreduce_gradients(summed, settings)
            super(_DistributedMixin, self).apply(reduced, trainable_variables)
            for a in acc.grads:
                a.assign(tf.zeros_like(a))
            return tf.constant(True)

        # Every rank counts the same local steps, so all take the same branch.
        tf.cond(
            acc.count % settings.backward_passes_per_step == 0,
            reduce_and_apply,
            lambda: tf.constant(False),
        )
        return None


def _allreduce_gradients(grads, settings: _Settings) -> list:
    """Average ``grads`` (tensors, IndexedSlices or None) across ranks, in one fused call."""
    if state.size() == 1:
        return list(grads)
    positions = [i for i, g in enumerate(grads) if g is not None]
    dense = [tf.convert_to_tensor(grads[i]) for i in positions]  # densifies IndexedSlices
    if not dense:
        return list(grads)
    op, pre, post = _scaling(settings)

    def reduce(*arrays: np.ndarray) -> list[np.ndarray]:
        return collectives.grouped_allreduce(
            list(arrays),
            op=op,
            name="DistributedOptimizer",
            compression=settings.compression,
            prescale_factor=pre,
            postscale_factor=post,
        )

    reduced = tf.numpy_function(reduce, dense, [t.dtype for t in dense], stateful=True)
    out = list(grads)
    for i, tensor, original in zip(positions, reduced, dense, strict=True):
        tensor.set_shape(original.shape)
        out[i] = tensor
    return out


def _scaling(settings: _Settings) -> tuple[ReduceOp, float, float]:
    """Horovod's ``gradient_predivide_factor``: divide by f before the sum, by size/f after."""
    f = settings.gradient_predivide_factor
    if settings.op == Average and f != 1.0:
        return Sum, 1.0 / f, f / state.size()
    return settings.op, 1.0, 1.0


def DistributedOptimizer(
    optimizer: keras.optimizers.Optimizer,
    compression: type[Compressor] = Compression.none,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    op: ReduceOp = Average,
    gradient_predivide_factor: float = 1.0,
    name: str | None = None,
) -> keras.optimizers.Optimizer:
    """Make ``optimizer`` average gradients across ranks before applying them.

    The optimizer is wrapped in place and returned: its state (iterations, slots) is kept, and
    it still saves as its own class, so checkpoints load with plain ``keras.models.load_model``.

    Args:
        backward_passes_per_step: accumulate this many local steps before one reduction.
        average_aggregated_gradients: divide the accumulated sum by ``backward_passes_per_step``.
        op: ``Average`` (default) or ``Sum``.
        gradient_predivide_factor: with ``Average``, divide by this before the sum and by
            ``size / factor`` after (for numerically large gradients).
        name: accepted for Horovod compatibility; the optimizer keeps its own name.
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ValueError(
            f"DistributedOptimizer wraps a Keras 3 optimizer (keras.optimizers.Optimizer, e.g. "
            f"keras.optimizers.SGD(0.01)); found {type(optimizer).__module__}."
            f"{type(optimizer).__name__}."
        )
    collectives.check_optimizer_args(backward_passes_per_step, op, gradient_predivide_factor)
    state.comm()  # fail now, with the init() message, rather than inside a traced step
    base = type(optimizer)
    if issubclass(base, _DistributedMixin):
        base = base.__mro__[2]
    # Same module and name as the base, so Keras serializes it as the base class.
    distributed = type(base.__name__, (_DistributedMixin, base), {"__module__": base.__module__})
    optimizer.__class__ = distributed
    optimizer._hvd = _Settings(
        compression, backward_passes_per_step, average_aggregated_gradients, ReduceOp(op),
        float(gradient_predivide_factor),
    )  # fmt: skip
    optimizer._hvd_acc = _Accumulators()
    return optimizer


def broadcast_variables(variables: list[Any], root_rank: int = 0) -> None:
    """Set ``variables`` on every rank to ``root_rank``'s values (eager; one reduction per
    dtype). Ranks whose variables differ in number or shape get an error naming them."""
    variables = list(variables)
    described = [(getattr(v, "path", v.name), tuple(v.shape), str(v.dtype)) for v in variables]
    everyone = collectives.allgather_object(described)
    root = everyone[root_rank] if 0 <= root_rank < len(everyone) else None
    if root is None:
        raise ValueError(
            f"`root_rank`={root_rank} does not exist: expected [0, {len(everyone) - 1}]."
        )
    # Shapes and dtypes must agree; names may not (Keras numbers layers per process).
    for rank, theirs in enumerate(everyone):
        if [d[1:] for d in theirs] != [d[1:] for d in root]:
            raise ValueError(_architecture_mismatch(root_rank, root, rank, theirs))
    by_dtype: dict[str, list[Any]] = {}
    for v in variables:
        by_dtype.setdefault(str(v.dtype), []).append(v)
    for group in by_dtype.values():
        flat = np.concatenate([np.asarray(v.numpy()).reshape(-1) for v in group])
        flat = collectives.broadcast(flat, root_rank=root_rank, name="broadcast_variables")
        offset = 0
        for v in group:
            n = int(np.prod(v.shape))
            v.assign(flat[offset : offset + n].reshape(tuple(v.shape)))
            offset += n


def _architecture_mismatch(
    root_rank: int, root: list[tuple], rank: int, theirs: list[tuple]
) -> str:
    if len(root) != len(theirs):
        detail = f"rank {root_rank} has {len(root)} variables, rank {rank} has {len(theirs)}"
    else:
        first = next(i for i, (a, b) in enumerate(zip(root, theirs, strict=True)) if a[1:] != b[1:])
        detail = (
            f"variable {first}: rank {root_rank} has {root[first][0]} {root[first][1]} "
            f"{root[first][2]}, rank {rank} has {theirs[first][0]} {theirs[first][1]} "
            f"{theirs[first][2]}"
        )
    return (
        f"ranks built different models, so their variables cannot be broadcast: {detail}. "
        f"Every rank must build the same architecture."
    )


def load_model(
    path: str,
    custom_objects: dict[str, Any] | None = None,
    compression: type[Compressor] = Compression.none,
) -> keras.Model:
    """Load a ``.keras`` model and make its optimizer distributed (state kept)."""
    model = keras.models.load_model(path, custom_objects=custom_objects)
    if model.optimizer is not None:
        DistributedOptimizer(model.optimizer, compression=compression)
    return model
