"""``HorovodStrategy``: Lightning 2.x training on ranks that flyte-hvd started.

The ranks already exist (``flyte_hvd.spark.run``, ``flyte-hvd-run``, a Flyte task), so the
strategy launches nothing: it takes rank and size from the collective core, starts every rank
from rank 0's weights and optimizer state, wraps each optimizer in ``DistributedOptimizer``
(gradients reduced during backward) and answers Lightning's collectives (``reduce``,
``all_gather``, ``broadcast``, ``barrier``) with the core's. Callbacks that reduce across ranks
(``EarlyStopping``, ``ModelCheckpoint``) and ``self.log(..., sync_dist=True)`` work on every rank.

    trainer = lightning.pytorch.Trainer(strategy=HorovodStrategy(), accelerator="cpu", devices=1)

A module written for the ``pytorch_lightning`` package (the same Lightning 2, installed under
its older name) trains with that package's Trainer: ``strategy_for(pytorch_lightning)`` is the
same strategy built on that package's classes.

``ddp_strategy(package, use_gpu)`` is Lightning's own ``DDPStrategy`` instead, on the same
ranks (``LightningEstimator(distributed="ddp")``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

try:
    import lightning.pytorch as pl
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "HorovodStrategy needs Lightning 2.x: install the extra `pip install flyte-hvd[torch]`."
    ) from error

import torch
from lightning.pytorch.strategies import ParallelStrategy

import flyte_hvd.core as core
import flyte_hvd.torch.functions as torch_functions
from flyte_hvd.core.compression import Compression, Compressor
from flyte_hvd.torch import model_state
from flyte_hvd.torch.functions import allreduce
from flyte_hvd.torch.optimizer import DistributedMixin, DistributedOptimizer

if TYPE_CHECKING:
    from lightning.fabric.plugins import CheckpointIO
    from lightning.pytorch.accelerators import Accelerator
    from lightning.pytorch.plugins.precision import Precision

# Lightning's types are named by ``lightning.pytorch``; ``strategy_for(pytorch_lightning)``
# builds the same strategy on that package's twins of them.

T = TypeVar("T")  # a value passed through: what `broadcast` sends, what a closure returns


class _HorovodStrategyMixin:
    """Data-parallel Lightning training over the collective core (one process per rank).

    Args:
        compression: wire compression for gradients (``hvd.Compression.fp16``).
        gradient_predivide_factor: see ``DistributedOptimizer``.

    Gradient accumulation (``Trainer(accumulate_grad_batches=N)``) reduces once per N
    batches. Learning rates are used as given (scale them by ``core.size()`` yourself if the
    global batch grows with the ranks).
    """

    strategy_name = "flyte_hvd"

    # set by ``ParallelStrategy``; declared for the type checker
    model: torch.nn.Module | None
    lightning_module: pl.LightningModule | None
    optimizers: list[torch.optim.Optimizer]
    parallel_devices: list[torch.device] | None

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        compression: type[Compressor] = Compression.none,
        gradient_predivide_factor: float = 1.0,
    ):
        core.init()
        super().__init__(  # type: ignore[call-arg]
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=None,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.compression = compression
        self.gradient_predivide_factor = gradient_predivide_factor
        _set_rank_zero(core.rank())

    # -- where this process is ---------------------------------------------------------------

    @property
    def root_device(self) -> torch.device:
        devices = self.parallel_devices
        if devices and devices[0].type == "cuda":
            return torch.device("cuda", core.local_rank())
        return torch.device("cpu")

    @property
    def global_rank(self) -> int:
        return core.rank()

    @property
    def local_rank(self) -> int:
        return core.local_rank()

    @property
    def node_rank(self) -> int:
        return core.cross_rank()

    @property
    def world_size(self) -> int:
        return core.size()

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": core.size(), "rank": core.rank()}

    # -- set-up ------------------------------------------------------------------------------

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)  # type: ignore[misc]
        if trainer.state.fn != "fit":  # TrainerFn.FITTING, a str enum of either package
            return
        module = self.lightning_module
        assert module is not None  # set while fitting
        model_state.broadcast_parameters(module.state_dict(), root_rank=0)
        names = {p: n for n, p in module.named_parameters()}
        for optimizer in self.optimizers:
            model_state.broadcast_optimizer_state(optimizer, root_rank=0)
            params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
            DistributedOptimizer(
                optimizer,
                named_parameters=[(names.get(p, f"param.{i}"), p) for i, p in enumerate(params)],
                compression=self.compression,
                backward_passes_per_step=trainer.accumulate_grad_batches,
                gradient_predivide_factor=self.gradient_predivide_factor,
            )

    def teardown(self) -> None:
        from flyte_hvd.torch.optimizer import unwrap

        for optimizer in self.optimizers:
            unwrap(optimizer)
        super().teardown()  # type: ignore[misc]

    # -- the step ----------------------------------------------------------------------------

    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], T],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,  # the optimizer's ``step`` arguments, passed on
    ) -> T:
        if not isinstance(optimizer, DistributedMixin):
            return super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]

        # Reduce right after backward, before Lightning clips gradients or runs
        # `on_before_optimizer_step`, so both see the averaged gradients.
        def closure_then_synchronize() -> T:
            result = closure()
            optimizer.synchronize()
            return result

        with optimizer.skip_synchronize():
            return super().optimizer_step(  # type: ignore[misc]
                optimizer, closure_then_synchronize, model, **kwargs
            )

    # -- collectives -------------------------------------------------------------------------

    def reduce(
        self, tensor: T, group: object = None, reduce_op: object = "mean"
    ) -> T | torch.Tensor:  # a tensor reduced, anything else as it is
        if not isinstance(tensor, torch.Tensor):
            return tensor
        name = reduce_op if isinstance(reduce_op, str) else getattr(reduce_op, "name", "")
        name = str(name or reduce_op).lower()
        ops = {
            "mean": core.Average,
            "avg": core.Average,
            "sum": core.Sum,
            "max": core.Max,
            "min": core.Min,
            "product": core.Product,
        }
        op = next((o for key, o in ops.items() if key in name), None)
        if op is None:
            raise ValueError(
                f"HorovodStrategy.reduce: unsupported `reduce_op`={reduce_op!r}; use 'mean', "
                f"'sum', 'max', 'min' or 'product'."
            )
        source = tensor.float() if tensor.dtype == torch.bool else tensor
        return allreduce(source, op=op).to(tensor.dtype)

    def all_gather(
        self, tensor: torch.Tensor, group: object = None, sync_grads: bool = False
    ) -> torch.Tensor:
        return torch_functions.allgather(tensor.unsqueeze(0))

    def barrier(self, name: str | None = None) -> None:
        core.barrier()

    def broadcast(self, obj: T, src: int = 0) -> T:
        return core.broadcast_object(obj, root_rank=src)


class HorovodStrategy(_HorovodStrategyMixin, ParallelStrategy):
    __doc__ = _HorovodStrategyMixin.__doc__


@functools.cache
def strategy_for(package: ModuleType) -> type:
    """``HorovodStrategy`` for a Lightning package: ``lightning.pytorch`` (itself) or
    ``pytorch_lightning``, whose Trainer checks that a strategy derives from its own
    classes."""
    if package is pl:
        return HorovodStrategy
    base = importlib.import_module(f"{package.__name__}.strategies").ParallelStrategy
    return type(
        "HorovodStrategy", (_HorovodStrategyMixin, base), {"__doc__": HorovodStrategy.__doc__}
    )


def ddp_strategy(package: ModuleType, use_gpu: bool) -> Any:  # Lightning's DDPStrategy
    """Lightning's ``DDPStrategy`` (of ``package``) on the ranks flyte-hvd started, with a
    process group of backend NCCL (``use_gpu``) or gloo found through ``MASTER_ADDR`` and
    ``MASTER_PORT``.

    Lightning numbers a process ``node_rank * devices + local_rank``, which needs the same
    number of ranks on every host; ours may differ. So each rank is shown to Lightning as a
    node of its own: train with ``Trainer(devices=1, num_nodes=size())`` on CPUs, and with
    ``devices=[local_rank()]`` (the rank's own GPU) on GPUs."""
    fabric = "lightning.fabric" if package.__name__.startswith("lightning.") else "lightning_fabric"
    base = importlib.import_module(f"{fabric}.plugins.environments").ClusterEnvironment
    strategies = importlib.import_module(f"{package.__name__}.strategies")
    return strategies.DDPStrategy(
        cluster_environment=_rank_environment(base)(),
        process_group_backend="nccl" if use_gpu else "gloo",
    )


@functools.cache
def _rank_environment(base: type) -> type:
    """A Lightning ``ClusterEnvironment`` (of ``base``'s package) answering from the core:
    rank and size as they are, each rank a node of its own (see ``ddp_strategy``)."""

    class RankEnvironment(base):  # type: ignore[misc,valid-type]
        @property
        def creates_processes_externally(self) -> bool:
            return True  # the ranks exist: Lightning launches nothing

        @property
        def main_address(self) -> str:
            return os.environ["MASTER_ADDR"]

        @property
        def main_port(self) -> int:
            return int(os.environ["MASTER_PORT"])

        @staticmethod
        def detect() -> bool:
            return core.is_initialized()

        def world_size(self) -> int:
            return core.size()

        def set_world_size(self, size: int) -> None:
            pass  # Lightning's num_nodes * devices, which the Trainer's arguments make size()

        def global_rank(self) -> int:
            return core.rank()

        def set_global_rank(self, rank: int) -> None:
            pass  # node_rank * 1 + 0: the rank itself

        def local_rank(self) -> int:
            return 0

        def node_rank(self) -> int:
            return core.rank()

    return RankEnvironment


def _set_rank_zero(rank: int) -> None:
    """Lightning's rank-zero-only logging reads the rank from these, not from the strategy."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero
    from lightning.pytorch.utilities.rank_zero import rank_zero_only
    from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero

    functions = [rank_zero_only, fabric_rank_zero, utils_rank_zero]
    for name in ("pytorch_lightning.utilities.rank_zero", "lightning_fabric.utilities.rank_zero"):
        with contextlib.suppress(ImportError):
            functions.append(importlib.import_module(name).rank_zero_only)
    for fn in functions:
        fn.rank = rank  # type: ignore[attr-defined]  # Lightning reads it from the function
