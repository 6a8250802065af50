"""Horovod's torch collectives on tensors, with the core's semantics.

Tensors cross into the numpy core without copies where they can (``Tensor.numpy()`` and
``torch.from_numpy`` share memory); results are new CPU tensors (moved back to the input's
device when it was not the CPU), 0-dim in, 0-dim out. A tensor that requires grad goes through
an autograd function, so gradients flow back through the collective (as in Horovod: the
gradient of an allreduce is the allreduce of the gradient, of an allgather the averaged
gradient's own rows, of a broadcast the averaged gradient on the root and zeros elsewhere).
The ``*_async`` ops run on the core's background thread and return a handle for
``synchronize``/``poll``.

Where the ranks have a ``torch.distributed`` process group, ``allreduce``, ``allgather``,
``broadcast`` and their grouped, in-place and autograd forms can go through it instead of MPI
(by default for GPU tensors on NCCL; ``FLYTE_HVD_TORCH_COLLECTIVES``, see ``process_group.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, TypeAlias

import numpy as np
import torch

if TYPE_CHECKING:
    from mpi4py import MPI
    from numpy.typing import ArrayLike

from flyte_hvd.core import background, collectives, model_sync, state
from flyte_hvd.core.collectives import Average, ReduceOp, Sum
from flyte_hvd.core.compression import Compression, Compressor
from flyte_hvd.core.process_sets import (
    ProcessSet,
    async_comm_of,
    global_process_set,
    translate_root,
)
from flyte_hvd.torch import process_group

# How many rows go to each rank: a tensor or a list of ints (None: evenly).
Splits: TypeAlias = "torch.Tensor | Sequence[int] | None"
# What ``broadcast_parameters`` takes: a state_dict, named_parameters() or a list of tensors.
Params: TypeAlias = (
    "Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | Iterable[torch.Tensor]"
)


def _array(tensor: torch.Tensor | ArrayLike, what: str) -> np.ndarray:
    """A numpy view (or, off the CPU, a copy) of ``tensor``; other values go through
    ``np.asarray``."""
    if not isinstance(tensor, torch.Tensor):
        return np.asarray(tensor)
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype == torch.bfloat16:
        raise ValueError(
            f"`{what}` cannot take a bfloat16 tensor (numpy has no bfloat16); cast it first, "
            f"e.g. `tensor.float()`."
        )
    if t.is_sparse:
        t = t.to_dense()
    return t.resolve_conj().resolve_neg().contiguous().numpy()


def _tensor(array: np.ndarray, like: object) -> torch.Tensor:
    if not array.flags.c_contiguous:
        array = array.copy(order="C")
    out = torch.from_numpy(array)
    if isinstance(like, torch.Tensor) and like.device.type != "cpu":
        out = out.to(like.device)
    return out


def _resolve_op(average: bool | None, op: ReduceOp | None) -> ReduceOp:
    """Horovod's deprecated ``average=`` argument and ``op=`` are exclusive."""
    if average is not None and op is not None:
        raise ValueError("pass either `op` or the deprecated `average`, not both.")
    if op is not None:
        return op
    return Average if average is None or average else Sum


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
        _array(t, "allreduce"), op, name, compression, pre, post, process_set=ps
    )
    return _tensor(out, t)


def _grouped_allreduce(ts, op, name, compression, pre, post, ps) -> list[torch.Tensor]:
    if process_group.takes(ts, ps, compression=compression):
        return process_group.grouped_allreduce(ts, op, name, pre, post)
    outs = collectives.grouped_allreduce(
        [_array(t, "grouped_allreduce") for t in ts],
        op,
        name,
        compression,
        pre,
        post,
        process_set=ps,
    )
    return [_tensor(o, t) for o, t in zip(outs, ts, strict=True)]


def _allgather(t, name, ps) -> torch.Tensor:
    if process_group.takes([t], ps):
        return process_group.allgather(t, name)
    return _tensor(collectives.allgather(_array(t, "allgather"), name, process_set=ps), t)


def _broadcast(t, root_rank, name, ps) -> torch.Tensor:
    if process_group.takes([t], ps, process_group.BROADCAST_DTYPES):
        return process_group.broadcast(t, root_rank, name)
    out = collectives.broadcast(_array(t, "broadcast"), root_rank, name, process_set=ps)
    return _tensor(out, t)


def _splits(splits: Splits) -> np.ndarray | Sequence[int] | None:
    if isinstance(splits, torch.Tensor):
        return splits.detach().cpu().numpy()
    return splits


def _alltoall(t, splits, name, ps) -> tuple[torch.Tensor, torch.Tensor]:
    out, received = collectives.alltoall(
        _array(t, "alltoall"), _splits(splits), name, process_set=ps
    )
    return _tensor(out, t), torch.from_numpy(received.astype(np.int32))


def _reducescatter(t, op, name, compression, pre, post, ps) -> torch.Tensor:
    wire, ctx = compression.compress(_array(t, "reducescatter"))
    out = collectives.reducescatter(wire, op, name, pre, post, process_set=ps)
    return _tensor(compression.decompress(out, ctx), t)


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
        _check_grouped_reducescatter(tensors)
        return tuple(_reducescatter(t, op, name, compression, pre, post, ps) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        return *[None] * 6, *[_allgather(g * ctx.scale, None, ctx.ps) for g in grads]


def _check_grouped_reducescatter(tensors: Sequence[torch.Tensor]) -> None:
    if any(isinstance(t, torch.Tensor) and t.dim() == 0 for t in tensors):
        raise ValueError(
            "`grouped_reducescatter` needs tensors with at least one dimension; found a scalar."
        )


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
        _resolve_op(average, op),
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
        _resolve_op(average, op),
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
        _resolve_op(average, op),
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
        _resolve_op(average, op),
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
    """``broadcast`` into ``tensor`` itself; returns ``tensor``."""
    out = _broadcast(tensor, root_rank, name, process_set)
    with torch.no_grad():
        tensor.copy_(out)
    return tensor


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
    _check_grouped_reducescatter(tensors)
    return [_reducescatter(t, *args) for t in tensors]


# -- async ---------------------------------------------------------------------------------


def _submit(
    ps: ProcessSet,
    name: str | None,
    run: Callable[[MPI.Comm], background.Result],
    finish: Callable[[background.Result], background.Result] | None = None,
) -> background.Handle:
    return background.submit(run, async_comm_of(ps), name, finish)


def _tensors_like(
    tensors: Sequence[torch.Tensor],
) -> Callable[[list[np.ndarray]], list[torch.Tensor]]:
    return lambda outs: [_tensor(o, t) for o, t in zip(outs, tensors, strict=True)]


def _copy(tensor: torch.Tensor, what: str) -> np.ndarray:
    return np.array(_array(tensor, what), copy=True, order="C")


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> background.Handle:
    """Start reducing ``tensor`` in place on the background thread; ``synchronize(handle)``
    waits and returns ``tensor``. Do not touch ``tensor`` until then."""
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
        found = tensor.device if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(
            f"`allreduce_async_` reduces a CPU tensor in place; found {found}. Use "
            f"`allreduce_async` (it copies) or move the tensor to the CPU."
        )
    if not tensor.is_contiguous():
        raise ValueError("`allreduce_async_` needs a contiguous tensor; call `.contiguous()`.")
    op = _resolve_op(average, op)
    collectives.mpi_op(op)  # a bad op fails here, not on the thread
    flat = tensor.detach().view(-1).numpy()
    size = process_set.size()
    op, pre, post = collectives.average_as_sum(op, 1.0, size, flat.dtype.kind in "fc")
    pre *= prescale_factor
    post *= postscale_factor
    shape = tuple(tensor.shape)

    def run(comm: MPI.Comm) -> torch.Tensor:
        collectives.scale_in_place(flat, pre)
        collectives.reduce_in_place(
            comm,
            flat,
            op,
            Compression.none,
            post,
            name,
            lambda: f"allreduce_async_(op={op.name}, dtype={flat.dtype}, shape={shape})",
        )
        return tensor

    return _submit(process_set, name, run)


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> background.Handle:
    """``allreduce_async_`` on a copy: ``synchronize(handle)`` returns a new tensor."""
    copy = tensor.detach().to("cpu", copy=True).contiguous()
    return allreduce_async_(copy, average, name, op, prescale_factor, postscale_factor, process_set)


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> background.Handle:
    """``grouped_allreduce`` on the background thread; ``synchronize`` returns new tensors."""
    op = _resolve_op(average, op)
    collectives.mpi_op(op)
    arrays = [_copy(t, "grouped_allreduce_async") for t in tensors]

    def run(comm: MPI.Comm) -> list[np.ndarray]:
        return collectives.grouped_allreduce_on(
            comm, arrays, op, name, Compression.none, prescale_factor, postscale_factor
        )

    return _submit(process_set, name, run, _tensors_like(tensors))


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> background.Handle:
    """``grouped_allreduce_`` on the background thread; ``synchronize`` returns ``tensors``
    with the results written into them."""
    handle = grouped_allreduce_async(
        tensors, average, name, op, prescale_factor, postscale_factor, process_set
    )
    convert = handle._finish
    assert convert is not None  # a tensor collective's handle converts its results

    def into(outs: list[np.ndarray]) -> list[torch.Tensor]:
        with torch.no_grad():
            for t, o in zip(tensors, convert(outs), strict=True):
                t.copy_(o)
        return list(tensors)

    handle._finish = into
    return handle


def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> background.Handle:
    """``allgather`` on the background thread; ``synchronize`` returns the gathered tensor."""
    array = _copy(tensor, "allgather_async")
    return _submit(
        process_set,
        name,
        lambda c: collectives.allgather_on(c, array, name),
        lambda out: _tensor(out, tensor),
    )


def grouped_allgather_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> background.Handle:
    """``grouped_allgather`` on the background thread."""
    arrays = [_copy(t, "grouped_allgather_async") for t in tensors]
    return _submit(
        process_set,
        name,
        lambda c: [collectives.allgather_on(c, a, name) for a in arrays],
        _tensors_like(tensors),
    )


def broadcast_async(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> background.Handle:
    """``broadcast`` on the background thread; ``synchronize`` returns a new tensor."""
    array = _copy(tensor, "broadcast_async")
    root = translate_root(process_set, collectives._check_root(root_rank, "broadcast_async"))
    return _submit(
        process_set,
        name,
        lambda c: collectives.broadcast_on(c, array, root, name),
        lambda out: _tensor(out, tensor),
    )


def broadcast_async_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> background.Handle:
    """``broadcast_`` on the background thread; ``synchronize`` returns ``tensor``."""
    handle = broadcast_async(tensor, root_rank, name, process_set)

    def into(out: np.ndarray) -> torch.Tensor:
        with torch.no_grad():
            tensor.copy_(_tensor(out, tensor))
        return tensor

    handle._finish = into
    return handle


def alltoall_async(
    tensor: torch.Tensor,
    splits: Splits = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> background.Handle:
    """``alltoall`` on the background thread; ``synchronize`` returns what ``alltoall``
    would."""
    array = _copy(tensor, "alltoall_async")
    raw = _splits(splits)
    collectives._send_rows(array, raw, process_set.size())  # bad splits fail here

    def finish(
        result: tuple[np.ndarray, np.ndarray],
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        out = _tensor(result[0], tensor)
        return out if splits is None else (out, torch.from_numpy(result[1].astype(np.int32)))

    return _submit(
        process_set, name, lambda c: collectives.alltoall_on(c, array, raw, name), finish
    )


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: ReduceOp = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> background.Handle:
    """``reducescatter`` on the background thread; ``synchronize`` returns this rank's rows."""
    array = _copy(tensor, "reducescatter_async")
    collectives.mpi_op(op)

    def run(comm: MPI.Comm) -> np.ndarray:
        return collectives.reducescatter_on(
            comm, array, op, name, prescale_factor, postscale_factor
        )

    return _submit(process_set, name, run, lambda out: _tensor(out, tensor))


def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    op: ReduceOp = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> background.Handle:
    """``grouped_reducescatter`` on the background thread."""
    _check_grouped_reducescatter(tensors)
    arrays = [_copy(t, "grouped_reducescatter_async") for t in tensors]
    collectives.mpi_op(op)

    def run(comm: MPI.Comm) -> list[np.ndarray]:
        return [
            collectives.reducescatter_on(comm, a, op, name, prescale_factor, postscale_factor)
            for a in arrays
        ]

    return _submit(process_set, name, run, _tensors_like(tensors))


def sparse_allreduce_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: ReduceOp = Average,
    process_set: ProcessSet = global_process_set,
) -> Callable[[], torch.Tensor]:
    """Reduce a sparse COO tensor by gathering every rank's indices and values (duplicates
    sum when the result is coalesced). Returns a function that waits and returns the reduced
    sparse tensor, as Horovod does. ``op`` is ``Average`` or ``Sum``."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise ValueError(
            "`sparse_allreduce_async` takes a sparse COO tensor (e.g. `tensor.to_sparse()`)."
        )
    if op not in (Average, Sum):
        raise ValueError(
            f"`sparse_allreduce_async` supports hvd.Average and hvd.Sum; found {op!r}."
        )
    t = tensor.coalesce()
    values = t.values()
    if op == Average:
        values = values / process_set.size()
    prefix = "sparse_allreduce" if name is None else name
    values_handle = allgather_async(values, f"{prefix}.values", process_set)
    indices_handle = allgather_async(t.indices().t().contiguous(), f"{prefix}.indices", process_set)

    def wait() -> torch.Tensor:
        gathered_values = background.synchronize(values_handle)
        gathered_indices = background.synchronize(indices_handle)
        return torch.sparse_coo_tensor(gathered_indices.t(), gathered_values, t.size())

    return wait


def synchronize(handle: background.Handle) -> background.Result:
    """Wait for an async op; returns its result (raises the error it failed with)."""
    return background.synchronize(handle)


def poll(handle: background.Handle) -> bool:
    """True once the async op of ``handle`` has finished (``synchronize`` will not block)."""
    return background.poll(handle)


# -- model and optimizer state ---------------------------------------------------------------


def _named(params: object) -> list[tuple[str, torch.Tensor]]:
    if isinstance(params, Mapping):
        return sorted(params.items(), key=lambda kv: kv[0])
    if isinstance(params, Iterable):
        named = []
        for i, item in enumerate(params):
            if isinstance(item, tuple) and len(item) == 2:
                named.append((str(item[0]), item[1]))
            else:
                named.append((f"tensor.{i}", item))
        return named
    raise ValueError(
        f"`broadcast_parameters` takes a state_dict, named_parameters() or a list of tensors; "
        f"found {type(params).__name__}."
    )


def broadcast_parameters(params: Params, root_rank: int = 0) -> None:
    """Set every rank's tensors to ``root_rank``'s, in place: ``model.state_dict()`` or
    ``model.named_parameters()``. One broadcast per dtype; ranks whose tensors differ in names,
    shapes or dtypes get an error naming the first difference."""
    named = [(n, t) for n, t in _named(params) if isinstance(t, torch.Tensor)]
    described = [(n, tuple(t.shape), str(t.dtype)) for n, t in named]
    model_sync.check_same_tensors(described, root_rank, compare_names=True, noun="tensor")
    with torch.no_grad():
        # bfloat16 has no numpy dtype: it travels as float32.
        values = [
            (t.detach().float() if t.dtype == torch.bfloat16 else t.detach()).cpu().numpy()
            for _, t in named
        ]
        for (_, t), value in zip(
            named,
            model_sync.broadcast_by_dtype(values, root_rank, "broadcast_parameters"),
            strict=True,
        ):
            t.copy_(torch.from_numpy(value).view(t.shape))


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Give every rank ``root_rank``'s optimizer state and hyperparameters (``state_dict``).

    An optimizer that has not stepped yet has no state to send: as Horovod does, it first
    takes one step with zero gradients to create it (the parameters are restored afterwards;
    parameters without a gradient are left with a zero one)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"`broadcast_optimizer_state` takes a torch.optim.Optimizer; found "
            f"{type(optimizer).__name__}."
        )
    if not optimizer.state_dict()["state"]:
        _create_state(optimizer)
    mine = optimizer.state_dict() if state.rank() == root_rank else None
    theirs = collectives.broadcast_object(mine, root_rank=root_rank, name="optimizer_state")
    if state.rank() != root_rank:
        try:
            optimizer.load_state_dict(theirs)
        except ValueError as error:
            raise ValueError(
                f"rank {root_rank}'s optimizer state does not fit this rank's optimizer "
                f"({error}); every rank must build the same optimizer over the same model."
            ) from None


def _create_state(optimizer: torch.optim.Optimizer) -> None:
    """One local step of ``optimizer``'s own class with zero gradients, parameters kept."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    saved = [p.detach().clone() for p in params]
    sparse = isinstance(optimizer, torch.optim.SparseAdam)
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p).to_sparse() if sparse else torch.zeros_like(p)
    local_step(optimizer)
    with torch.no_grad():
        for p, value in zip(params, saved, strict=True):
            p.copy_(value)


def local_step(optimizer: torch.optim.Optimizer) -> None:
    """``step()`` of the optimizer's own class: no reduction, even when ``DistributedOptimizer``
    wrapped it (a wrapped optimizer carries ``_hvd`` and its class's own ``step`` is two
    classes up the MRO, behind the distributed mixin)."""
    if hasattr(optimizer, "_hvd"):
        type(optimizer).__mro__[2].step(optimizer)  # type: ignore[attr-defined]
    else:
        optimizer.step()
