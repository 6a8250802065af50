"""Horovod's Lightning "legacy mode": a plain ``torch.nn.Module`` with an ``optimizer`` and a
``loss``, trained by the Lightning estimator as a ``LightningModule`` built around it.

``to_lightning_module`` builds that module (Horovod's name and arguments): its step feeds the
batch's feature columns to the model in order, shapes each label like the model's output it
goes with, and sums the losses (weighted by ``loss_weights``; with a sample weight column, each
row's loss is weighted before the mean). The optimizer is built again on the module's
parameters from the one given (its class, settings and state): an optimizer that travelled by
pickle would point at the driver's copies of the parameters.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, cast

from flyte_hvd.core.checks import to_list

if TYPE_CHECKING:
    import lightning.pytorch as pl
    import torch

    from flyte_hvd.estimators.torch_model import ModelOutput, TorchLoss


def to_lightning_module(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fns: TorchLoss | list[TorchLoss],
    loss_weights: list[float] | None,
    feature_cols: list[str],
    label_cols: list[str],
    sample_weights_col: str | None,
    validation: float | str | None,
    package: str = "lightning.pytorch",
) -> pl.LightningModule:
    """A ``LightningModule`` (of ``package``) that trains ``model`` with ``optimizer`` and
    ``loss_fns`` (one function per label, or one for all)."""
    base = importlib.import_module(package).LightningModule
    losses: list[TorchLoss] = to_list(loss_fns, len(label_cols)) or []
    weights = list(loss_weights or [1.0 / len(label_cols)] * len(label_cols))
    optimizer_cls = type(optimizer)
    defaults = getattr(optimizer, "defaults", None)  # torch optimizers' settings (lr, ...)
    settings = dict(defaults) if isinstance(defaults, dict) else {}
    state = optimizer.state_dict()

    class LegacyModule(base):  # type: ignore[misc,valid-type]
        def __init__(self) -> None:
            super().__init__()
            self._model = model

        def forward(self, *args: torch.Tensor, **kwargs: object) -> ModelOutput:
            return self._model(*args, **kwargs)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            rebuilt = optimizer_cls(self.parameters(), **settings)
            rebuilt.load_state_dict(state)
            return rebuilt

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss = self._step(batch)
            self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
            return loss

        def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
            self.log("val_loss", self._step(batch), sync_dist=True)

        def _step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            outputs = self(*[batch[c].float() for c in feature_cols])
            outputs = list(outputs) if isinstance(outputs, list | tuple) else [outputs]
            labels = [
                label.reshape(output.shape) if label.numel() == output.numel() else label
                for label, output in zip((batch[c] for c in label_cols), outputs, strict=True)
            ]
            sample_weights = batch[sample_weights_col] if sample_weights_col else None
            return self._calculate_loss(outputs, labels, sample_weights)

        def _calculate_loss(
            self,
            outputs: list[torch.Tensor],
            labels: list[torch.Tensor],
            sample_weights: torch.Tensor | None = None,
        ) -> torch.Tensor:
            """The weighted sum of each output's loss; with ``sample_weights``, each row's
            loss (the function's ``reduction='none'``) times its weight, averaged."""
            total: torch.Tensor | float = 0.0
            for output, label, loss_fn, weight in zip(
                outputs, labels, losses, weights, strict=True
            ):
                if sample_weights is None:
                    value = loss_fn(output, label)
                else:
                    value = (
                        loss_fn(output, label, reduction="none").flatten() * sample_weights
                    ).mean()
                total = total + value * weight
            return cast("torch.Tensor", total)  # a term per label, and there is at least one

    return LegacyModule()
