"""What ``TorchEstimator`` and ``LightningEstimator`` share: ``TorchModel`` (the trained
model as a Transformer), ``input_shapes`` checked against the feature columns, the model run
once on zeros before any rank starts, and loader batches turned into tensors on the ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeAlias

import cloudpickle
import numpy as np

from flyte_hvd.estimators import prediction
from flyte_hvd.estimators.base import BatchPredictor, Broadcaster, HorovodModel, Metadata
from flyte_hvd.estimators.params import MODEL_PARAMS, with_params
from flyte_hvd.estimators.training import TrainingSpec

if TYPE_CHECKING:
    import pyarrow as pa
    import torch

    from flyte_hvd.data.dataset import DatasetMetadata

# A loss or metric function: ``fn(output, label)`` (a loss also takes ``reduction='none'``
# with sample weights) -> a tensor.
TorchLoss: TypeAlias = "Callable[..., torch.Tensor]"
# What a model's forward returns: one output, or one per label.
ModelOutput: TypeAlias = "torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...]"

INPUT_SHAPES_PARAM: dict[str, tuple[Any, str]] = {
    "input_shapes": (
        None,
        "each feature's model input shape, batch dimension -1 (default: the column's shape)",
    ),
}


TORCH_MODEL_PARAMS: dict[str, tuple[Any, str]] = {
    "input_shapes": (None, "each feature's model input shape, batch dimension -1"),
    "output_shapes": (None, "each output's shape per row"),
    "loss": (None, "the loss the model was trained with"),
    "loss_constructors": (None, "the functions that built the losses on the ranks"),
    "optimizer": (None, "the optimizer (default: the trained one, with the rate given)"),
}


def import_torch() -> ModuleType:
    """``torch``, or an ImportError that names the extra to install."""
    try:
        import torch
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            "TorchEstimator needs PyTorch: install the extra `pip install flyte-hvd[torch]`."
        ) from error
    return torch


def resolve_input_shapes(
    given: list[list[int]] | None, features: list[str], metadata: DatasetMetadata
) -> list[list[int]]:
    """One input shape per feature column (batch dimension -1), checked against the number of
    values per row the column holds (``check_shape_compatibility``). A row's shape without
    the batch dimension, as Horovod also accepts, gets one."""
    from flyte_hvd.data.dataset import check_shape_compatibility

    if given is None:
        return [[-1, *(metadata.column(c).shape or (1,))] for c in features]
    check_shape_compatibility(metadata, features, [], input_shapes=given)
    return with_batch_dimension(given)


def with_batch_dimension(shapes: list[list[int]]) -> list[list[int]]:
    """Input shapes with the batch dimension -1 first (added where a shape is a row's)."""
    return [list(s) if list(s)[:1] == [-1] else [-1, *s] for s in shapes]


def check_forward_arity(model: torch.nn.Module, features: list[str]) -> None:
    """Each feature column is one argument of ``model.forward``: a forward taking fewer
    positional arguments than there are feature columns is refused before any work starts,
    with the two ways to fix it."""
    import inspect

    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):  # a forward Python cannot inspect: the probe tells
        return
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return
    names = [p.name for p in params if p.kind in kinds]
    if len(names) >= len(features):
        return
    raise ValueError(
        f"the model's forward() takes {len(names)} input(s) ({', '.join(names) or 'none'}) but "
        f"`feature_cols` names {len(features)} columns {features}: each feature column is "
        f"one argument of forward(). Put the columns in one vector column with "
        f"pyspark.ml.feature.VectorAssembler(inputCols={features}, outputCol='features') and "
        f"pass feature_cols=['features'], or give forward() one argument per column "
        f"(forward(self, {', '.join(features)}))."
    )


def probe_outputs(
    model: torch.nn.Module, input_shapes: list[list[int]], labels: list[str]
) -> list[list[int]]:
    """Run the model once on zeros shaped by ``input_shapes`` (on a copy, in eval mode), so a
    model that cannot take them fails here, before any rank starts. Returns each output's
    shape per row."""
    import copy

    torch = import_torch()
    probe = copy.deepcopy(model).eval()
    inputs = [torch.zeros((2, *shape[1:]), dtype=torch.float32) for shape in input_shapes]
    try:
        with torch.no_grad():
            outputs = probe(*inputs)
    except Exception as error:
        raise ValueError(
            f"the model cannot run on inputs shaped by `input_shapes`={input_shapes} "
            f"(one per feature column, batch dimension -1): {type(error).__name__}: {error}. "
            f"Make `input_shapes` match the model's forward()."
        ) from None
    outputs = list(outputs) if isinstance(outputs, list | tuple) else [outputs]
    if len(outputs) != len(labels):
        raise ValueError(
            f"the model returns {len(outputs)} output(s) but `label_cols` names {len(labels)} "
            f"column(s) {labels}: label columns map to the outputs in order."
        )
    return [list(o.shape[1:]) for o in outputs]


class ShapedInputs:
    """What the PyTorch estimators share: ``input_shapes`` checked against the feature
    columns, and the model run once on zeros of those shapes before any rank starts."""

    if TYPE_CHECKING:  # a mixin of estimators whose params ``with_params`` adds
        # The accessors are generated from the params table: each gives its param's value.
        def __getattr__(self, name: str) -> Any: ...

    def _check_input_shapes(self, features: list[str]) -> None:
        shapes = self.getInputShapes()
        if shapes is not None and (
            not isinstance(shapes, list | tuple) or len(shapes) != len(features)
        ):
            raise ValueError(
                f"`input_shapes` must list one shape per feature column ({len(features)}: "
                f"{features}); found {shapes!r}."
            )

    def _check_data(self, features: list[str], metadata: Metadata) -> dict[str, Any]:
        shapes = resolve_input_shapes(self.getInputShapes(), features, metadata[0])
        outputs = probe_outputs(self.getModel(), shapes, list(self.getLabelCols()))
        for output, label in zip(outputs, self.getLabelCols(), strict=True):
            have = metadata[0].column(label).size
            # One value per row may be a class index (cross entropy); wider labels are
            # compared value by value.
            if have > 1 and math.prod(output) != have:
                raise ValueError(
                    f"the model's output for label `{label}` gives {math.prod(output)} value(s) "
                    f"per row (shape {output}) but the column holds {have}: give the model an "
                    f"output of width {have}."
                )
        return {
            "input_shapes": shapes,
            "output_shapes": outputs,
            "loss": self.getLoss(),
            "loss_constructors": self.getOrDefault("loss_constructors")
            if self.hasParam("loss_constructors")
            else None,
        }


@with_params({**MODEL_PARAMS, **TORCH_MODEL_PARAMS})
class TorchModel(HorovodModel):
    """A trained PyTorch (or Lightning) model as a Transformer. Each prediction column has its
    label's type (``prediction.output_schema``): class scores for a scalar label are a vector."""

    _archive_name = "torch_model.zip"
    _model_file = "model.pkl"

    def getModel(self) -> torch.nn.Module:
        """The trained ``torch.nn.Module`` (a ``LightningModule`` from LightningEstimator),
        in eval mode."""
        return super().getModel()["model"].eval()

    def getOptimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer, with the learning rate given (None from LightningEstimator), unless
        ``setOptimizer`` replaced it."""
        if self.isSet(self.optimizer):
            return self.getOrDefault(self.optimizer)
        return super().getModel()["optimizer"]

    def _load_model(self, data: bytes) -> dict:
        import_torch()
        return cloudpickle.loads(data)

    def _model_to_bytes(self, model: torch.nn.Module) -> bytes:
        return cloudpickle.dumps({"model": model, "optimizer": None})

    def _output_widths(self) -> list[int]:
        shapes = self.getOutputShapes()
        if shapes is None:  # a model given as it is, not from a fit: run it once
            shapes = probe_outputs(
                self.getModel(),
                with_batch_dimension(self.getInputShapes()),
                list(self.getLabelColumns()),
            )
        return [math.prod(shape) for shape in shapes]

    def _batch_predictor(self, sc: Broadcaster) -> BatchPredictor:
        model_bytes = sc.broadcast(self._trained_bytes())
        shapes = with_batch_dimension(self.getInputShapes())

        def load(data: bytes) -> torch.nn.Module:
            return cloudpickle.loads(data)["model"].eval()

        def predict(columns: list[pa.Array]) -> list[pa.Array]:
            import torch

            model = prediction.worker_model(model_bytes.value, load)
            inputs = [
                torch.from_numpy(
                    np.require(
                        prediction.column_array(column, tuple(shape[1:])), np.float32, ["C", "W"]
                    )
                )
                for column, shape in zip(columns, shapes, strict=True)
            ]
            with torch.no_grad():
                outputs = model(*inputs)
            outputs = list(outputs) if isinstance(outputs, list | tuple) else [outputs]
            return prediction.prediction_columns(
                [o.detach().cpu().numpy() for o in outputs], len(columns[0])
            )

        return predict


def batch_tensors(
    batch: dict[str, np.ndarray],
    spec: TrainingSpec,
    input_shapes: list[list[int]],
    device: torch.device | str,
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor | None]:
    """A loader batch as (inputs reshaped by ``input_shapes``, labels, sample weights or
    None): floats as float32, integer labels as int64."""
    import torch

    on_cpu = torch.device(device).type == "cpu"  # a device or its name ("cpu")

    def tensor(values: np.ndarray, dtype: type[np.generic]) -> torch.Tensor:
        # Loader batches may be read-only views of Arrow buffers; torch wants writable memory.
        # Runs every step: arrays that are already right (the in-memory shard's) go as they are.
        flags = values.flags
        if values.dtype != dtype or not (flags.c_contiguous and flags.writeable):
            values = np.require(values, dtype=dtype, requirements=["C", "W"])
        out = torch.from_numpy(values)
        return out if on_cpu else out.to(device)

    inputs = [
        tensor(batch[c], np.float32).reshape(shape)
        for c, shape in zip(spec.features, input_shapes, strict=True)
    ]
    labels = []
    for c in spec.labels:
        values = batch[c]
        labels.append(tensor(values, np.float32 if values.dtype.kind in "fc" else np.int64))
    weights = None
    if spec.sample_weight_col:
        weights = tensor(batch[spec.sample_weight_col], np.float32)
    return inputs, labels, weights


@contextmanager
def ddp_process_group(distributed: str, backend: str | None) -> Iterator[None]:
    """With ``distributed="ddp"``, the rank's ``torch.distributed`` process group for the
    block: initialized from the rank's ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``
    with ``backend`` (None: Lightning's strategy initializes it), and destroyed when the block
    ends, so the process holds no group (gloo's threads, NCCL's communicators) past its
    training. After an error it is left to the process's end: the run is failing, and
    tearing NCCL down while peers may still wait in a collective can block."""
    if distributed != "ddp":
        yield
        return
    import torch.distributed as dist

    if backend is not None and not dist.is_initialized():
        dist.init_process_group(backend)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def tensorboard_without_tensorflow() -> None:
    """Make TensorBoard's writer use its built-in stub instead of importing TensorFlow (about
    10 s per rank process, for nothing a PyTorch rank needs). TensorBoard skips the import
    when the marker module ``tensorboard.compat.notf`` exists; a process that already
    imported TensorFlow is left as it is."""
    import sys
    import types

    if "tensorflow" not in sys.modules:
        sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("notf"))
