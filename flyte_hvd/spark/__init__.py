"""Run Horovod-style ranks inside Spark: ``run``, ``HorovodRunner``, ``get_available_devices``,
on a classic SparkSession or a Spark Connect one.

pyspark is imported only when a function needs it.
"""

from flyte_hvd.spark.dispatch import launch, run
from flyte_hvd.spark.horovod_runner import HorovodRunner
from flyte_hvd.spark.runner import RunReport, get_available_devices

__all__ = ["HorovodRunner", "RunReport", "get_available_devices", "launch", "run"]

# -- Store, data preparation and loaders: imported on first use (they load pyarrow/fsspec) --
_LAZY = {
    "Store": "flyte_hvd.data.store",
    "LocalStore": "flyte_hvd.data.store",
    "S3Store": "flyte_hvd.data.store",
    "HDFSStore": "flyte_hvd.data.store",
    "DBFSLocalStore": "flyte_hvd.data.store",
    "RemoteStore": "flyte_hvd.data.store",
    "prepare_data": "flyte_hvd.data.prepare",
    "read_metadata": "flyte_hvd.data.dataset",
    "get_dataset_metadata": "flyte_hvd.data.dataset",
    "DatasetMetadata": "flyte_hvd.data.dataset",
    "ColumnInfo": "flyte_hvd.data.dataset",
    "BaseDataLoader": "flyte_hvd.data.loader",
    "ArrowDataLoader": "flyte_hvd.data.loader",
    "AsyncDataLoaderMixin": "flyte_hvd.data.loader",
    "AsyncArrowDataLoader": "flyte_hvd.data.loader",
    "KerasEstimator": "flyte_hvd.estimators.keras",
    "KerasModel": "flyte_hvd.estimators.keras",
    "TorchEstimator": "flyte_hvd.estimators.torch",
    "TorchModel": "flyte_hvd.estimators.torch_model",
    "LightningEstimator": "flyte_hvd.estimators.lightning",
}
__all__ += list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
