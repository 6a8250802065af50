"""Run Horovod-style ranks inside Spark: ``run``, ``HorovodRunner``, ``get_available_devices``.

pyspark is imported only when a function needs it.
"""

from flyte_hvd.spark.horovod_runner import HorovodRunner
from flyte_hvd.spark.runner import RunReport, get_available_devices, launch, run

__all__ = ["HorovodRunner", "RunReport", "get_available_devices", "launch", "run"]

# -- Store, data preparation and loaders: imported on first use (they load pyarrow/fsspec) --
_LAZY = {
    "Store": "flyte_hvd.spark.store",
    "LocalStore": "flyte_hvd.spark.store",
    "S3Store": "flyte_hvd.spark.store",
    "HDFSStore": "flyte_hvd.spark.store",
    "DBFSLocalStore": "flyte_hvd.spark.store",
    "RemoteStore": "flyte_hvd.spark.store",
    "prepare_data": "flyte_hvd.spark.prepare",
    "read_metadata": "flyte_hvd.spark.dataset",
    "get_dataset_metadata": "flyte_hvd.spark.dataset",
    "DatasetMetadata": "flyte_hvd.spark.dataset",
    "ColumnInfo": "flyte_hvd.spark.dataset",
    "BaseDataLoader": "flyte_hvd.spark.loader",
    "ArrowDataLoader": "flyte_hvd.spark.loader",
    "AsyncDataLoaderMixin": "flyte_hvd.spark.loader",
    "AsyncArrowDataLoader": "flyte_hvd.spark.loader",
    "KerasEstimator": "flyte_hvd.spark.keras_estimator",
    "KerasModel": "flyte_hvd.spark.keras_estimator",
    "TorchEstimator": "flyte_hvd.spark.torch_estimator",
    "TorchModel": "flyte_hvd.spark.torch_estimator",
    "LightningEstimator": "flyte_hvd.spark.lightning_estimator",
}
__all__ += list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
