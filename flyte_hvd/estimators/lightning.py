"""``LightningEstimator``: fit a Lightning 2.x ``LightningModule`` on a Spark DataFrame across
ranks; ``fit`` returns a ``TorchModel``.

Each rank runs a ``lightning.pytorch.Trainer`` with ``flyte_hvd.torch.HorovodStrategy``
(gradients reduced during backward by the collective core), on this rank's shard of the
prepared data. ``training_step`` and ``validation_step`` receive a dict of tensors keyed by
column name: features reshaped by ``input_shapes``, labels as float32 (int64 for integer
columns), the sample weight column as float32. Callbacks (``EarlyStopping``,
``ModelCheckpoint``, ...) and the logger work on every rank. Rank 0 records the run in the
store after each epoch (``last.ckpt``, ``checkpoint.ckpt`` -- the best with a
``ModelCheckpoint`` that monitors a metric, else the last -- ``state.json`` and ``logs/``); a
``fit`` with an existing ``run_id``, or a Spark retry, resumes from ``last.ckpt`` with
Lightning's own restore (loops, optimizers, callbacks).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import numpy as np

from flyte_hvd.estimators import training
from flyte_hvd.estimators.base import HorovodEstimator
from flyte_hvd.estimators.params import ESTIMATOR_PARAMS, with_params
from flyte_hvd.estimators.torch_model import (
    INPUT_SHAPES_PARAM,
    ShapedInputs,
    TorchModel,
    batch_tensors,
    resolve_input_shapes,
    tensorboard_without_tensorflow,
)
from flyte_hvd.estimators.training import TrainingSpec

LIGHTNING_PARAMS: dict[str, tuple[Any, str]] = {
    **INPUT_SHAPES_PARAM,
    "trainer_args": ({}, "more keyword arguments for lightning.pytorch.Trainer"),
    "logger": (None, "a Lightning logger (default: TensorBoard, else CSV, in the run's logs/)"),
}

# Trainer arguments the estimator sets itself, and the param to use instead.
_RESERVED_TRAINER_ARGS = {
    "strategy": "the estimator trains with flyte_hvd's HorovodStrategy",
    "num_nodes": "set `num_proc` (or `backend`)",
    "devices": "set `num_proc` (or `backend`); each rank uses one device",
    "max_epochs": "set `epochs`",
    "callbacks": "set `callbacks`",
    "logger": "set `logger`",
    "use_distributed_sampler": "each rank already reads its own shard",
}
_EXTENSION = ".ckpt"
LAST_MODEL_FILENAME = "last.ckpt"


def _import_lightning() -> Any:
    try:
        import lightning.pytorch as pl
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            "LightningEstimator needs Lightning 2.x and PyTorch: install the extra "
            "`pip install flyte-hvd[torch]`."
        ) from error
    return pl


@dataclass(kw_only=True)
class LightningTrainingSpec(TrainingSpec):
    """The common spec plus what a Lightning rank needs."""

    input_shapes: list[list[int]]
    trainer_args: dict[str, Any] = field(default_factory=dict)
    logger: Any = None
    callbacks: list[Any] = field(default_factory=list)
    checkpoint_callback: Any = None
    compression: Any = None


@with_params({**ESTIMATOR_PARAMS, **LIGHTNING_PARAMS})
class LightningEstimator(ShapedInputs, HorovodEstimator):
    """Train a ``LightningModule`` with Horovod's estimator API; returns a ``TorchModel``.

    The module's ``configure_optimizers`` defines the optimizers (``optimizer`` and ``loss``
    are not used); its ``forward(*features)`` is what ``TorchModel.transform`` calls. Learning
    rates are used as the module gives them.
    """

    _framework = "lightning"
    _preload = ("flyte_hvd.estimators.lightning", "torch", "lightning.pytorch", "flyte_hvd.torch")
    _extension = _EXTENSION
    _model_class = TorchModel

    def _check_model(self, features: list[str], labels: list[str]) -> None:
        pl = _import_lightning()
        model = self.getModel()
        if not isinstance(model, pl.LightningModule):
            raise ValueError(
                f"`model` must be a lightning.pytorch.LightningModule; found "
                f"{type(model).__name__}."
            )
        if self.getOptimizer() is not None or self.getLoss() is not None:
            raise ValueError(
                "LightningEstimator takes the optimizers from the module's "
                "configure_optimizers() and the loss from its training_step(); leave "
                "`optimizer` and `loss` unset."
            )
        args = self.getTrainerArgs() or {}
        if not isinstance(args, dict):
            raise ValueError(f"`trainer_args` must be a dict; found {type(args).__name__}.")
        reserved = sorted(set(args) & set(_RESERVED_TRAINER_ARGS))
        if reserved:
            hints = "; ".join(f"`{k}`: {_RESERVED_TRAINER_ARGS[k]}" for k in reserved)
            raise ValueError(f"`trainer_args` sets {reserved}, which the estimator sets: {hints}.")
        self._check_input_shapes(features)

    def _training_spec(self, remote_store: Any, features: list[str], metadata: Any,
                       num_proc: int) -> LightningTrainingSpec:  # fmt: skip
        return LightningTrainingSpec(
            **self._spec_fields(remote_store, features, metadata),
            model_bytes=cloudpickle.dumps(self.getModel()),
            input_shapes=resolve_input_shapes(self.getInputShapes(), features, metadata[0]),
            trainer_args=dict(self.getTrainerArgs() or {}),
            logger=self.getLogger(),
            callbacks=list(self.getCallbacks() or []),
            checkpoint_callback=self.getCheckpointCallback(),
            compression=self.getGradientCompression(),
        )

    def _remote_trainer(self) -> Callable[[LightningTrainingSpec], dict]:
        return train_on_rank


# -- on the ranks --------------------------------------------------------------------------


class _TensorBatches:
    """A loader as the iterable Lightning reads: dicts of tensors, ``len`` batches an epoch."""

    def __init__(self, loader: Any, spec: LightningTrainingSpec):
        self.loader, self.spec = loader, spec

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        spec = self.spec
        for batch in self.loader:
            inputs, labels, weights = batch_tensors(batch, spec, spec.input_shapes, "cpu")
            out = dict(zip(spec.features, inputs, strict=True))
            out.update(zip(spec.labels, labels, strict=True))
            if spec.sample_weight_col is not None:
                out[spec.sample_weight_col] = weights
            yield out


def _recorder_class() -> type:
    import torch
    from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint

    class RunRecorder(Checkpoint):
        """Every rank, after each epoch (and after the user's checkpoint callbacks, as a
        ``Checkpoint``): average the epoch's metrics over ranks and save ``last.ckpt``
        (rank 0 writes); rank 0 then hands both to the run's ``training.RunRecord``."""

        def __init__(self, record: training.RunRecord | None, run: training.RankRun,
                     logs_dir: str | None):  # fmt: skip
            self.record, self.run, self.logs_dir = record, run, logs_dir
            self.history: dict[str, list[float]] = {}

        def on_train_start(self, trainer, pl_module):
            # Lightning restored the checkpoint callback's state from last.ckpt, but not its
            # best score (the folder changed) nor the best file (it was on another attempt's
            # disk): take both from the run, so the best of earlier attempts is kept.
            run = self.run
            if run.best_value is None:
                return
            for callback in trainer.checkpoint_callbacks:
                if isinstance(callback, ModelCheckpoint) and callback.monitor is not None:
                    score = torch.tensor(run.best_value)
                    path = run.best_file or callback.best_model_path
                    callback.best_model_score, callback.best_model_path = score, path
                    callback.best_k_models = {path: score}
                    callback.kth_best_model_path, callback.kth_value = path, score

        def on_train_epoch_start(self, trainer, pl_module):
            if self.record is not None:
                self.record.epoch_begin()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if self.record is not None:
                self.record.step_begin()

        def on_train_epoch_end(self, trainer, pl_module):
            import flyte_hvd.torch as hvd

            mine = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
            everyone = hvd.allgather_object(mine)
            logs = {k: float(np.mean([m[k] for m in everyone if k in m])) for k in mine}
            for key, value in logs.items():
                self.history.setdefault(key, []).append(value)
            last = os.path.join(self.run.work, LAST_MODEL_FILENAME)
            trainer.save_checkpoint(last)  # collective; rank 0 writes
            if self.record is not None:
                saving = next(
                    (c for c in trainer.checkpoint_callbacks
                     if isinstance(c, ModelCheckpoint) and c.best_model_path),
                    None,
                )  # fmt: skip
                score = saving.best_model_score if saving else None
                self.record.epoch_end(
                    trainer.current_epoch, logs, last, saving.best_model_path if saving else None,
                    self.logs_dir, best_value=None if score is None else float(score),
                )  # fmt: skip

    return RunRecorder


def _default_logger(work: str) -> Any:
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    tensorboard_without_tensorflow()
    try:
        return TensorBoardLogger(work, name="logs", version="", default_hp_metric=False)
    except ModuleNotFoundError:  # neither tensorboard nor tensorboardX installed
        return CSVLogger(work, name="logs", version="")


def train_on_rank(spec: LightningTrainingSpec) -> dict:
    """The training function every rank runs (see ``LightningEstimator``)."""
    import lightning.pytorch as pl
    import torch

    import flyte_hvd.torch as hvd
    from flyte_hvd.torch.strategy import HorovodStrategy

    strategy = HorovodStrategy(compression=spec.compression or hvd.Compression.none)
    seed = lambda value: pl.seed_everything(value, verbose=False)  # noqa: E731
    # Every rank restores from the same last.ckpt, with Lightning's own restore.
    with training.rank_run(spec, hvd, _EXTENSION, seed, resume_on_every_rank=True) as run:
        module = cloudpickle.loads(spec.model_bytes)
        train, val = training.make_loaders(spec, run.rank, run.size)
        callbacks = list(spec.callbacks)
        checkpoint = spec.checkpoint_callback
        if checkpoint is not None:
            if getattr(checkpoint, "dirpath", None) is None:
                checkpoint.dirpath = os.path.join(run.work, "checkpoints")
            callbacks.append(checkpoint)
        logger = spec.logger if spec.logger is not None else _default_logger(run.work)
        logs_dir = os.path.join(run.work, "logs") if spec.logger is None else None
        record = (
            training.RunRecord(spec.store, run.state, spec.epochs, _EXTENSION, spec.verbose)
            if run.rank == 0
            else None
        )
        recorder = _recorder_class()(record, run, logs_dir)
        callbacks.append(recorder)
        use_gpu = spec.use_gpu and torch.cuda.is_available()
        args: dict[str, Any] = dict(
            max_epochs=spec.epochs,
            strategy=strategy,
            accelerator="gpu" if use_gpu else "cpu",
            devices=1,
            num_nodes=1,
            logger=logger,
            callbacks=callbacks,
            default_root_dir=run.work,
            use_distributed_sampler=False,
            # As Horovod: rank 0 shows Lightning's progress bar and model summary.
            enable_progress_bar=run.rank == 0 and spec.verbose >= 1,
            enable_model_summary=run.rank == 0 and spec.verbose >= 1,
            num_sanity_val_steps=0,
            log_every_n_steps=max(1, min(50, len(train))),
        )
        args.update(spec.trainer_args)
        trainer = pl.Trainer(**args)
        trainer.fit(
            module,
            train_dataloaders=_TensorBatches(train, spec),
            val_dataloaders=_TensorBatches(val, spec) if val is not None else None,
            ckpt_path=run.resume_file,
            weights_only=False,  # written by this run's rank 0 (it holds non-tensor state)
        )
        best = _best_path(trainer)
        if run.rank == 0 and best:
            saved = torch.load(best, map_location="cpu", weights_only=False)
            module.load_state_dict(saved["state_dict"])
        module = module.cpu()
        return run.result(
            lambda: cloudpickle.dumps({"model": module, "optimizer": None}), recorder.history
        )


def _best_path(trainer: Any) -> str | None:
    """The best checkpoint a monitoring ``ModelCheckpoint`` holds on this rank, if any."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    return next(
        (c.best_model_path for c in trainer.checkpoint_callbacks
         if isinstance(c, ModelCheckpoint) and c.best_model_path
         and os.path.exists(c.best_model_path)),
        None,
    )  # fmt: skip
