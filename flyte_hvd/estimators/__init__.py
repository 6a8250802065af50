"""Spark ML estimators that train on many ranks: Keras, PyTorch and Lightning.

``base`` holds what every framework shares on the driver (params, fit, transform, save and
load); ``training`` the rank-side run (shared state, checkpoints, resume); ``prediction``
the Arrow batches that ``transform`` feeds the model; one module per framework implements
the hooks (``keras``, ``torch``, ``lightning``; ``torch_model`` is shared by the last two).
Modules load on first use (each imports its framework).
"""

from __future__ import annotations

from flyte_hvd.core.lazy import lazy_attributes

_LAZY = {
    "HorovodEstimator": "flyte_hvd.estimators.base",
    "HorovodModel": "flyte_hvd.estimators.base",
    "KerasEstimator": "flyte_hvd.estimators.keras",
    "KerasModel": "flyte_hvd.estimators.keras",
    "TorchEstimator": "flyte_hvd.estimators.torch",
    "TorchModel": "flyte_hvd.estimators.torch_model",
    "LightningEstimator": "flyte_hvd.estimators.lightning",
}
__all__ = list(_LAZY)

__getattr__ = lazy_attributes(__name__, _LAZY)
