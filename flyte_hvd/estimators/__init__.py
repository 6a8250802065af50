"""Spark ML estimators that train on many ranks: Keras, PyTorch and Lightning.

``base`` holds what every framework shares on the driver (params, fit, transform; save and
load in ``persistence``, the ranks' ``backend``); ``training`` the rank-side run (shared
state, checkpoints, resume); ``prediction`` the Arrow batches that ``transform`` feeds the
model; one module per framework implements the hooks (``keras``, ``torch``, ``lightning``;
``torch_model`` is shared by the last two).
Modules load on first use (each imports its framework).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flyte_hvd.core.lazy import lazy_attributes

# The real types of the lazy names below, for type checkers (names they re-export).
# ruff: noqa: F401
if TYPE_CHECKING:
    from flyte_hvd.estimators.base import (
        HorovodEstimator,
        HorovodModel,
    )
    from flyte_hvd.estimators.keras import (
        KerasEstimator,
        KerasModel,
    )
    from flyte_hvd.estimators.lightning import LightningEstimator
    from flyte_hvd.estimators.torch import TorchEstimator
    from flyte_hvd.estimators.torch_model import TorchModel
    from flyte_hvd.estimators.tracking import MlflowConfig

_LAZY = {
    "HorovodEstimator": "flyte_hvd.estimators.base",
    "HorovodModel": "flyte_hvd.estimators.base",
    "KerasEstimator": "flyte_hvd.estimators.keras",
    "KerasModel": "flyte_hvd.estimators.keras",
    "TorchEstimator": "flyte_hvd.estimators.torch",
    "TorchModel": "flyte_hvd.estimators.torch_model",
    "LightningEstimator": "flyte_hvd.estimators.lightning",
    "MlflowConfig": "flyte_hvd.estimators.tracking",
}
__all__ = list(_LAZY)

__getattr__ = lazy_attributes(__name__, _LAZY)
