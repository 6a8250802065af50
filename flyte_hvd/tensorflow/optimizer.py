"""``DistributedOptimizer`` for Keras 3 (TensorFlow backend), ``load_model``.

Gradients of a step are averaged across ranks before the wrapped optimizer applies them, by
the reduction ``flyte_hvd.tensorflow`` shares with ``DistributedGradientTape`` (one fused
``grouped_allreduce``; through ``tf.numpy_function`` in graphs, so it works in ``model.fit``
and in custom loops alike). Sparse gradients are densified before the reduction.

With ``backward_passes_per_step=N`` the optimizer's ``iterations`` advances on every backward
pass, as under Horovod and as Keras 3's own counter does under ``gradient_accumulation_steps``:
a learning-rate schedule on ``iterations`` sees the number of batches, and the update applied
at pass ``k*N`` uses the rate of step ``k*N - 1``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import keras
import tensorflow as tf

from flyte_hvd.core import state
from flyte_hvd.core.compression import Compression, Compressor
from flyte_hvd.core.process_sets import ProcessSet
from flyte_hvd.core.reduce_ops import Average, ReduceOp
from flyte_hvd.tensorflow.functions import broadcast_variables
from flyte_hvd.tensorflow.gradients import Groups, LocalLayers, Reduction, allreduce_gradients

__all__ = [
    "DistributedOptimizer",
    "PartialDistributedOptimizer",
    "broadcast_variables",
    "load_model",
]


@dataclass(frozen=True)
class _Settings:
    reduction: Reduction
    backward_passes_per_step: int
    average_aggregated_gradients: bool
    scale_local_gradients: bool


class _Accumulators:
    """Local gradient sums for ``backward_passes_per_step > 1`` and ``counter``, the backward
    passes since the last reduction. A plain holder, so Keras does not track these as
    optimizer variables (checkpoints stay loadable as the base class)."""

    def __init__(self) -> None:
        self.grads: list[tf.Variable] = []
        self.counter: tf.Variable | None = None


class _DistributedMixin:
    _hvd: _Settings
    _hvd_acc: _Accumulators
    # Set by PartialDistributedOptimizer / the Keras optimizer this class is mixed into.
    _hvd_local: set[Hashable]
    _var_key: Callable[[tf.Variable], str]
    _trainable_variables: list[tf.Variable]
    built: bool
    _iterations: tf.Variable

    def build(self, variables):
        super().build(variables)  # type: ignore[misc]  # the Keras optimizer mixed in
        self._hvd_accumulators(variables)

    def _hvd_accumulators(self, variables) -> _Accumulators:
        acc = self._hvd_acc
        if self._hvd.backward_passes_per_step > 1 and not acc.grads:
            acc.grads = [
                tf.Variable(tf.zeros_like(v), trainable=False, name="hvd_grad_sum")
                for v in variables
            ]
            acc.counter = tf.Variable(0, dtype=tf.int64, trainable=False)
        return acc

    @property
    def _agg_helper(self) -> _Accumulators:
        """Horovod's name for the aggregation state (scripts read ``_agg_helper.counter``)."""
        return self._hvd_acc

    def register_local_var(self, var) -> None:
        """Keep ``var``'s gradient local to this rank: not reduced (divided by size when
        ``scale_local_gradients``), as Horovod's ``register_local_var``."""
        self._hvd_local.add(self._var_key(var))

    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None) -> list:
        """tf.keras' (Keras 2) optimizer hook, which Horovod's optimizer overrides and scripts
        call: ``(gradient, variable)`` pairs of ``loss``, reduced across ranks. ``loss`` is a
        tensor recorded on ``tape``, or a callable when no tape is given."""
        var_list = list(var_list)
        if tape is None:
            if not callable(loss):
                raise ValueError(
                    "`_compute_gradients` needs the tf.GradientTape that recorded `loss` "
                    "(tape=...), or `loss` as a callable to record now."
                )
            with tf.GradientTape() as tape:
                loss = loss()
        grads = tape.gradient(loss, var_list, grad_loss)
        return list(zip(self._hvd_reduce(grads, var_list), var_list, strict=True))

    def _hvd_reduce(self, grads, trainable_variables=None) -> list:
        grads = list(grads)
        if not self._hvd_local:
            return _allreduce_gradients(grads, self._hvd)
        variables = trainable_variables
        if variables is None:
            variables = self._trainable_variables
        local = [self._var_key(v) in self._hvd_local for v in variables]
        shared = [i for i, is_local in enumerate(local) if not is_local]
        reduced = _allreduce_gradients([grads[i] for i in shared], self._hvd)
        for i, g in zip(shared, reduced, strict=True):
            grads[i] = g
        if self._hvd.scale_local_gradients:
            for i, is_local in enumerate(local):
                if is_local and grads[i] is not None:
                    grads[i] = tf.convert_to_tensor(grads[i]) / state.size()
        return grads

    def apply(self, grads, trainable_variables=None):
        settings = self._hvd
        if settings.backward_passes_per_step == 1:
            reduced = self._hvd_reduce(grads, trainable_variables)
            return super().apply(reduced, trainable_variables)  # type: ignore[misc]
        if trainable_variables is not None and not self.built:
            self.build(list(trainable_variables))
        acc = self._hvd_accumulators(
            self._trainable_variables if trainable_variables is None else trainable_variables
        )
        counter = acc.counter
        assert counter is not None  # made with the sums, as backward_passes_per_step > 1
        for g, a in zip(grads, acc.grads, strict=True):
            if g is not None:
                a.assign_add(tf.convert_to_tensor(g))
        counter.assign_add(1)

        def reduce_and_apply():
            summed = [a.read_value() for a in acc.grads]
            if settings.average_aggregated_gradients:
                summed = [s / settings.backward_passes_per_step for s in summed]
            reduced = self._hvd_reduce(summed, trainable_variables)
            # iterations += 1
            super(_DistributedMixin, self).apply(reduced, trainable_variables)  # type: ignore[misc]
            for a in acc.grads:
                a.assign(tf.zeros_like(a))
            counter.assign(0)
            return tf.constant(True)

        def only_count():
            self._iterations.assign_add(1)  # every backward pass counts, as in Horovod
            return tf.constant(False)

        # Every rank counts the same local steps, so all take the same branch.
        tf.cond(counter >= settings.backward_passes_per_step, reduce_and_apply, only_count)
        return None


def _allreduce_gradients(grads, settings: _Settings) -> list:
    """Average ``grads`` (tensors, IndexedSlices or None) across ranks, in one fused call."""
    return allreduce_gradients(grads, settings.reduction, name="DistributedOptimizer")


def DistributedOptimizer(
    optimizer: keras.optimizers.Optimizer,
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] = Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: ReduceOp = Average,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Groups = None,
    process_set: ProcessSet | None = None,
    scale_local_gradients: bool = True,
) -> keras.optimizers.Optimizer:
    """Make ``optimizer`` average gradients across ranks before applying them.

    The optimizer is wrapped in place and returned: its state (iterations, slots) is kept, and
    it still saves as its own class, so checkpoints load with plain ``keras.models.load_model``.
    Arguments are Horovod's, in Horovod's order.

    Args:
        compression: ``hvd.Compression.none`` or ``hvd.Compression.fp16`` (on the wire).
        sparse_as_dense: accepted; sparse gradients (embeddings) are always densified before
            the reduction, which gives the same update as Horovod's sparse path.
        gradient_predivide_factor: with ``Average``, divide by this before the sum and by
            ``size / factor`` after (for numerically large gradients).
        op: ``Average`` (default) or ``Sum``.
        backward_passes_per_step: accumulate this many local steps before one reduction;
            ``iterations`` still advances on every pass (see the module docstring).
        average_aggregated_gradients: divide the accumulated sum by ``backward_passes_per_step``.
        scale_local_gradients: divide the gradients of variables registered with
            ``register_local_var`` (kept local, not reduced) by the number of ranks.
        name, device_dense, device_sparse, num_groups, groups: accepted for Horovod
            compatibility; the optimizer keeps its name, and all gradients of a step are
            fused by size.
        process_set: ``None`` (all ranks); other process sets are not supported here.
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ValueError(
            f"DistributedOptimizer wraps a Keras 3 optimizer (keras.optimizers.Optimizer, e.g. "
            f"keras.optimizers.SGD(0.01)); found {type(optimizer).__module__}."
            f"{type(optimizer).__name__}."
        )
    reduction = Reduction.checked(
        compression,
        op,
        gradient_predivide_factor,
        backward_passes_per_step=backward_passes_per_step,
        num_groups=num_groups,
        groups=groups,
        process_set=process_set,
    )
    if getattr(optimizer, "gradient_accumulation_steps", None) and backward_passes_per_step > 1:
        raise ValueError(
            "the optimizer already accumulates gradients (`gradient_accumulation_steps`="
            f"{optimizer.gradient_accumulation_steps}); use either that or "
            "`backward_passes_per_step`, not both."
        )
    state.comm()  # fail now, with the init() message, rather than inside a traced step
    base = type(optimizer)
    if issubclass(base, _DistributedMixin):
        base = base.__mro__[2]
    # Same module and name as the base, so Keras serializes it as the base class.
    distributed = type(base.__name__, (_DistributedMixin, base), {"__module__": base.__module__})
    optimizer.__class__ = distributed
    optimizer._hvd = _Settings(
        reduction, backward_passes_per_step, average_aggregated_gradients, scale_local_gradients
    )
    optimizer._hvd_acc = _Accumulators()
    optimizer._hvd_local = set()
    return optimizer


def PartialDistributedOptimizer(
    optimizer: keras.optimizers.Optimizer,
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] = Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: ReduceOp = Average,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    groups: Groups = None,
    process_set: ProcessSet | None = None,
    local_layers: LocalLayers = None,
    scale_local_gradients: bool = True,
) -> keras.optimizers.Optimizer:
    """``DistributedOptimizer`` whose ``local_layers``' weights keep local gradients."""
    optimizer = DistributedOptimizer(
        optimizer,
        name,
        device_dense=device_dense,
        device_sparse=device_sparse,
        compression=compression,
        sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor,
        op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients,
        num_groups=0,
        groups=groups,
        process_set=process_set,
        scale_local_gradients=scale_local_gradients,
    )
    layers = [] if local_layers is None else local_layers
    for layer in layers if isinstance(layers, list | tuple) else [layers]:
        for weight in layer.trainable_weights:
            optimizer.register_local_var(weight)
    return optimizer


def load_model(
    filepath: str,
    custom_optimizers: list[type] | None = None,
    custom_objects: dict[str, Any] | None = None,  # Keras' name -> class or function
    compression: type[Compressor] = Compression.none,
    legacy_opts: bool = False,
) -> keras.Model:
    """Load a ``.keras`` model and make its optimizer distributed (state kept).

    Args:
        custom_optimizers: optimizer classes the model may have been saved with that Keras
            cannot find by name (added to ``custom_objects`` under their class names).
        custom_objects: as for ``keras.models.load_model``.
        legacy_opts: accepted for Horovod compatibility; Keras 3 has no legacy optimizers.
    """
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or []:
        if not (isinstance(cls, type) and issubclass(cls, keras.optimizers.Optimizer)):
            raise ValueError(
                f"`custom_optimizers` takes Keras optimizer classes (e.g. [MySGD]); found {cls!r}."
            )
        objects.setdefault(cls.__name__, cls)
    model = keras.models.load_model(filepath, custom_objects=objects)
    if model.optimizer is not None:
        DistributedOptimizer(model.optimizer, compression=compression)
    return model
