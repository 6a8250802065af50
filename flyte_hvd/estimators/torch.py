"""``TorchEstimator`` and ``TorchModel``: fit a PyTorch model on a Spark DataFrame across
ranks, predict with ``transform``.

Everything but the training loop is the shared estimator machinery (``estimator.py``,
``training.py``): params, data preparation, launch, the run's record in the store, resume,
transform and save/load. On the ranks each batch becomes tensors (features reshaped by
``input_shapes``), ``train_minibatch_fn`` runs forward, loss and backward, and
``flyte_hvd.torch.DistributedOptimizer`` averages the gradients (with ``distributed="ddp"``,
torch's ``DistributedDataParallel`` over a ``torch.distributed`` process group). Rank 0 writes
``runs/<run_id>/last.pt`` and ``checkpoint.pt`` (model and optimizer ``state_dict``, learning
rate as given) and ``state.json`` after each epoch; a ``fit`` with an existing ``run_id``, or
a Spark retry, resumes after the last completed epoch.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeAlias, cast

import cloudpickle
import numpy as np

from flyte_hvd.core.checks import require_int
from flyte_hvd.data.store import Store
from flyte_hvd.estimators import tracking, training
from flyte_hvd.estimators.backend import Backend
from flyte_hvd.estimators.base import HorovodEstimator, Metadata
from flyte_hvd.estimators.params import (
    DISTRIBUTED_PARAM,
    ESTIMATOR_PARAMS,
    NAN_PARAM,
    check_distributed,
    check_learning_rate,
    passed_params,
    with_params,
)
from flyte_hvd.estimators.torch_model import (
    INPUT_SHAPES_PARAM,
    ModelOutput,
    ShapedInputs,
    TorchLoss,
    TorchModel,
    batch_tensors,
    check_forward_arity,
    ddp_process_group,
    import_torch,
    resolve_input_shapes,
)
from flyte_hvd.estimators.tracking import MlflowConfig
from flyte_hvd.estimators.training import TrainingSpec

if TYPE_CHECKING:
    import torch
    from torch.utils.tensorboard import SummaryWriter

    from flyte_hvd.core.compression import Compressor
    from flyte_hvd.data.loader import BaseDataLoader, Batch
    from flyte_hvd.data.store import RemoteStore

# The step: fn(model, optimizer, transform_outputs, loss_fn, inputs, labels, sample_weights)
# -> (outputs, loss), Horovod's ``train_minibatch_fn``.
MinibatchFn: TypeAlias = "Callable[..., tuple[list[torch.Tensor], torch.Tensor]]"
# The losses of a batch: (outputs, labels, sample weights or None) -> their weighted sum.
LossFn: TypeAlias = (
    "Callable[[list[torch.Tensor], list[torch.Tensor], torch.Tensor | None], torch.Tensor]"
)

TORCH_PARAMS: dict[str, tuple[Any, str]] = {
    **INPUT_SHAPES_PARAM,
    **DISTRIBUTED_PARAM,
    "loss_constructors": (
        None,
        "functions that build the loss functions on the ranks (for losses that do not pickle)",
    ),
    "train_minibatch_fn": (
        None,
        "fn(model, optimizer, transform_outputs, loss_fn, inputs, labels, sample_weights) "
        "-> (outputs, loss)",
    ),
    "backward_passes_per_step": (1, "backward passes accumulated locally per reduction"),
    **NAN_PARAM,
}


_EXTENSION = ".pt"
LAST_MODEL_FILENAME = "last.pt"


@dataclass(kw_only=True)
class TorchTrainingSpec(TrainingSpec):
    """The common spec plus what a PyTorch rank needs."""

    input_shapes: list[list[int]]
    losses: list[TorchLoss] | None = None
    loss_constructors: list[Callable[[], TorchLoss]] | None = None
    loss_weights: list[float] | None = None
    metrics: list[TorchLoss] = field(default_factory=list)
    train_minibatch_fn: MinibatchFn | None = None
    backward_passes_per_step: int = 1
    compression: type[Compressor] | None = None


# -- checks shared with LightningEstimator ---------------------------------------------------


def _check_callables(name: str, value: object) -> list[TorchLoss]:
    items: list = list(value) if isinstance(value, list | tuple) else [value]
    bad = [v for v in items if not callable(v)]
    if bad:
        raise ValueError(f"`{name}` must be a function or a list of functions; found {bad[0]!r}.")
    return items


# -- the estimator -------------------------------------------------------------------------


@with_params({**ESTIMATOR_PARAMS, **TORCH_PARAMS})
class TorchEstimator(ShapedInputs, HorovodEstimator):
    """Train a ``torch.nn.Module`` on a Spark DataFrame with Horovod's estimator API.

    ``model`` and ``optimizer`` (built on ``model.parameters()``) are required, and ``loss``
    (a function ``loss(output, label)``, or one per label) or ``loss_constructors``. With
    ``sample_weight_col`` the loss is called with ``reduction='none'``. ``metrics`` are
    functions ``metric(output, label)``, averaged over batches and ranks. The learning rate
    given is the single-rank rate: ranks scale it by ``size()``, and the returned optimizer
    holds the rate given. ``fit(df)`` returns a ``TorchModel``. With ``distributed="ddp"``
    the model is trained inside ``DistributedDataParallel`` (``train_minibatch_fn`` gets the
    wrapped model), and the returned model is the plain module.
    """

    def __init__(
        self,
        *,
        num_proc: int | None = None,
        backend: Backend | None = None,
        store: Store | None = None,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        loss: TorchLoss | list[TorchLoss] | None = None,
        loss_weights: list[float] | None = None,
        metrics: list[TorchLoss] | None = None,
        custom_objects: dict[str, Any] | None = None,
        feature_cols: list[str] | None = None,
        label_cols: list[str] | None = None,
        validation: float | str | None = None,
        sample_weight_col: str | None = None,
        callbacks: list[Any] | None = None,
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
        checkpoint_callback: object = None,  # refused: Keras' and Lightning's param
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
        loss_constructors: list[Callable[[], TorchLoss]] | None = None,
        train_minibatch_fn: MinibatchFn | None = None,
        terminate_on_nan: bool = True,
    ) -> None:
        super().__init__(**passed_params(locals()))

    _framework = "torch"
    # torch._dynamo: the first `optimizer.state_dict()` (broadcast_optimizer_state) imports it,
    # 2-3 s on two busy cores, which a spare rank pays before the job comes.
    _preload = (
        "flyte_hvd.estimators.torch",
        "torch",
        "flyte_hvd.torch",
        "torch._dynamo",
        "flyte_hvd.estimators.rank_tensorboard",  # rank 0's epoch logs
    )
    _extension = _EXTENSION

    def _check_model(self, features: list[str], labels: list[str]) -> None:
        torch = import_torch()
        model, optimizer = self.getModel(), self.getOptimizer()
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"`model` must be a torch.nn.Module; found {type(model).__name__}.")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(
                f"`optimizer` is required: a torch.optim.Optimizer built on the model's "
                f"parameters, e.g. torch.optim.Adam(model.parameters(), lr=0.01); found "
                f"{type(optimizer).__name__}."
            )
        check_forward_arity(model, features)
        own = {id(p) for p in model.parameters()}
        if any(id(p) not in own for g in optimizer.param_groups for p in g["params"]):
            raise ValueError(
                "`optimizer` holds parameters that are not the model's: build it on "
                "`model.parameters()` of the model passed as `model`."
            )
        for group in optimizer.param_groups:
            check_learning_rate(group.get("lr"), f"`optimizer` ({type(optimizer).__name__})")
        if not self.getLoss() and not self.getLossConstructors():
            raise ValueError(
                "`loss` (or `loss_constructors`) is required: e.g. "
                "loss=torch.nn.functional.mse_loss, or one loss per label column."
            )
        if self.getLoss():
            _check_callables("loss", self.getLoss())
        if self.getLossConstructors():
            _check_callables("loss_constructors", self.getLossConstructors())
        _check_callables("metrics", self.getMetrics() or [])
        self._check_input_shapes(features)
        require_int("backward_passes_per_step", self.getBackwardPassesPerStep(), minimum=1)
        check_distributed(self.getDistributed(), self.getGradientCompression())
        if self.getCallbacks() or self.getCheckpointCallback() is not None:
            raise ValueError(
                "`callbacks` and `checkpoint_callback` apply to KerasEstimator and "
                "LightningEstimator; TorchEstimator saves the last epoch each epoch. Customize "
                "the step with `train_minibatch_fn`, or use LightningEstimator."
            )

    def _training_spec(
        self, remote_store: RemoteStore, features: list[str], metadata: Metadata, num_proc: int
    ) -> TorchTrainingSpec:
        loss = self.getLoss()
        return TorchTrainingSpec(
            **self._spec_fields(remote_store, features, metadata),
            model_bytes=cloudpickle.dumps(
                {"model": self.getModel(), "optimizer": self.getOptimizer()}
            ),
            input_shapes=resolve_input_shapes(self.getInputShapes(), features, metadata[0]),
            losses=_check_callables("loss", loss) if loss else None,
            loss_constructors=list(self.getLossConstructors() or []) or None,
            loss_weights=self.getLossWeights(),
            metrics=list(self.getMetrics() or []),
            train_minibatch_fn=self.getTrainMinibatchFn(),
            backward_passes_per_step=self.getBackwardPassesPerStep(),
            compression=self.getGradientCompression(),
        )

    def _remote_trainer(self) -> Callable[[TorchTrainingSpec], dict]:
        return train_on_rank

    def _finished_model(self, run_id: str, features: list[str]) -> bytes:
        return cloudpickle.dumps(self._load_checkpoint(run_id))

    def _load_checkpoint(self, run_id: str) -> dict:
        """The run's last model and optimizer: copies of the estimator's (still linked to
        each other) holding the state the run saved, with the learning rate given."""
        import torch

        saved = torch.load(
            io.BytesIO(self._read_checkpoint(run_id)), map_location="cpu", weights_only=True
        )
        packed = cloudpickle.loads(
            cloudpickle.dumps({"model": self.getModel(), "optimizer": self.getOptimizer()})
        )
        packed["model"].load_state_dict(saved["model"])
        if packed["optimizer"] is not None:
            packed["optimizer"].load_state_dict(saved["optimizer"])
        return packed


TorchEstimator._model_class = TorchModel


# -- on the ranks --------------------------------------------------------------------------


def _transform_outputs(
    outputs: ModelOutput, labels: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Outputs as a list; each label reshaped to its output's shape when the sizes agree."""
    outputs = list(outputs) if isinstance(outputs, list | tuple) else [outputs]
    labels = [
        label.reshape(out.shape) if out.numel() == label.numel() else label
        for out, label in zip(outputs, labels, strict=True)
    ]
    return outputs, labels


def _loss_function(spec: TorchTrainingSpec, losses: list[TorchLoss]) -> LossFn:
    n = len(spec.labels)
    fns = losses if len(losses) > 1 else losses * n
    weights = spec.loss_weights or [1.0 / n] * n

    def loss_fn(
        outputs: list[torch.Tensor], labels: list[torch.Tensor], sample_weights: torch.Tensor | None
    ) -> torch.Tensor:
        # Each step runs this: a lone loss of weight 1 is returned as it is, without the two
        # graph nodes (x * 1.0, 0 + x) that would change nothing but the step's time.
        total = None
        for out, label, fn, w in zip(outputs, labels, fns, weights, strict=True):
            if sample_weights is None:
                term = fn(out, label)
            else:
                # Per-row losses times their weights, averaged over the batch (Horovod's rule).
                term = (fn(out, label, reduction="none").flatten() * sample_weights).mean()
            if w != 1.0:
                term = term * w
            total = term if total is None else total + term
        return cast("torch.Tensor", total)  # a term per label, and there is at least one

    return loss_fn


def _default_train_minibatch(backward_passes_per_step: int) -> MinibatchFn:
    """zero_grad, forward, loss, backward, step; with ``backward_passes_per_step`` = n > 1,
    n batches' gradients (each loss divided by n) are summed before one step (a DDP model
    reduces only the last pass's: the others run in its ``no_sync()``)."""
    passes = {"count": 0}
    n = backward_passes_per_step

    def train_minibatch(
        model, optimizer, transform_outputs, loss_fn, inputs, labels, sample_weights
    ):
        if passes["count"] % n == 0:
            optimizer.zero_grad()
        stepping = (passes["count"] + 1) % n == 0
        local = model.no_sync() if not stepping and hasattr(model, "no_sync") else None
        with local or contextlib.nullcontext():
            outputs = model(*inputs)
            outputs, labels = transform_outputs(outputs, labels)
            loss = loss_fn(outputs, labels, sample_weights)
            (loss / n if n > 1 else loss).backward()
        passes["count"] += 1
        if passes["count"] % n == 0:
            optimizer.step()
        return outputs, loss

    return train_minibatch


def _scale_lr(optimizer: torch.optim.Optimizer, factor: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * factor


def _state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer, size: int) -> dict:
    """Model and optimizer state with the learning rate as the user gave it."""
    optimizer_state = optimizer.state_dict()
    for group in optimizer_state["param_groups"]:
        group["lr"] = group["lr"] / size
    return {"model": model.state_dict(), "optimizer": optimizer_state}


def train_on_rank(spec: TorchTrainingSpec) -> dict:
    """The training function every rank runs (see ``TorchEstimator``)."""
    import torch

    import flyte_hvd.torch as hvd
    from flyte_hvd.torch.optimizer import unwrap

    with (
        training.rank_run(spec, hvd, _EXTENSION, seed=torch.manual_seed) as run,
        contextlib.ExitStack() as stack,
    ):
        rank, size = run.rank, run.size
        device = _device(spec, hvd)
        backend = "nccl" if device.type == "cuda" else "gloo"
        stack.enter_context(ddp_process_group(spec.distributed, backend))
        model, net, optimizer, loss_fn = _distributed_model(spec, run, hvd, device)
        train_loader, val_loader = training.make_loaders(spec, rank, size)
        minibatch = spec.train_minibatch_fn or _default_train_minibatch(
            spec.backward_passes_per_step
        )
        record = training.RunRecord(spec.store, run.state, spec.epochs, _EXTENSION, spec.verbose)
        last_local = os.path.join(run.work, LAST_MODEL_FILENAME)
        logs_dir = os.path.join(run.work, "logs")
        # Imported here, never on the driver: the module marks its process as TensorFlow-free.
        from flyte_hvd.estimators.rank_tensorboard import summary_writer

        writer = summary_writer(logs_dir) if rank == 0 else None
        history: dict[str, list[float]] = {}
        for epoch in range(run.initial_epoch, spec.epochs):
            record.epoch_begin()
            net.train()
            sums: dict[str, float] = {}
            for batch in train_loader.iter_epoch(epoch):
                record.step_begin()
                inputs, labels, weights = batch_tensors(batch, spec, spec.input_shapes, device)
                outputs, loss = minibatch(
                    net, optimizer, _transform_outputs, loss_fn, inputs, labels, weights
                )
                _add_metrics(sums, "", loss, outputs, labels, spec)
            logs = _mean(sums, len(train_loader))
            if val_loader is not None:
                logs.update(_validate(model, val_loader, epoch, loss_fn, spec, device))
            logs = _average_over_ranks(hvd, logs)
            training.check_loss(spec, logs, epoch, rank)
            for key, value in logs.items():
                history.setdefault(key, []).append(value)
            if rank == 0:
                _write_scalars(writer, logs, epoch)
                torch.save(_state_dicts(model, optimizer, size), last_local)
                record.epoch_end(epoch, logs, last_local, logs_dir=logs_dir)
        if writer is not None:
            writer.close()
        if spec.distributed != "ddp":
            unwrap(optimizer)
        optimizer.zero_grad(set_to_none=True)
        _scale_lr(optimizer, 1.0 / size)  # hand back the rate given
        model = model.cpu()
        run.log_model(
            record,
            lambda mlflow, registered: mlflow.pytorch.log_model(
                model,
                name="model",
                registered_model_name=registered,
                pip_requirements=tracking.pinned("torch", "cloudpickle", "numpy"),
            ),
        )
        return run.result(
            lambda: cloudpickle.dumps({"model": model, "optimizer": optimizer}), history
        )


def _device(spec: TorchTrainingSpec, hvd: ModuleType) -> torch.device:
    """This rank's GPU (by local rank) with ``use_gpu`` where there is one, else the CPU."""
    import torch

    if not (spec.use_gpu and torch.cuda.is_available()):
        return torch.device("cpu")
    device = torch.device("cuda", hvd.local_rank())
    torch.cuda.set_device(device)  # NCCL builds its communicator on the current GPU
    return device


def _distributed_model(
    spec: TorchTrainingSpec, run: training.RankRun, hvd: ModuleType, device: torch.device
) -> tuple[torch.nn.Module, torch.nn.Module, torch.optim.Optimizer, LossFn]:
    """The model on ``device`` and its optimizer, resumed from the run's checkpoint (rank 0)
    and made the same on every rank, the rate scaled by the ranks' number; what the steps
    call (the model, or DDP's wrapper of it: with ``distributed='horovod'`` the optimizer
    reduces the gradients instead); and the loss function."""
    import torch

    packed = cloudpickle.loads(spec.model_bytes)
    model, optimizer = packed["model"].to(device), packed["optimizer"]
    losses = spec.losses or [build() for build in spec.loss_constructors or []]
    loss_fn = _loss_function(spec, losses)
    if run.resume_file:  # rank 0; the others get its state by the broadcasts below
        saved = torch.load(run.resume_file, map_location=device, weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
    _scale_lr(optimizer, run.size)  # scaled once, also on resume (checkpoints hold the rate given)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    net = model
    if spec.distributed == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    else:
        hvd.DistributedOptimizer(
            optimizer,
            named_parameters=model.named_parameters(),
            compression=spec.compression or hvd.Compression.none,
            backward_passes_per_step=spec.backward_passes_per_step,
        )
    return model, net, optimizer, loss_fn


def _validate(
    model: torch.nn.Module,
    loader: BaseDataLoader,
    epoch: int,
    loss_fn: LossFn,
    spec: TorchTrainingSpec,
    device: torch.device,
) -> dict[str, float]:
    """This rank's validation loss and metrics of the epoch (``val_`` names)."""
    import torch

    model.eval()
    sums: dict[str, float] = {}
    with torch.no_grad():
        for batch in loader.iter_epoch(epoch):
            inputs, labels, weights = batch_tensors(batch, spec, spec.input_shapes, device)
            outputs, labels = _transform_outputs(model(*inputs), labels)
            loss = loss_fn(outputs, labels, weights)
            _add_metrics(sums, "val_", loss, outputs, labels, spec)
    return _mean(sums, len(loader))


def _write_scalars(writer: SummaryWriter | None, logs: dict[str, float], epoch: int) -> None:
    """The epoch's metrics in the run's TensorBoard logs (when tensorboard is installed)."""
    if writer is None:
        return
    for key, value in logs.items():
        writer.add_scalar(key, value, epoch)
    writer.flush()


def _add_metrics(
    sums: dict[str, float],
    prefix: str,
    loss: torch.Tensor,
    outputs: list[torch.Tensor],
    labels: list[torch.Tensor],
    spec: TorchTrainingSpec,
) -> None:
    sums[f"{prefix}loss"] = sums.get(f"{prefix}loss", 0.0) + float(loss.detach())
    if not spec.metrics:  # runs every step: the outputs are shaped only for metrics
        return
    outputs, labels = _transform_outputs(outputs, labels)
    for metric in spec.metrics:
        name = getattr(metric, "__name__", type(metric).__name__)
        for out, label, column in zip(outputs, labels, spec.labels, strict=True):
            key = f"{prefix}{name}" if len(spec.labels) == 1 else f"{prefix}{name}_{column}"
            sums[key] = sums.get(key, 0.0) + float(metric(out.detach(), label))


def _mean(sums: dict[str, float], steps: int) -> dict[str, float]:
    return {k: v / max(steps, 1) for k, v in sums.items()}


def _average_over_ranks(hvd: ModuleType, logs: dict[str, float]) -> dict[str, float]:
    """Every rank runs the same steps, so the mean of the ranks' means is the global mean."""
    keys = sorted(logs)
    values = hvd.allreduce(np.array([logs[k] for k in keys], dtype=np.float64))
    return {k: float(v) for k, v in zip(keys, np.asarray(values), strict=True)}
