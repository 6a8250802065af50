"""Gradient reduction shared by ``DistributedGradientTape`` and Keras' ``DistributedOptimizer``.

All gradients of a step go to the core in one ``grouped_allreduce`` (fused up to
``HOROVOD_FUSION_THRESHOLD``). Sparse gradients (``IndexedSlices``, from embeddings) are
densified first, whatever ``sparse_as_dense`` says: the result is exact, and on the
data-parallel models this targets the dense size is small (Horovod gathers them instead when
``sparse_as_dense=False``; the values that reach the optimizer are the same).
"""

from __future__ import annotations

import warnings
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

import tensorflow as tf

from flyte_hvd.core import collectives, state
from flyte_hvd.core.compression import Compression, Compressor
from flyte_hvd.core.process_sets import ProcessSet
from flyte_hvd.core.reduce_ops import Average, ReduceOp, Sum
from flyte_hvd.tensorflow.functions import check_process_set, numpy_call

if TYPE_CHECKING:
    import keras

# Horovod's explicit gradient groups: how many, or lists of variables.
Groups: TypeAlias = "int | list[list[tf.Variable]] | None"
# Layers whose weights keep local gradients: one layer or several.
LocalLayers: TypeAlias = (
    "keras.layers.Layer | list[keras.layers.Layer] | tuple[keras.layers.Layer, ...] | None"
)


@dataclass(frozen=True)
class Reduction:
    """How gradients are reduced across ranks (checked once, where the user passed them)."""

    compression: type[Compressor] = Compression.none
    op: ReduceOp = Average
    gradient_predivide_factor: float = 1.0

    @staticmethod
    def checked(
        compression: type[Compressor],
        op: int,
        gradient_predivide_factor: float,
        backward_passes_per_step: int = 1,
        num_groups: int = 0,
        groups: Groups = None,
        process_set: ProcessSet | None = None,
    ) -> Reduction:
        collectives.check_optimizer_args(backward_passes_per_step, op, gradient_predivide_factor)
        check_groups(num_groups, groups)
        check_process_set(process_set)
        return Reduction(compression, ReduceOp(op), float(gradient_predivide_factor))

    def scaling(self) -> tuple[ReduceOp, float, float]:
        """Horovod's ``gradient_predivide_factor``: divide by f before the sum, by size/f
        after."""
        f = self.gradient_predivide_factor
        if self.op == Average and f != 1.0:
            return Sum, 1.0 / f, f / state.size()
        return self.op, 1.0, 1.0


def check_groups(num_groups: int, groups: object) -> None:
    """Horovod's explicit grouping only changes which gradients share a fusion buffer; here
    every step's gradients are fused by size, so ``groups`` is checked and otherwise unused."""
    if num_groups:
        warnings.warn("`num_groups` is deprecated in Horovod; use `groups`.", stacklevel=3)
        groups = num_groups if groups is None else groups
    if groups is None:
        return
    if isinstance(groups, bool) or not (
        isinstance(groups, list) or (isinstance(groups, int) and groups > 0)
    ):
        raise ValueError(
            f"`groups` must be a positive int or a list of lists of tf.Variable; found {groups!r}."
        )


def allreduce_gradients(
    grads: list[tf.Tensor | tf.IndexedSlices | None], reduction: Reduction, name: str = "gradients"
) -> list[tf.Tensor | None]:
    """Reduce ``grads`` (tensors, IndexedSlices or None) across ranks, in one fused call.

    Returns a list of the same length (``None`` stays ``None``; reduced gradients are dense).
    """
    grads = list(grads)
    if state.size() == 1:
        return grads
    positions = [i for i, g in enumerate(grads) if g is not None]
    dense = [tf.convert_to_tensor(grads[i]) for i in positions]  # densifies IndexedSlices
    if not dense:
        return grads
    op, pre, post = reduction.scaling()

    def reduce(*arrays):
        return collectives.grouped_allreduce(
            list(arrays),
            op=op,
            name=name,
            compression=reduction.compression,
            prescale_factor=pre,
            postscale_factor=post,
        )

    reduced = numpy_call(reduce, dense, [t.dtype for t in dense], name)
    for i, tensor, original in zip(positions, reduced, dense, strict=True):
        tensor.set_shape(original.shape)
        grads[i] = tensor
    return grads


class _DistributedGradientTape(tf.GradientTape):
    """A ``tf.GradientTape`` whose ``gradient()`` returns gradients reduced across ranks."""

    _hvd_reduction: Reduction
    _hvd_local: set
    _hvd_scale_local: bool

    def gradient(
        self,
        target,
        sources,
        output_gradients=None,
        unconnected_gradients=tf.UnconnectedGradients.NONE,
    ):
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads)
        shared = [i for i, s in enumerate(flat_sources) if _ref(s) not in self._hvd_local]
        reduced = allreduce_gradients([flat_grads[i] for i in shared], self._hvd_reduction)
        for i, g in zip(shared, reduced, strict=True):
            flat_grads[i] = g
        if self._hvd_scale_local and len(shared) < len(flat_sources):  # as Horovod does
            for i, s in enumerate(flat_sources):
                if _ref(s) in self._hvd_local and flat_grads[i] is not None:
                    flat_grads[i] = tf.convert_to_tensor(flat_grads[i]) / state.size()
        return tf.nest.pack_sequence_as(grads, flat_grads)

    def register_local_source(self, source: tf.Variable) -> None:
        """Keep ``source``'s gradient local to this rank (not reduced; divided by size)."""
        self._hvd_local.add(_ref(source))


def _ref(source: tf.Variable) -> Hashable:
    return source.ref() if hasattr(source, "ref") else id(source)


def DistributedGradientTape(
    gradtape: tf.GradientTape,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] = Compression.none,
    sparse_as_dense: bool = False,
    op: ReduceOp = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Groups = None,
    process_set: ProcessSet | None = None,
    scale_local_gradients: bool = True,
) -> tf.GradientTape:
    """Wrap ``gradtape`` so that ``gradient()`` averages gradients across ranks.

    Use it on the tape after the forward pass, before asking for gradients::

        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)

    Works eagerly and inside ``tf.function``. ``sparse_as_dense`` is accepted: sparse
    gradients are always densified before the reduction. ``device_*``, ``num_groups`` and
    ``groups`` are accepted for Horovod compatibility (all gradients of a call are fused by
    size). ``process_set`` must be ``None`` (the global set).
    """
    if not isinstance(gradtape, tf.GradientTape):
        raise ValueError(
            f"DistributedGradientTape wraps a tf.GradientTape; found "
            f"{type(gradtape).__module__}.{type(gradtape).__name__}."
        )
    reduction = Reduction.checked(
        compression,
        op,
        gradient_predivide_factor,
        num_groups=num_groups,
        groups=groups,
        process_set=process_set,
    )
    state.comm()  # fail now, with the init() message
    base = type(gradtape)
    if issubclass(base, _DistributedGradientTape):
        base = base.__mro__[2]
    cls = type(base.__name__, (_DistributedGradientTape, base), {})
    tape: tf.GradientTape = object.__new__(cls)
    tape.__dict__.update(gradtape.__dict__)  # the same recording: watched tensors, persistence
    tape._hvd_reduction = reduction
    tape._hvd_local = set()
    tape._hvd_scale_local = bool(scale_local_gradients)
    return tape


def PartialDistributedGradientTape(
    gradtape: tf.GradientTape,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] = Compression.none,
    sparse_as_dense: bool = False,
    op: ReduceOp = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Groups = None,
    process_set: ProcessSet | None = None,
    local_layers: LocalLayers = None,
    scale_local_gradients: bool = True,
) -> tf.GradientTape:
    """``DistributedGradientTape`` whose ``local_layers``' weights keep local gradients."""
    tape = DistributedGradientTape(
        gradtape,
        device_dense=device_dense,
        device_sparse=device_sparse,
        compression=compression,
        sparse_as_dense=sparse_as_dense,
        op=op,
        gradient_predivide_factor=gradient_predivide_factor,
        num_groups=num_groups,
        groups=groups,
        process_set=process_set,
        scale_local_gradients=scale_local_gradients,
    )
    layers = [] if local_layers is None else local_layers
    for layer in layers if isinstance(layers, list | tuple) else [layers]:
        for weight in layer.trainable_weights:
            tape.register_local_source(weight)
    return tape
