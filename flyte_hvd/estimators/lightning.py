"""``LightningEstimator``: fit a Lightning 2.x ``LightningModule`` on a Spark DataFrame across
ranks; ``fit`` returns a ``TorchModel``.

Each rank runs a ``lightning.pytorch.Trainer`` with ``flyte_hvd.torch.HorovodStrategy``
(gradients reduced during backward by the collective core), or with ``distributed="ddp"``
Lightning's own ``DDPStrategy`` (``flyte_hvd.torch.strategy.ddp_strategy``), on this rank's
shard of the prepared data. ``training_step`` and ``validation_step`` receive a dict of
tensors keyed by column name: features reshaped by ``input_shapes``, labels as float32
(int64 for integer columns) shaped as the model's output for them where the sizes agree (a
scalar label is ``(B, 1)`` for a ``(B, 1)`` output) unless the steps reshape the label
themselves, as Horovod's batches need (``batch["y"].unsqueeze(1)``: then ``(B,)``, as
Horovod gives it), the sample weight column as float32. A
``training_step`` that unpacks its batch as a tuple (``x, y = batch``) is refused before any
rank starts. Callbacks (``EarlyStopping``,
``ModelCheckpoint``, ...) and the logger work on every rank. Rank 0 records the run in the
store after each epoch (``last.ckpt``, ``checkpoint.ckpt`` -- the best with a
``ModelCheckpoint`` that monitors a metric, else the last -- ``state.json`` and ``logs/``); a
``fit`` with an existing ``run_id``, or a Spark retry, resumes from ``last.ckpt`` with
Lightning's own restore (loops, optimizers, callbacks).
"""

from __future__ import annotations

import ast
import difflib
import importlib
import inspect
import io
import math
import os
import sys
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar

import cloudpickle
import numpy as np

from flyte_hvd.data.store import Store
from flyte_hvd.estimators import tracking, training
from flyte_hvd.estimators.backend import Backend
from flyte_hvd.estimators.base import HorovodEstimator, Metadata
from flyte_hvd.estimators.params import (
    DISTRIBUTED_PARAM,
    ESTIMATOR_PARAMS,
    NAN_PARAM,
    check_distributed,
    passed_params,
    with_params,
)
from flyte_hvd.estimators.torch_model import (
    INPUT_SHAPES_PARAM,
    ShapedInputs,
    TorchLoss,
    TorchModel,
    batch_tensors,
    ddp_process_group,
    probe_outputs,
    resolve_input_shapes,
    tensorboard_without_tensorflow,
)
from flyte_hvd.estimators.tracking import MlflowConfig
from flyte_hvd.estimators.training import TrainingSpec

if TYPE_CHECKING:
    # Lightning's types are named by ``lightning.pytorch``; ``pytorch_lightning``'s twins are
    # taken alike (a module trains with its own package's Trainer).
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import Logger
    from lightning.pytorch.profilers import Profiler

    from flyte_hvd.core.compression import Compressor
    from flyte_hvd.data.loader import BaseDataLoader, Batch
    from flyte_hvd.data.store import RemoteStore

LIGHTNING_PARAMS: dict[str, tuple[Any, str]] = {
    **INPUT_SHAPES_PARAM,
    **DISTRIBUTED_PARAM,
    "trainer_args": ({}, "more keyword arguments for lightning.pytorch.Trainer"),
    "logger": (None, "a Lightning logger (default: TensorBoard, else CSV, in the run's logs/)"),
    "profiler": (None, "Lightning's Trainer `profiler` (e.g. 'simple')"),
    "log_every_n_steps": (
        None,
        "Lightning's Trainer `log_every_n_steps` (default: 50, or the "
        "batches of an epoch when fewer)",
    ),
    **NAN_PARAM,
    "num_gpus": (None, "Horovod's GPU count (no effect here: each rank uses one device)"),
    "loss_constructors": (None, "Horovod's legacy-mode losses (no effect here)"),
    "train_minibatch_fn": (None, "Horovod's legacy-mode step (no effect here)"),
    "debug_data_loader": (False, "Horovod's loader debugging (no effect here)"),
    "data_module": (None, "Horovod's data module class (no effect here)"),
}

# Trainer arguments the estimator sets itself, and the param to use instead.
_RESERVED_TRAINER_ARGS = {
    "strategy": "set `distributed` ('horovod': flyte_hvd's HorovodStrategy, 'ddp': "
    "Lightning's DDPStrategy)",
    "num_nodes": "set `num_proc` (or `backend`)",
    "devices": "set `num_proc` (or `backend`); each rank uses one device",
    "max_epochs": "set `epochs`",
    "callbacks": "set `callbacks`",
    "logger": "set `logger`",
    "use_distributed_sampler": "each rank already reads its own shard",
}
_EXTENSION = ".ckpt"
LAST_MODEL_FILENAME = "last.ckpt"
# The mean of the losses training_step returned in an epoch, checked by ``terminate_on_nan``.
_STEP_LOSS = "training_step loss"


def _import_lightning() -> ModuleType:
    try:
        import lightning.pytorch as pl
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            "LightningEstimator needs Lightning 2.x and PyTorch: install the extra "
            "`pip install flyte-hvd[torch]`."
        ) from error
    return pl


# Lightning 2 installs under two names; a module trains with its own package's Trainer.
LIGHTNING_PACKAGES = ("lightning.pytorch", "pytorch_lightning")


def lightning_package(model: object) -> str | None:
    """The Lightning package whose ``LightningModule`` ``model`` is (None if neither's)."""
    for name in LIGHTNING_PACKAGES:
        package = sys.modules.get(name)
        if package is not None and isinstance(model, package.LightningModule):
            return name
    return None


def _parsed_step(model: object, method: str) -> tuple[ast.FunctionDef, int, str] | None:
    """``model``'s ``method`` (``training_step``, ...) parsed: its function node, its first
    line and the name of its batch argument; None where there is no source to read."""
    step = getattr(type(model), method, None)
    if step is None:
        return None
    try:
        source, first = inspect.getsourcelines(step)
        tree = ast.parse(textwrap.dedent("".join(source)))
    except (OSError, TypeError, SyntaxError):  # no source to read: nothing to say
        return None
    function = tree.body[0]
    if not isinstance(function, ast.FunctionDef) or len(function.args.args) < 2:
        return None
    return function, first, function.args.args[1].arg  # training_step(self, batch, batch_idx)


def _check_batch_use(
    model: object, features: list[str], labels: list[str], weight: str | None
) -> None:
    """A batch is a dict keyed by column name: a ``training_step`` that unpacks it as
    Lightning's tutorials unpack a tuple (``x, y = batch``) or indexes it by position
    (``batch[0]``) is refused before any rank starts (on the ranks it would fail with torch's
    "must be Tensor, not str")."""
    parsed = _parsed_step(model, "training_step")
    if parsed is None:
        return
    function, first, name = parsed
    columns = [*features, *labels, *([weight] if weight else [])]
    for node in ast.walk(function):
        unpacked = (
            isinstance(node, ast.Assign)
            and isinstance(node.targets[0], ast.Tuple | ast.List)
            and isinstance(node.value, ast.Name)
            and node.value.id == name
        )
        indexed = (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Name)
            and node.value.id == name
            and isinstance(node.slice, ast.Constant)
            and isinstance(node.slice.value, int)
        )
        if (unpacked or indexed) and isinstance(node, ast.Assign | ast.Subscript):
            by_name = ", ".join(f"{name}[{c!r}]" for c in columns)
            if len(features) == 1 and len(labels) == 1:
                by_name = f"x, y = {name}[{features[0]!r}], {name}[{labels[0]!r}]"
            raise ValueError(
                f"{type(model).__name__}.training_step reads its batch by position "
                f"(`{ast.unparse(node)}`, line {first + node.lineno - 1}), but a "
                f"LightningEstimator batch is a dict of tensors keyed by column name: "
                f"{columns}. Read the columns by name: `{by_name}`."
            )


# Lightning 1.x's Trainer argument, which Horovod's users pass: an SWA callback here.
_SWA_ARG = "stochastic_weight_avg"


def _check_trainer_args(args: dict[str, Any], package: str) -> None:
    """Every key of ``trainer_args`` is an argument of ``package``'s ``Trainer`` the estimator
    does not set itself (or Lightning 1.x's ``stochastic_weight_avg``); checked before any
    rank starts, where each rank's ``Trainer`` would raise ``TypeError``."""
    reserved = sorted(set(args) & set(_RESERVED_TRAINER_ARGS))
    if reserved:
        hints = "; ".join(f"`{k}`: {_RESERVED_TRAINER_ARGS[k]}" for k in reserved)
        raise ValueError(f"`trainer_args` sets {reserved}, which the estimator sets: {hints}.")
    accepted = inspect.signature(importlib.import_module(package).Trainer.__init__).parameters
    unknown = sorted(k for k in args if k not in accepted and k != _SWA_ARG)
    if unknown:
        close = {k: difflib.get_close_matches(str(k), list(accepted), n=1) for k in unknown}
        hints = "; ".join(f"`{k}`: did you mean `{m[0]}`?" for k, m in close.items() if m)
        raise ValueError(
            f"`trainer_args` has {unknown}, which {package}.Trainer does not take"
            f"{' (' + hints + ')' if hints else ''}. Give only its arguments; see "
            f"help({package}.Trainer)."
        )
    if not isinstance(args.get(_SWA_ARG, False), bool):
        raise ValueError(f"`trainer_args['{_SWA_ARG}']` must be a bool; found {args[_SWA_ARG]!r}.")


def _weight_averaging(package: ModuleType) -> pl.Callback:
    """Lightning 1.x's ``Trainer(stochastic_weight_avg=True)``: Lightning's
    ``StochasticWeightAveraging`` from 80% of the epochs, at the optimizer's own learning
    rates when averaging starts (as 1.x did; Lightning 2 asks for them up front)."""
    averaging = package.callbacks.StochasticWeightAveraging

    class AtTheOptimizersRates(averaging):  # type: ignore[misc,valid-type]
        def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: object) -> None:
            if not self._initialized and self.swa_start <= trainer.current_epoch <= self.swa_end:
                self._swa_lrs = [group["lr"] for group in trainer.optimizers[0].param_groups]
            super().on_train_epoch_start(trainer, pl_module)

    return AtTheOptimizersRates(swa_lrs=1.0)  # replaced by the optimizer's when it starts


# Tensor methods and torch functions that give a label a shape of the step's choosing.
_RESHAPES = frozenset({"unsqueeze", "unsqueeze_", "view", "reshape", "view_as", "reshape_as"})


def _root(node: ast.expr) -> ast.expr:
    """What a chain of method calls and attributes starts from (``batch["y"]`` in
    ``batch["y"].float().unsqueeze(1)``)."""
    while True:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            node = node.func.value
        elif isinstance(node, ast.Attribute):
            node = node.value
        else:
            return node


def labels_the_steps_shape(model: object, labels: list[str]) -> set[str]:
    """The label columns that ``training_step`` or ``validation_step`` reshape themselves, as
    Horovod's batches need (a scalar label there is ``(B,)``): ``batch["y"].unsqueeze(1)``,
    ``y.float().view(-1, 1)`` or ``y[:, None]`` after ``y = batch["y"]``,
    ``torch.unsqueeze(y, 1)``. Those keep Horovod's shape; the others are shaped as the
    model's output."""
    shaped: set[str] = set()
    for method in ("training_step", "validation_step"):
        parsed = _parsed_step(model, method)
        if parsed is not None:
            shaped |= _labels_reshaped_in(parsed[0], parsed[2], labels)
    return shaped


def _labels_reshaped_in(function: ast.FunctionDef, batch: str, labels: list[str]) -> set[str]:
    """``labels_the_steps_shape`` for one step, whose batch argument is named ``batch``."""
    aliases: dict[str, str] = {}  # local names bound to a label (``y = batch["y"]``)

    def label_of(node: ast.expr) -> str | None:
        root = _root(node)
        if (
            isinstance(root, ast.Subscript)
            and isinstance(root.value, ast.Name)
            and root.value.id == batch
            and isinstance(root.slice, ast.Constant)
            and root.slice.value in labels
        ):
            return str(root.slice.value)
        return aliases.get(root.id) if isinstance(root, ast.Name) else None

    assigns = [n for n in ast.walk(function) if isinstance(n, ast.Assign)]
    for _ in range(2):  # an alias of an alias
        for node in assigns:
            pairs = [(node.targets[0], node.value)]
            if isinstance(node.targets[0], ast.Tuple) and isinstance(node.value, ast.Tuple):
                pairs = list(zip(node.targets[0].elts, node.value.elts, strict=False))
            for target, value in pairs:
                found = label_of(value)
                if isinstance(target, ast.Name) and found is not None:
                    aliases[target.id] = found
    shaped = set()
    for expr in ast.walk(function):
        found = None
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute):
            if expr.func.attr in _RESHAPES:
                found = label_of(expr.func.value)
                if found is None and expr.args:  # torch.unsqueeze(y, 1)
                    found = label_of(expr.args[0])
        elif isinstance(expr, ast.Subscript):  # y[:, None]
            index = expr.slice.elts if isinstance(expr.slice, ast.Tuple) else [expr.slice]
            if any(isinstance(i, ast.Constant) and i.value is None for i in index):
                found = label_of(expr.value)
        if found is not None:
            shaped.add(found)
    return shaped


@dataclass(kw_only=True)
class LightningTrainingSpec(TrainingSpec):
    """The common spec plus what a Lightning rank needs."""

    input_shapes: list[list[int]]
    trainer_args: dict[str, Any] = field(default_factory=dict)
    logger: Logger | None = None
    callbacks: list[pl.Callback] = field(default_factory=list)
    profiler: Profiler | str | None = None
    log_every_n_steps: int | None = None
    lightning_package: str = LIGHTNING_PACKAGES[0]
    checkpoint_callback: ModelCheckpoint | None = None
    compression: type[Compressor] | None = None
    # each label's model output shape per row: a label is reshaped to it where the sizes agree
    output_shapes: list[list[int]] = field(default_factory=list)


@with_params({**ESTIMATOR_PARAMS, **LIGHTNING_PARAMS})
class LightningEstimator(ShapedInputs, HorovodEstimator):
    """Train a ``LightningModule`` with Horovod's estimator API; returns a ``TorchModel``.

    The module's ``configure_optimizers`` defines the optimizers (leave ``optimizer`` and
    ``loss`` unset); its ``forward(*features)`` is what ``TorchModel.transform`` calls. Learning
    rates are used as the module gives them. A plain ``torch.nn.Module`` with ``optimizer`` and
    ``loss`` (Horovod's legacy mode) is trained in a LightningModule built around it
    (``lightning_legacy.to_lightning_module``).
    """

    _inert_params: ClassVar[dict[str, str]] = {
        "backward_passes_per_step": "Lightning's `accumulate_grad_batches` (in `trainer_args`) "
        "accumulates gradients",
        "num_gpus": "each rank uses one device (`use_gpu`)",
        "loss_constructors": "the LightningModule computes its own loss",
        "train_minibatch_fn": "the LightningModule's `training_step` is the step",
        "debug_data_loader": "the loader has no debug mode",
        "data_module": "the estimator feeds the prepared data itself",
    }

    def __init__(
        self,
        *,
        num_proc: int | None = None,
        backend: Backend | None = None,
        store: Store | None = None,
        model: pl.LightningModule | torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,  # legacy mode (a plain nn.Module)
        loss: TorchLoss | list[TorchLoss] | None = None,  # legacy mode (a plain nn.Module)
        loss_weights: list[float] | None = None,
        metrics: list[Any] | None = None,
        custom_objects: dict[str, Any] | None = None,
        feature_cols: list[str] | None = None,
        label_cols: list[str] | None = None,
        validation: float | str | None = None,
        sample_weight_col: str | None = None,
        callbacks: list[pl.Callback] | None = None,
        batch_size: int = 32,
        val_batch_size: int | None = None,
        epochs: int = 1,
        verbose: int = 1,
        shuffle: bool = True,
        shuffle_buffer_size: int | None = None,
        random_seed: int | None = None,
        train_steps_per_epoch: int | None = None,
        validation_steps_per_epoch: int | None = None,
        partitions_per_process: int = 10,
        materialize: bool = True,
        run_id: str | None = None,
        checkpoint_callback: ModelCheckpoint | None = None,
        gradient_compression: type[Compressor] | None = None,
        transformation_fn: Callable[[Batch], Batch] | None = None,
        inmemory_cache_all: bool | None = None,
        data_loader: type[BaseDataLoader] | None = None,
        use_gpu: bool = True,
        mlflow: bool | MlflowConfig | None = None,
        backward_passes_per_step: int = 1,
        compress_sparse_cols: bool = False,
        mp_start_method: str | None = None,
        tensorflow_dataset_prefetch_buffer_size: int = 100,
        label_shapes: list[Any] | None = None,
        reader_pool_type: str = "thread",
        train_reader_num_workers: int = 2,
        val_reader_num_workers: int = 2,
        transformation_edit_fields: list[Any] | None = None,
        transformation_removed_fields: list[str] | None = None,
        input_shapes: list[list[int]] | None = None,
        distributed: str = "horovod",
        trainer_args: dict[str, Any] | None = None,
        logger: Logger | None = None,
        profiler: Profiler | str | None = None,
        log_every_n_steps: int | None = None,
        terminate_on_nan: bool = True,
        num_gpus: int | None = None,
        loss_constructors: list[Callable[[], Any]] | None = None,
        train_minibatch_fn: Callable[..., Any] | None = None,
        debug_data_loader: bool = False,
        data_module: type | None = None,  # Horovod's data module class: no effect here
    ) -> None:
        super().__init__(**passed_params(locals()))

    _framework = "lightning"
    _preload = (  # torch._dynamo: as TorchEstimator's
        "flyte_hvd.estimators.lightning",
        "torch",
        "lightning.pytorch",
        "flyte_hvd.torch",
        "torch._dynamo",
        "flyte_hvd.estimators.rank_tensorboard",  # rank 0's epoch logs
        # Lightning's checkpoint and logger writes check the filesystem against each of these
        # (``cloud_io._is_object_storage``), importing them on rank 0's first save: 1.8 s.
        "s3fs",
        "gcsfs",
        "adlfs",
    )
    _extension = _EXTENSION
    _epoch_in_model = True
    _model_class = TorchModel

    def _check_model(self, features: list[str], labels: list[str]) -> None:
        _import_lightning()
        model = self.getModel()
        if lightning_package(model) is None:
            import torch

            if not isinstance(model, torch.nn.Module):
                raise ValueError(
                    f"`model` must be a LightningModule (of `lightning.pytorch` or "
                    f"`pytorch_lightning`), or a torch.nn.Module with `optimizer` and `loss` "
                    f"(Horovod's legacy mode); found {type(model).__name__}."
                )
            if self.getOptimizer() is None or self.getLoss() is None:
                raise ValueError(
                    f"`model` must be a LightningModule, or for a plain torch.nn.Module "
                    f"({type(model).__name__}), give `optimizer` and `loss` (Horovod's legacy "
                    f"mode: the estimator trains it in a LightningModule built around it)."
                )
        elif self.getOptimizer() is not None or self.getLoss() is not None:
            raise ValueError(
                "LightningEstimator takes the optimizers from the module's "
                "configure_optimizers() and the loss from its training_step(); leave "
                "`optimizer` and `loss` unset."
            )
        if lightning_package(model) is not None:
            _check_batch_use(model, features, labels, self.getSampleWeightCol())
        args = self.getTrainerArgs() or {}
        if not isinstance(args, dict):
            raise ValueError(f"`trainer_args` must be a dict; found {type(args).__name__}.")
        _check_trainer_args(args, lightning_package(model) or LIGHTNING_PACKAGES[0])
        self._check_input_shapes(features)
        check_distributed(self.getDistributed(), self.getGradientCompression())

    def _training_spec(
        self, remote_store: RemoteStore, features: list[str], metadata: Metadata, num_proc: int
    ) -> LightningTrainingSpec:
        input_shapes = resolve_input_shapes(self.getInputShapes(), features, metadata[0])
        labels = list(self.getLabelCols())
        shaped_by_the_steps = labels_the_steps_shape(self.getModel(), labels)
        output_shapes = probe_outputs(self.getModel(), input_shapes, labels)
        return LightningTrainingSpec(
            **self._spec_fields(remote_store, features, metadata),
            model_bytes=cloudpickle.dumps(self._lightning_module(features)),
            lightning_package=lightning_package(self.getModel()) or LIGHTNING_PACKAGES[0],
            input_shapes=input_shapes,
            output_shapes=[
                [] if label in shaped_by_the_steps else shape
                for label, shape in zip(labels, output_shapes, strict=True)
            ],
            trainer_args=dict(self.getTrainerArgs() or {}),
            profiler=self.getProfiler(),
            log_every_n_steps=self.getLogEveryNSteps(),
            logger=self.getLogger(),
            callbacks=list(self.getCallbacks() or []),
            checkpoint_callback=self.getCheckpointCallback(),
            compression=self.getGradientCompression(),
        )

    def _finished_model(self, run_id: str, features: list[str]) -> bytes:
        import torch

        module = cloudpickle.loads(cloudpickle.dumps(self._lightning_module(features)))
        # Written by the run's rank 0 with Lightning's own state (not only tensors).
        saved = torch.load(
            io.BytesIO(self._read_checkpoint(run_id)), map_location="cpu", weights_only=False
        )
        module.load_state_dict(saved["state_dict"])
        return cloudpickle.dumps({"model": module, "optimizer": None})

    def _lightning_module(self, features: list[str]) -> pl.LightningModule:
        """The module the ranks train: the model, or for a plain ``torch.nn.Module`` (Horovod's
        legacy mode) a LightningModule built around it with the optimizer and loss."""
        model = self.getModel()
        if lightning_package(model) is not None:
            return model
        from flyte_hvd.estimators.lightning_legacy import to_lightning_module

        return to_lightning_module(
            model,
            self.getOptimizer(),
            self.getLoss(),
            loss_weights=self.getLossWeights(),
            feature_cols=features,
            label_cols=list(self.getLabelCols()),
            sample_weights_col=self.getSampleWeightCol(),
            validation=self.getValidation(),
        )

    def _remote_trainer(self) -> Callable[[LightningTrainingSpec], dict]:
        return train_on_rank


# -- on the ranks --------------------------------------------------------------------------


class _TensorBatches:
    """A loader as the iterable Lightning reads: dicts of tensors, ``len`` batches an epoch."""

    def __init__(self, loader: BaseDataLoader, spec: LightningTrainingSpec):
        self.loader, self.spec = loader, spec

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        spec = self.spec
        shapes = spec.output_shapes or [[]] * len(spec.labels)
        for batch in self.loader:
            inputs, labels, weights = batch_tensors(batch, spec, spec.input_shapes, "cpu")
            out = dict(zip(spec.features, inputs, strict=True))
            for name, label, shape in zip(spec.labels, labels, shapes, strict=True):
                # As the model's output for it (``F.mse_loss(self(x), y)`` broadcasts a (B,)
                # label against a (B, 1) output); class indices for wider outputs stay (B,).
                rows = len(label)
                if shape and label.numel() == rows * math.prod(shape):
                    label = label.reshape(rows, *shape)
                out[name] = label
            if spec.sample_weight_col is not None and weights is not None:
                out[spec.sample_weight_col] = weights
            yield out


def _recorder_class(package: str) -> type:
    import torch

    callbacks = importlib.import_module(f"{package}.callbacks")
    Checkpoint, ModelCheckpoint = callbacks.Checkpoint, callbacks.ModelCheckpoint

    class RunRecorder(Checkpoint):  # type: ignore[misc,valid-type]
        """Every rank, after each epoch (and after the user's checkpoint callbacks, as a
        ``Checkpoint``): average the epoch's metrics over ranks and save ``last.ckpt``
        (rank 0 writes); rank 0 then hands both to the run's ``training.RunRecord``."""

        def __init__(
            self,
            record: training.RunRecord | None,
            run: training.RankRun,
            logs_dir: str | None,
            spec: LightningTrainingSpec,
        ):
            self.record, self.run, self.logs_dir, self.spec = record, run, logs_dir, spec
            self.history: dict[str, list[float]] = {}
            self.step_losses: list[float] = []  # this epoch's, as training_step returned them

        def on_train_start(self, trainer, pl_module):
            _restore_best(trainer, self.run, ModelCheckpoint)

        def on_train_epoch_start(self, trainer, pl_module):
            if self.record is not None:
                self.record.epoch_begin()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if self.record is not None:
                self.record.step_begin()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            if isinstance(loss, torch.Tensor) and loss.numel() == 1:
                self.step_losses.append(float(loss.detach()))

        def on_train_epoch_end(self, trainer, pl_module):
            import flyte_hvd.torch as hvd

            mine = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
            if self.step_losses:  # what training_step returned, checked if not logged
                mine[_STEP_LOSS] = float(np.mean(self.step_losses))
                self.step_losses = []
            everyone = hvd.allgather_object(mine)
            logs = {k: float(np.mean([m[k] for m in everyone if k in m])) for k in mine}
            # Every rank, on the same averaged values: a NaN loss ends the fit on all of them.
            training.check_loss(self.spec, logs, trainer.current_epoch, self.run.rank)
            logs.pop(_STEP_LOSS, None)
            for key, value in logs.items():
                self.history.setdefault(key, []).append(value)
            last = os.path.join(self.run.work, LAST_MODEL_FILENAME)
            trainer.save_checkpoint(last)  # collective; rank 0 writes
            if self.record is not None:
                saving = _saving_checkpoint(trainer, ModelCheckpoint)
                score = saving.best_model_score if saving else None
                self.record.epoch_end(
                    trainer.current_epoch,
                    logs,
                    last,
                    best_file=saving.best_model_path if saving else None,
                    logs_dir=self.logs_dir,
                    best_value=None if score is None else float(score),
                )

    return RunRecorder


def _restore_best(
    trainer: pl.Trainer,
    run: training.RankRun,
    checkpoint_class: Any,  # ModelCheckpoint of the trainer's package (LIGHTNING_PACKAGES)
) -> None:
    """Lightning restored the checkpoint callbacks' state from last.ckpt, but not their best
    score (the folder changed) nor the best file (it was on another attempt's disk): both are
    taken from the run, so the best of earlier attempts is kept."""
    import torch

    if run.best_value is None:
        return
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, checkpoint_class) and callback.monitor is not None:
            score = torch.tensor(run.best_value)
            path = run.best_file or callback.best_model_path
            callback.best_model_score, callback.best_model_path = score, path
            callback.best_k_models = {path: score}
            callback.kth_best_model_path, callback.kth_value = path, score


def _saving_checkpoint(
    trainer: pl.Trainer,
    checkpoint_class: Any,  # ModelCheckpoint of the trainer's package
) -> Any | None:  # that ModelCheckpoint
    """The first ``ModelCheckpoint`` (of the trainer's package) that holds a best model."""
    return next(
        (
            c
            for c in trainer.checkpoint_callbacks
            if isinstance(c, checkpoint_class) and c.best_model_path
        ),
        None,
    )


def _default_logger(work: str, package: str) -> Logger:
    loggers = importlib.import_module(f"{package}.loggers")
    CSVLogger, TensorBoardLogger = loggers.CSVLogger, loggers.TensorBoardLogger

    tensorboard_without_tensorflow()
    try:
        return TensorBoardLogger(work, name="logs", version="", default_hp_metric=False)
    except ModuleNotFoundError:  # neither tensorboard nor tensorboardX installed
        return CSVLogger(work, name="logs", version="")


def train_on_rank(spec: LightningTrainingSpec) -> dict:
    """The training function every rank runs (see ``LightningEstimator``)."""
    import torch

    import flyte_hvd.torch as hvd

    pl = importlib.import_module(spec.lightning_package)
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
        logger = (
            spec.logger
            if spec.logger is not None
            else _default_logger(run.work, spec.lightning_package)
        )
        logs_dir = os.path.join(run.work, "logs") if spec.logger is None else None
        record = (
            training.RunRecord(spec.store, run.state, spec.epochs, _EXTENSION, spec.verbose)
            if run.rank == 0
            else None
        )
        recorder = _recorder_class(spec.lightning_package)(record, run, logs_dir, spec)
        callbacks.append(recorder)
        args: dict[str, Any] = dict(
            max_epochs=spec.epochs,
            **_placement(spec, pl, hvd, run.size),
            logger=logger,
            callbacks=callbacks,
            default_root_dir=run.work,
            use_distributed_sampler=False,
            # As Horovod: rank 0 shows Lightning's progress bar and model summary.
            enable_progress_bar=run.rank == 0 and spec.verbose >= 1,
            enable_model_summary=run.rank == 0 and spec.verbose >= 1,
            num_sanity_val_steps=0,
            log_every_n_steps=spec.log_every_n_steps or max(1, min(50, len(train))),
            profiler=spec.profiler,
        )
        args.update(spec.trainer_args)
        if args.pop(_SWA_ARG, False):
            callbacks.append(_weight_averaging(pl))
        trainer = pl.Trainer(**args)
        with ddp_process_group(spec.distributed, None):  # the strategy initializes it
            trainer.fit(
                module,
                train_dataloaders=_TensorBatches(train, spec),
                val_dataloaders=_TensorBatches(val, spec) if val is not None else None,
                ckpt_path=run.resume_file,
                weights_only=False,  # written by this run's rank 0 (it holds non-tensor state)
            )
        best = _best_path(trainer, spec.lightning_package)
        if run.rank == 0 and best:
            saved = torch.load(best, map_location="cpu", weights_only=False)
            module.load_state_dict(saved["state_dict"])
        module = module.cpu()
        run.log_model(
            record,
            lambda mlflow, registered: mlflow.pytorch.log_model(
                module,
                name="model",
                registered_model_name=registered,
                pip_requirements=tracking.pinned("torch", "lightning", "cloudpickle", "numpy"),
            ),
        )
        return run.result(
            lambda: cloudpickle.dumps({"model": module, "optimizer": None}), recorder.history
        )


def _placement(
    spec: LightningTrainingSpec, pl: ModuleType, hvd: ModuleType, size: int
) -> dict[str, Any]:
    """The Trainer's strategy, accelerator, devices and nodes: this rank's GPU with
    ``use_gpu`` where there is one; with ``distributed='ddp'`` each rank is a node of its own
    (see ``ddp_strategy``), else one Horovod strategy reduces the gradients."""
    import torch

    from flyte_hvd.torch.strategy import ddp_strategy, strategy_for

    use_gpu = spec.use_gpu and torch.cuda.is_available()
    if spec.distributed == "ddp":
        strategy = ddp_strategy(pl, use_gpu)
        devices, nodes = ([hvd.local_rank()] if use_gpu else 1), size
    else:
        strategy = strategy_for(pl)(compression=spec.compression or hvd.Compression.none)
        devices, nodes = 1, 1
    return {
        "strategy": strategy,
        "accelerator": "gpu" if use_gpu else "cpu",
        "devices": devices,
        "num_nodes": nodes,
    }


def _best_path(trainer: pl.Trainer, package: str) -> str | None:
    """The best checkpoint a monitoring ``ModelCheckpoint`` holds on this rank, if any."""
    ModelCheckpoint = importlib.import_module(f"{package}.callbacks").ModelCheckpoint

    return next(
        (
            c.best_model_path
            for c in trainer.checkpoint_callbacks
            if isinstance(c, ModelCheckpoint)
            and c.best_model_path
            and os.path.exists(c.best_model_path)
        ),
        None,
    )
