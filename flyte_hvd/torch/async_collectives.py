"""The ``*_async`` torch collectives: each runs on the core's background thread and returns
a handle for ``synchronize``/``poll``; ``synchronize`` returns tensors as the synchronous
form (``functions``) would. Inputs are copied first, but for the in-place
``allreduce_async_``: change a tensor while its op runs and the result is undefined."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from flyte_hvd.core import background, collectives, reduce_ops
from flyte_hvd.core.compression import Compression
from flyte_hvd.core.process_sets import (
    ProcessSet,
    async_comm_of,
    global_process_set,
    translate_root,
)
from flyte_hvd.core.reduce_ops import Average, ReduceOp, Sum
from flyte_hvd.torch.tensors import (
    Splits,
    as_array,
    as_tensor,
    check_grouped_reducescatter,
    raw_splits,
    resolve_op,
)

if TYPE_CHECKING:
    from mpi4py import MPI


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
    return lambda outs: [as_tensor(o, t) for o, t in zip(outs, tensors, strict=True)]


def _copy(tensor: torch.Tensor, what: str) -> np.ndarray:
    return np.array(as_array(tensor, what), copy=True, order="C")


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
    op = resolve_op(average, op)
    reduce_ops.mpi_op(op)  # a bad op fails here, not on the thread
    flat = tensor.detach().view(-1).numpy()
    size = process_set.size()
    op, pre, post = reduce_ops.average_as_sum(op, 1.0, size, flat.dtype.kind in "fc")
    pre *= prescale_factor
    post *= postscale_factor
    shape = tuple(tensor.shape)

    def run(comm: MPI.Comm) -> torch.Tensor:
        reduce_ops.scale_in_place(flat, pre)
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
    op = resolve_op(average, op)
    reduce_ops.mpi_op(op)
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
        lambda out: as_tensor(out, tensor),
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
    root = translate_root(process_set, collectives.check_root(root_rank, "broadcast_async"))
    return _submit(
        process_set,
        name,
        lambda c: collectives.broadcast_on(c, array, root, name, owned=True),
        lambda out: as_tensor(out, tensor),
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
            tensor.copy_(as_tensor(out, tensor))
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
    raw = raw_splits(splits)
    collectives.alltoall_rows(array, raw, process_set.size())  # bad splits fail here

    def finish(
        result: tuple[np.ndarray, np.ndarray],
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        out = as_tensor(result[0], tensor)
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
    reduce_ops.mpi_op(op)

    def run(comm: MPI.Comm) -> np.ndarray:
        return collectives.reducescatter_on(
            comm, array, op, name, prescale_factor, postscale_factor
        )

    return _submit(process_set, name, run, lambda out: as_tensor(out, tensor))


def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    op: ReduceOp = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> background.Handle:
    """``grouped_reducescatter`` on the background thread."""
    check_grouped_reducescatter(tensors)
    arrays = [_copy(t, "grouped_reducescatter_async") for t in tensors]
    reduce_ops.mpi_op(op)

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
