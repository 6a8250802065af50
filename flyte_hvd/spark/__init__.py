"""Horovod's ``horovod.spark``: run Horovod-style ranks inside Spark (``run``,
``HorovodRunner``, ``get_available_devices``, pyspark's ``TorchDistributor``; a run's ranks may
share a DataFrame's rows, ``get_partition``) on a classic SparkSession or a Spark Connect one,
and the Store and the estimators under the same names.

A facade on the top floor: the launch is ``flyte_hvd.stage``, the Store ``flyte_hvd.data``,
the estimators ``flyte_hvd.estimators``. pyspark is imported only when a function needs it,
and the Store and the estimators on first use.
"""

import importlib
from typing import TYPE_CHECKING, Any

from flyte_hvd.stage import (
    HorovodRunner,
    RunReport,
    TorchDistributor,
    get_available_devices,
    get_partition,
    launch,
    run,
)
from flyte_hvd.stage.flyte_task import quiet_local_conf
from flyte_hvd.stage.shipping import ship_package

__all__ = [
    "HorovodRunner",
    "RunReport",
    "TorchDistributor",
    "get_available_devices",
    "get_partition",
    "launch",
    "quiet_local_conf",
    "run",
    "ship_package",
]

# Horovod's `horovod.spark` also offers the Store and the estimators: the same names are
# importable here, loaded on first use from the layers that define them (flyte_hvd.data,
# flyte_hvd.estimators), so that `from flyte_hvd.spark import run` loads neither.
_COMPAT_PACKAGES = ("flyte_hvd.data", "flyte_hvd.estimators")

# The same names' real types, for type checkers (names they re-export).
# ruff: noqa: F401
if TYPE_CHECKING:
    from flyte_hvd.data import (
        AbstractFilesystemStore,
        ArrowDataLoader,
        AsyncArrowDataLoader,
        AsyncDataLoaderMixin,
        BaseDataLoader,
        ColumnInfo,
        DatasetMetadata,
        DBFSLocalStore,
        FilesystemStore,
        HDFSStore,
        LocalStore,
        RemoteStore,
        S3Store,
        Store,
        StoreTimeoutError,
        StoreUnreachableError,
        get_dataset_metadata,
        prepare_data,
        read_metadata,
    )
    from flyte_hvd.estimators import (
        HorovodEstimator,
        HorovodModel,
        KerasEstimator,
        KerasModel,
        LightningEstimator,
        MlflowConfig,
        TorchEstimator,
        TorchModel,
    )


def __getattr__(name: str) -> Any:  # whatever class or function the package defines
    for package in _COMPAT_PACKAGES:
        module = importlib.import_module(package)
        if name in module.__all__:
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
