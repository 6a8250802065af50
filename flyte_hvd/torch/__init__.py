"""Horovod's PyTorch API on the collective core: ``import flyte_hvd.torch as hvd``.

Re-exports the core (``init``, ``rank``, ``size``, ...) with tensor-aware collectives in place
of the numpy ones, and adds ``DistributedOptimizer``, ``broadcast_parameters``,
``broadcast_optimizer_state``, the ``*_async`` ops with ``synchronize``/``poll``, and (with
Lightning installed) ``HorovodStrategy``.
"""

try:
    import torch  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "flyte_hvd.torch needs PyTorch: install the extra `pip install flyte-hvd[torch]` "
        "(on CPU-only machines pin the CPU wheel, torch==2.13.0)."
    ) from error

from flyte_hvd.core import *  # noqa: F403 - Horovod's API is one namespace
from flyte_hvd.core import __all__ as _core_all
from flyte_hvd.torch.functions import (
    allgather,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    broadcast,
    broadcast_,
    broadcast_optimizer_state,
    broadcast_parameters,
    grouped_allreduce,
    grouped_allreduce_,
    poll,
    reducescatter,
    shutdown,
    synchronize,
)
from flyte_hvd.torch.optimizer import DistributedOptimizer

# The tensor-aware collectives replace the core's numpy ones of the same names.
__all__ = [
    *_core_all,
    "DistributedOptimizer",
    "allgather",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "broadcast",
    "broadcast_",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "grouped_allreduce",
    "grouped_allreduce_",
    "poll",
    "reducescatter",
    "shutdown",
    "synchronize",
]


def __getattr__(name: str):
    # Not in __all__: it imports Lightning, so only on first use.
    if name == "HorovodStrategy":
        from flyte_hvd.torch.strategy import HorovodStrategy

        return HorovodStrategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
