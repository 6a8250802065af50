"""Horovod's torch collectives on tensors, with the core's semantics.

Tensors cross into the numpy core without copies where they can (``Tensor.numpy()`` and
``torch.from_numpy`` share memory); results are new CPU tensors (moved back to the input's
device when it was not the CPU). The ``*_async`` ops run on the background thread
(``background.py``) and return a handle for ``synchronize``/``poll``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from flyte_hvd.core import collectives, state
from flyte_hvd.core.collectives import Average, ReduceOp, Sum
from flyte_hvd.core.compression import Compression, Compressor
from flyte_hvd.torch import background


def _array(tensor: Any, what: str) -> np.ndarray:
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


def _tensor(array: np.ndarray, like: Any) -> torch.Tensor:
    out = torch.from_numpy(np.ascontiguousarray(array))
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


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """Reduce ``tensor`` across ranks; returns a new tensor (``op`` defaults to Average)."""
    out = collectives.allreduce(
        _array(tensor, "allreduce"), op=_resolve_op(average, op), name=name,
        compression=compression, prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
    )  # fmt: skip
    return _tensor(out, tensor)


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """``allreduce`` writing the result into ``tensor``; returns ``tensor``."""
    out = allreduce(tensor, average, name, Compression.none, op, prescale_factor, postscale_factor)
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
) -> list[torch.Tensor]:
    """Reduce many tensors with as few reductions as the fusion threshold allows."""
    outs = collectives.grouped_allreduce(
        [_array(t, "grouped_allreduce") for t in tensors], op=_resolve_op(average, op),
        name=name, compression=compression, prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
    )  # fmt: skip
    return [_tensor(o, t) for o, t in zip(outs, tensors, strict=True)]


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    """``grouped_allreduce`` writing each result into its tensor."""
    outs = grouped_allreduce(
        tensors, average, name, Compression.none, op, prescale_factor, postscale_factor
    )
    with torch.no_grad():
        for t, o in zip(tensors, outs, strict=True):
            t.copy_(o)
    return list(tensors)


def allgather(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Concatenate every rank's tensor along the first dimension (which may differ)."""
    return _tensor(collectives.allgather(_array(tensor, "allgather"), name=name), tensor)


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """Every rank gets ``root_rank``'s tensor, as a new tensor."""
    return _tensor(collectives.broadcast(_array(tensor, "broadcast"), root_rank, name), tensor)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """``broadcast`` into ``tensor`` itself; returns ``tensor``."""
    out = broadcast(tensor, root_rank, name)
    with torch.no_grad():
        tensor.copy_(out)
    return tensor


def alltoall(
    tensor: torch.Tensor, splits: Any = None, name: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Send ``splits[i]`` rows to rank ``i``; returns the rows received and their splits."""
    if isinstance(splits, torch.Tensor):
        splits = splits.tolist()
    out, received = collectives.alltoall(_array(tensor, "alltoall"), splits, name)
    return _tensor(out, tensor), torch.from_numpy(received)


def reducescatter(
    tensor: torch.Tensor, op: ReduceOp = Average, name: str | None = None
) -> torch.Tensor:
    """Reduce across ranks; rank ``i`` gets its slice of the first dimension."""
    return _tensor(collectives.reducescatter(_array(tensor, "reducescatter"), op, name), tensor)


# -- async ---------------------------------------------------------------------------------


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
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
    collectives._mpi_op(op)  # a bad op fails here, not on the thread
    flat = tensor.detach().view(-1).numpy()
    size = state.size()
    op, pre, post = background.average_as_sum(op, 1.0, size, flat.dtype.kind in "fc")
    pre *= prescale_factor
    post *= postscale_factor

    shape = tuple(tensor.shape)

    def run(comm: Any) -> torch.Tensor:
        if pre != 1.0:
            collectives._scale_in_place(flat, pre, "prescale_factor")
        background.reduce_in_place(
            comm, flat, op, Compression.none, post, name,
            lambda: f"allreduce_async_(op={op.name}, dtype={flat.dtype}, shape={shape})",
        )  # fmt: skip
        return tensor

    return background.engine().submit(run, name)


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> background.Handle:
    """``allreduce_async_`` on a copy: ``synchronize(handle)`` returns a new tensor."""
    copy = tensor.detach().to("cpu", copy=True).contiguous()
    return allreduce_async_(copy, average, name, op, prescale_factor, postscale_factor)


def synchronize(handle: background.Handle) -> Any:
    """Wait for an async op; returns its result (raises the error it failed with)."""
    if not isinstance(handle, background.Handle):
        raise ValueError(
            f"`synchronize` takes the handle an *_async op returned; found {type(handle).__name__}."
        )
    return handle.wait()


def poll(handle: background.Handle) -> bool:
    """True once the async op of ``handle`` has finished (``synchronize`` will not block)."""
    return handle.done()


def shutdown() -> None:
    """Stop the background thread, then release the communicator (``core.shutdown``)."""
    background.stop()
    state.shutdown()


# -- model and optimizer state ---------------------------------------------------------------


def _named(params: Any) -> list[tuple[str, torch.Tensor]]:
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


def broadcast_parameters(params: Any, root_rank: int = 0) -> None:
    """Set every rank's tensors to ``root_rank``'s, in place: ``model.state_dict()`` or
    ``model.named_parameters()``. One broadcast per dtype; ranks whose tensors differ in names,
    shapes or dtypes get an error naming the first difference."""
    named = [(n, t) for n, t in _named(params) if isinstance(t, torch.Tensor)]
    described = [(n, tuple(t.shape), str(t.dtype)) for n, t in named]
    everyone = collectives.allgather_object(described)
    if not isinstance(root_rank, int) or not 0 <= root_rank < len(everyone):
        raise ValueError(
            f"`root_rank`={root_rank!r} does not exist: expected [0, {len(everyone) - 1}]."
        )
    root = everyone[root_rank]
    for rank, theirs in enumerate(everyone):
        if theirs != root:
            raise ValueError(_model_mismatch(root_rank, root, rank, theirs))
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for _, t in named:
        by_dtype.setdefault(t.dtype, []).append(t)
    with torch.no_grad():
        for dtype, group in by_dtype.items():
            if dtype == torch.bfloat16:
                flat = torch.cat([t.detach().reshape(-1).float().cpu() for t in group])
            else:
                flat = torch.cat([t.detach().reshape(-1).cpu() for t in group])
            out = torch.from_numpy(
                collectives.broadcast(flat.numpy(), root_rank, name="broadcast_parameters")
            )
            offset = 0
            for t in group:
                n = t.numel()
                t.copy_(out[offset : offset + n].view(t.shape))
                offset += n


def _model_mismatch(root_rank: int, root: list[tuple], rank: int, theirs: list[tuple]) -> str:
    if len(root) != len(theirs):
        detail = f"rank {root_rank} has {len(root)} tensors, rank {rank} has {len(theirs)}"
    else:
        i = next(i for i, (a, b) in enumerate(zip(root, theirs, strict=True)) if a != b)
        detail = (
            f"tensor {i}: rank {root_rank} has `{root[i][0]}` {root[i][1]} {root[i][2]}, "
            f"rank {rank} has `{theirs[i][0]}` {theirs[i][1]} {theirs[i][2]}"
        )
    return (
        f"ranks hold different models, so their tensors cannot be broadcast: {detail}. Every "
        f"rank must build the same architecture."
    )


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Give every rank ``root_rank``'s optimizer state and hyperparameters (``state_dict``)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"`broadcast_optimizer_state` takes a torch.optim.Optimizer; found "
            f"{type(optimizer).__name__}."
        )
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
