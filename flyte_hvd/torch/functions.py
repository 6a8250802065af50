"""Horovod's torch collectives on tensors, with the core's semantics.

Tensors cross into the numpy core without copies where they can (``Tensor.numpy()`` and
``torch.from_numpy`` share memory); results are new CPU tensors (moved back to the input's
device when it was not the CPU), 0-dim in, 0-dim out. A tensor that requires grad goes through
an autograd function, so gradients flow back through the collective (as in Horovod: the
gradient of an allreduce is the allreduce of the gradient, of an allgather the averaged
gradient's own rows, of a broadcast the averaged gradient on the root and zeros elsewhere).
The ``*_async`` ops (``async_collectives``) run on the core's background thread and return
a handle for ``synchronize``/``poll``; ``broadcast_parameters`` and
``broadcast_optimizer_state`` are in ``model_state``; both are importable from here too.

Where the ranks have a ``torch.distributed`` process group, ``allreduce``, ``allgather``,
``broadcast`` and their grouped, in-place and autograd forms can go through it instead of MPI
(by default for GPU tensors on NCCL; ``FLYTE_HVD_TORCH_COLLECTIVES``, see ``process_group.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from flyte_hvd.core import collectives, state
from flyte_hvd.core.compression import Compression, Compressor
from flyte_hvd.core.process_sets import ProcessSet, global_process_set
from flyte_hvd.core.reduce_ops import Average, ReduceOp, Sum
from flyte_hvd.torch import process_group

# Horovod's ``horovod.torch.functions`` and ``mpi_ops`` paths: the background and the state
# functions are importable from here too.
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
from flyte_hvd.torch.model_state import Params, broadcast_optimizer_state, broadcast_parameters
from flyte_hvd.torch.tensors import (
    Splits,
    as_array,
    as_tensor,
    check_grouped_reducescatter,
    raw_splits,
    resolve_op,
)

__all__ = [
    "Params",
    "Splits",
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


def _grad_wanted(tensors: Sequence[object]) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors
    )


# -- the plain (no autograd) forms ------------------------------------------------------------


# Each of these four takes the process group's route when ``process_group.takes`` says so.


def _allreduce(t, op, name, compression, pre, post, ps) -> torch.Tensor:
    if process_group.takes([t], ps, compression=compression):
        return process_group.allreduce(t, op, name, pre, post)
    out = collectives.allreduce(
        as_array(t, "allreduce"), op, name, compression, pre, post, process_set=ps
    )
    return as_tensor(out, t)


def _grouped_allreduce(ts, op, name, compression, pre, post, ps) -> list[torch.Tensor]:
    if process_group.takes(ts, ps, compression=compression):
        return process_group.grouped_allreduce(ts, op, name, pre, post)
    outs = collectives.grouped_allreduce(
        [as_array(t, "grouped_allreduce") for t in ts],
        op,
        name,
        compression,
        pre,
        post,
        process_set=ps,
    )
    return [as_tensor(o, t) for o, t in zip(outs, ts, strict=True)]


def _allgather(t, name, ps) -> torch.Tensor:
    if process_group.takes([t], ps):
        return process_group.allgather(t, name)
    return as_tensor(collectives.allgather(as_array(t, "allgather"), name, process_set=ps), t)


def _broadcast(t, root_rank, name, ps) -> torch.Tensor:
    if process_group.takes([t], ps, process_group.BROADCAST_DTYPES):
        return process_group.broadcast(t, root_rank, name)
    out = collectives.broadcast(as_array(t, "broadcast"), root_rank, name, process_set=ps)
    return as_tensor(out, t)


def _alltoall(t, splits, name, ps) -> tuple[torch.Tensor, torch.Tensor]:
    out, received = collectives.alltoall(
        as_array(t, "alltoall"), raw_splits(splits), name, process_set=ps
    )
    return as_tensor(out, t), torch.from_numpy(received.astype(np.int32))


def _reducescatter(t, op, name, compression, pre, post, ps) -> torch.Tensor:
    wire, ctx = compression.compress(as_array(t, "reducescatter"))
    out = collectives.reducescatter(wire, op, name, pre, post, process_set=ps)
    return as_tensor(compression.decompress(out, ctx), t)


# -- autograd --------------------------------------------------------------------------------


class _AllreduceGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, name, compression, pre, post, ps):
        ctx.args = (op, pre, post, ps)
        return _allreduce(tensor, op, name, compression, pre, post, ps)

    @staticmethod
    def backward(ctx, grad):
        op, pre, post, ps = ctx.args
        return _allreduce(grad, op, None, Compression.none, pre, post, ps), *[None] * 6


class _GroupedAllreduceGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, name, compression, pre, post, ps, *tensors):
        ctx.args = (op, pre, post, ps)
        return tuple(_grouped_allreduce(tensors, op, name, compression, pre, post, ps))

    @staticmethod
    def backward(ctx, *grads):
        op, pre, post, ps = ctx.args
        return *[None] * 6, *_grouped_allreduce(grads, op, None, Compression.none, pre, post, ps)


def _own_rows(grad: torch.Tensor, rows: int, ps: ProcessSet) -> torch.Tensor:
    """Horovod's allgather gradient: the average over ranks of ``grad``, this rank's rows."""
    reduced = _allreduce(grad, Average, None, Compression.none, 1.0, 1.0, ps)
    everyone = collectives.allgather(np.array([rows], np.int64), process_set=ps)
    offset = int(everyone[: ps.rank()].sum())
    return reduced.narrow(0, offset, rows) if reduced.dim() else reduced


class _AllgatherGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, ps):
        ctx.rows, ctx.ps = (tensor.shape[0] if tensor.dim() else 1), ps
        return _allgather(tensor, name, ps)

    @staticmethod
    def backward(ctx, grad):
        return _own_rows(grad, ctx.rows, ctx.ps), None, None


class _GroupedAllgatherGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, ps, *tensors):
        ctx.rows, ctx.ps = [t.shape[0] if t.dim() else 1 for t in tensors], ps
        return tuple(_allgather(t, name, ps) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        return None, None, *[_own_rows(g, n, ctx.ps) for g, n in zip(grads, ctx.rows, strict=True)]


class _BroadcastGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, ps):
        ctx.root_rank, ctx.ps = root_rank, ps
        return _broadcast(tensor, root_rank, name, ps)

    @staticmethod
    def backward(ctx, grad):
        reduced = _allreduce(grad, Average, None, Compression.none, 1.0, 1.0, ctx.ps)
        if state.rank() != ctx.root_rank:
            reduced = torch.zeros_like(reduced)
        return reduced, None, None, None


class _AlltoallGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, ps):
        out, received = _alltoall(tensor, splits, name, ps)
        ctx.received, ctx.ps = received, ps
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _received_grad):
        back, _ = _alltoall(grad, ctx.received, None, ctx.ps)
        return back, None, None, None


def _reducescatter_grad_scale(op, pre, post, ps) -> float:
    """Horovod's reducescatter gradient: the output gradient, times the set size for Sum and
    the scale factors, gathered back to the input's rows."""
    return (ps.size() if op == Sum else 1.0) * pre * post


class _ReducescatterGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, name, compression, pre, post, ps):
        ctx.scale, ctx.ps = _reducescatter_grad_scale(op, pre, post, ps), ps
        return _reducescatter(tensor, op, name, compression, pre, post, ps)

    @staticmethod
    def backward(ctx, grad):
        return _allgather(grad * ctx.scale, None, ctx.ps), *[None] * 6


class _GroupedReducescatterGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, name, compression, pre, post, ps, *tensors):
        ctx.scale, ctx.ps = _reducescatter_grad_scale(op, pre, post, ps), ps
        check_grouped_reducescatter(tensors)
        return tuple(_reducescatter(t, op, name, compression, pre, post, ps) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        return *[None] * 6, *[_allgather(g * ctx.scale, None, ctx.ps) for g in grads]


# -- the public collectives ------------------------------------------------------------------


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Reduce ``tensor`` across ranks; returns a new tensor (``op`` defaults to Average).

    Through the torch process group where ``process_group.takes`` says so; a ``process_set``
    other than every rank always goes through MPI.
    """
    args = (
        resolve_op(average, op),
        name,
        compression,
        prescale_factor,
        postscale_factor,
        process_set,
    )
    if _grad_wanted([tensor]):
        return _AllreduceGrad.apply(tensor, *args)
    return _allreduce(tensor, *args)


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """``allreduce`` writing the result into ``tensor``; returns ``tensor``."""
    out = _allreduce(
        tensor,
        resolve_op(average, op),
        name,
        Compression.none,
        prescale_factor,
        postscale_factor,
        process_set,
    )
    with torch.no_grad():
        tensor.copy_(out)
    return tensor


def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Reduce many tensors with as few reductions as the fusion threshold allows.

    Through the torch process group where ``process_group.takes`` says so; a ``process_set``
    other than every rank always goes through MPI.
    """
    args = (
        resolve_op(average, op),
        name,
        compression,
        prescale_factor,
        postscale_factor,
        process_set,
    )
    if _grad_wanted(tensors):
        return list(_GroupedAllreduceGrad.apply(*args, *tensors))
    return _grouped_allreduce(list(tensors), *args)


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """``grouped_allreduce`` writing each result into its tensor."""
    outs = _grouped_allreduce(
        list(tensors),
        resolve_op(average, op),
        name,
        Compression.none,
        prescale_factor,
        postscale_factor,
        process_set,
    )
    with torch.no_grad():
        for t, o in zip(tensors, outs, strict=True):
            t.copy_(o)
    return list(tensors)


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Concatenate every rank's tensor along the first dimension (which may differ).

    Through the torch process group where ``process_group.takes`` says so; a ``process_set``
    other than every rank always goes through MPI.
    """
    if _grad_wanted([tensor]):
        return _AllgatherGrad.apply(tensor, name, process_set)
    return _allgather(tensor, name, process_set)


def grouped_allgather(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """``allgather`` of each tensor, in order."""
    if _grad_wanted(tensors):
        return list(_GroupedAllgatherGrad.apply(name, process_set, *tensors))
    return [_allgather(t, name, process_set) for t in tensors]


def broadcast(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Every rank gets ``root_rank``'s tensor (a global rank), as a new tensor.

    Through the torch process group where ``process_group.takes`` says so; a ``process_set``
    other than every rank always goes through MPI.
    """
    if _grad_wanted([tensor]):
        return _BroadcastGrad.apply(tensor, root_rank, name, process_set)
    return _broadcast(tensor, root_rank, name, process_set)


def broadcast_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """``broadcast`` into ``tensor`` itself; returns ``tensor``. A CPU tensor in one block of
    memory is sent from and received into directly, with no other buffer."""
    if not process_group.takes([tensor], process_set, process_group.BROADCAST_DTYPES):
        view = _writable_view(tensor)
        if view is not None:
            collectives.broadcast(view, root_rank, name, process_set, in_place=True)
            # Written through numpy: tell autograd, as copy_ would, that the values changed.
            torch.autograd.graph.increment_version(tensor)
            return tensor
    out = _broadcast(tensor, root_rank, name, process_set)
    with torch.no_grad():
        tensor.copy_(out)
    return tensor


def _writable_view(t: object) -> np.ndarray | None:
    """A writable C-contiguous numpy view of ``t``'s own memory holding the values it holds
    (a dense, contiguous CPU tensor of a dtype numpy has, with no lazy conjugate or
    negation), or None."""
    if not (
        isinstance(t, torch.Tensor)
        and t.device.type == "cpu"
        and t.layout == torch.strided
        and t.dtype != torch.bfloat16
        and t.is_contiguous()
        and not t.is_conj()
        and not t.is_neg()
    ):
        return None
    try:
        view = t.detach().numpy()
    except TypeError:  # a dtype numpy lacks: the copying path says what to do
        return None
    return view if view.flags.writeable and view.flags.c_contiguous else None


def alltoall(
    tensor: torch.Tensor,
    splits: Splits = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Send ``splits[i]`` rows to rank ``i`` of the set. Without ``splits`` (rows divided
    evenly) returns the rows received; with ``splits``, also how many came from each rank."""
    if _grad_wanted([tensor]):
        out, received = _AlltoallGrad.apply(tensor, splits, name, process_set)
    else:
        out, received = _alltoall(tensor, splits, name, process_set)
    return out if splits is None else (out, received)


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: ReduceOp = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """Reduce across ranks; rank ``i`` of the set gets its slice of the first dimension."""
    args = (op, name, compression, prescale_factor, postscale_factor, process_set)
    if _grad_wanted([tensor]):
        return _ReducescatterGrad.apply(tensor, *args)
    return _reducescatter(tensor, *args)


def grouped_reducescatter(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: ReduceOp = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    """``reducescatter`` of each tensor, in order."""
    args = (op, name, compression, prescale_factor, postscale_factor, process_set)
    if _grad_wanted(tensors):
        return list(_GroupedReducescatterGrad.apply(*args, *tensors))
    check_grouped_reducescatter(tensors)
    return [_reducescatter(t, *args) for t in tensors]
