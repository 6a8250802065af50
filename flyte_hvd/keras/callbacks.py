"""Horovod's Keras callbacks, for Keras 3."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import keras
import numpy as np

from flyte_hvd.core import collectives, state
from flyte_hvd.core.reduce_ops import Average
from flyte_hvd.launch import progress as run_progress
from flyte_hvd.tensorflow.functions import broadcast_variables


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Start every rank from ``root_rank``'s model and optimizer state.

    A model that is already built is broadcast at ``on_train_begin``, before the first step
    (the optimizer is built then, so its state is broadcast too). A model without an ``Input``
    is built by Keras only when the first step is traced; it is broadcast at the end of the
    first batch instead, as Horovod always did.
    """

    def __init__(
        self,
        root_rank: int = 0,
        device: str = "",
        local_variables: keras.Variable | Iterable[keras.Variable] | None = None,
    ):
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False
        self.local_variables = _refs(local_variables)

    def on_train_begin(self, logs=None):
        if self.broadcast_done or not _fully_built(self.model):
            return
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built:
            optimizer.build(self.model.trainable_variables)
        self._broadcast()

    def on_train_batch_end(self, batch, logs=None):
        if not self.broadcast_done:
            self._broadcast()

    def _broadcast(self) -> None:
        model = self.model
        variables = list(model.variables)
        if model.optimizer is not None:
            variables += list(model.optimizer.variables)
        variables = [v for v in variables if _ref(v) not in self.local_variables]
        broadcast_variables(variables, root_rank=self.root_rank)
        self.broadcast_done = True


def _fully_built(model: keras.Model) -> bool:
    return model.built and all(layer.built for layer in model._flatten_layers())


def _ref(variable: keras.Variable) -> Hashable:
    return getattr(variable, "path", None) or id(variable)


def _refs(variables: keras.Variable | Iterable[keras.Variable] | None) -> set[Hashable]:
    """``local_variables``: variables (or one) that keep each rank's own value."""
    if variables is None:
        return set()
    if not isinstance(variables, list | tuple | set):
        variables = [variables]
    return {_ref(v) for v in variables}


class MetricAverageCallback(keras.callbacks.Callback):
    """Replace each epoch's logs by their average over ranks. Put it before callbacks that
    read the logs (checkpointing, early stopping, LR on plateau) so they see the same values
    on every rank.

    With ``progress`` (the default), rank 0 also records each epoch's averaged metrics: one
    progress line (``epoch 3/10 · loss 0.41 · 12.1 s/epoch · ~85 s left``, unless ``fit``
    runs with ``verbose=0``), the rows of a ``HorovodSpark`` task's Deck, and the metrics of
    its MLflow run."""

    def __init__(self, device: str = "", progress: bool = True):
        super().__init__()
        self.progress = progress
        self._started = time.monotonic()

    def on_epoch_begin(self, epoch, logs=None):
        self._started = time.monotonic()

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and _is_number(v))
        if state.size() > 1:
            values = np.array([float(logs[k]) for k in keys], dtype=np.float64)
            averaged = collectives.allreduce(values, op=Average, name="MetricAverage")
            for key, value in zip(keys, averaged, strict=True):
                logs[key] = float(value)
        if self.progress and state.rank() == 0:
            params = self.params or {}
            run_progress.record_epoch(
                epoch + 1,
                params.get("epochs"),
                {k: float(logs[k]) for k in keys},
                time.monotonic() - self._started,
                verbose=params.get("verbose", 1),
            )


def _is_number(value: Any) -> bool:  # any logged value: float() decides
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Set ``lr = initial_lr * multiplier(epoch)`` for epochs in ``[start_epoch, end_epoch)``.

    ``multiplier`` is a number or a function of the epoch. With ``staircase=False`` the epoch
    is fractional and the rate changes every batch. ``momentum_correction`` scales the
    optimizer's momentum by new_lr/old_lr for the batch where the rate changes, when the
    momentum is a variable (Keras 3's SGD keeps it as a constant, which is left alone).
    """

    def __init__(
        self,
        initial_lr: float,
        multiplier: float | Callable[[float], float],
        start_epoch: int = 0,
        end_epoch: int | None = None,
        staircase: bool = True,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
    ):
        super().__init__()
        if initial_lr is None or initial_lr <= 0:
            raise ValueError(f"`initial_lr` must be > 0; found {initial_lr!r}.")
        self.initial_lr = float(initial_lr)
        self.multiplier = multiplier if callable(multiplier) else (lambda _epoch: multiplier)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0
        self._restore_momentum: float | None = None

    def _in_range(self, epoch: float) -> bool:
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _steps(self) -> int:
        steps = self.steps_per_epoch or (self.params or {}).get("steps")
        if not steps:
            raise ValueError(
                "LearningRateScheduleCallback with staircase=False needs `steps_per_epoch` "
                "(Keras did not report the number of steps per epoch)."
            )
        return int(steps)

    def _set_lr(self, epoch: float) -> None:
        optimizer = self.model.optimizer
        old = float(np.asarray(optimizer.learning_rate))
        new = self.initial_lr * float(self.multiplier(epoch))
        optimizer.learning_rate = new
        momentum = getattr(optimizer, "momentum", None)
        if self.momentum_correction and isinstance(momentum, keras.Variable) and old > 0:
            self._restore_momentum = float(np.asarray(momentum))
            momentum.assign(self._restore_momentum * new / old)

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch
        if self.staircase and self._in_range(epoch):
            self._set_lr(epoch)

    def on_batch_begin(self, batch, logs=None):
        if self.staircase:
            return
        epoch = self.current_epoch + batch / self._steps()
        if self._in_range(epoch):
            self._set_lr(epoch)

    def on_batch_end(self, batch, logs=None):
        if self._restore_momentum is not None:
            self.model.optimizer.momentum.assign(self._restore_momentum)
            self._restore_momentum = None

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = float(np.asarray(self.model.optimizer.learning_rate))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the rate from ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs``, per
    batch (Goyal et al.): large batches start gently. ``initial_lr`` is the rate after warmup,
    usually the single-process rate times ``size()``."""

    def __init__(
        self,
        initial_lr: float,
        warmup_epochs: int = 5,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
        verbose: int = 0,
    ):
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

        def multiplier(epoch: float) -> float:
            size = state.size()
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(
            initial_lr,
            multiplier,
            start_epoch=0,
            end_epoch=warmup_epochs,
            staircase=False,
            momentum_correction=momentum_correction,
            steps_per_epoch=steps_per_epoch,
        )

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.warmup_epochs - 1:  # the schedule's end_epoch
            self.model.optimizer.learning_rate = self.initial_lr
            if self.verbose and state.rank() == 0:
                print(f"\nEpoch {epoch + 1}: finished learning rate warmup to {self.initial_lr:g}.")


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """A ``ModelCheckpoint`` that keeps only the best model by ``monitor``.

    Its file path is set by whoever runs training (the estimator points it into the run's
    directory); set ``filepath`` yourself to use it directly.
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        verbose: int = 0,
        save_weights_only: bool = False,
        mode: str = "auto",
        save_freq: str | int = "epoch",
    ):
        placeholder = "unset.weights.h5" if save_weights_only else "unset.keras"
        super().__init__(
            filepath=placeholder,
            monitor=monitor,
            verbose=verbose,
            save_best_only=True,
            save_weights_only=save_weights_only,
            mode=mode,
            save_freq=save_freq,
        )
        self.filepath = None

    def on_train_begin(self, logs=None):
        if not self.filepath:
            raise ValueError(
                "BestModelCheckpoint has no file path: the estimator sets it; when you use it "
                "directly, set `callback.filepath = 'best.keras'` first."
            )
        super().on_train_begin(logs)
