"""Horovod's PyTorch API on the collective core: ``import flyte_hvd.torch as hvd``.

Re-exports the core (``init``, ``rank``, ``size``, process sets, ``join``, the build queries,
...) with tensor-aware collectives in place of the numpy ones (autograd flows through them),
and adds ``DistributedOptimizer``, ``broadcast_parameters``, ``broadcast_optimizer_state``,
``SyncBatchNorm``, the ``*_async`` ops with ``synchronize``/``poll``, and (with Lightning
installed) ``HorovodStrategy``.
"""

from typing import TYPE_CHECKING

try:
    import torch  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "flyte_hvd.torch needs PyTorch: install the extra `pip install flyte-hvd[torch]` "
        "(on CPU-only machines, PyTorch's CPU build from its CPU index)."
    ) from error

from flyte_hvd.core import *  # noqa: F403 - Horovod's API is one namespace
from flyte_hvd.core import __all__ as _core_all
from flyte_hvd.torch.async_collectives import (
    allgather_async,
    allreduce_async,
    allreduce_async_,
    alltoall_async,
    broadcast_async,
    broadcast_async_,
    grouped_allgather_async,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter_async,
    poll,
    reducescatter_async,
    sparse_allreduce_async,
    synchronize,
)
from flyte_hvd.torch.functions import (
    allgather,
    allreduce,
    allreduce_,
    alltoall,
    broadcast,
    broadcast_,
    grouped_allgather,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_reducescatter,
    reducescatter,
)
from flyte_hvd.torch.model_state import broadcast_optimizer_state, broadcast_parameters
from flyte_hvd.torch.optimizer import DistributedOptimizer
from flyte_hvd.torch.sync_batch_norm import SyncBatchNorm

# The tensor-aware collectives replace the core's numpy ones of the same names.
__all__ = [
    *_core_all,
    "DistributedOptimizer",
    "SyncBatchNorm",
    "allgather",
    "allgather_async",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "poll",
    "reducescatter",
    "reducescatter_async",
    "sparse_allreduce_async",
    "synchronize",
]


if TYPE_CHECKING:  # its real type, for type checkers
    from flyte_hvd.torch.strategy import HorovodStrategy as HorovodStrategy


def __getattr__(name: str) -> "type[HorovodStrategy]":
    # Not in __all__: it imports Lightning, so only on first use.
    if name == "HorovodStrategy":
        from flyte_hvd.torch.strategy import HorovodStrategy

        return HorovodStrategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
